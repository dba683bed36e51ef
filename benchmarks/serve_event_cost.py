"""CPU cost of a streaming response waiting for its next engine event (``kimik3.serve.exchange``): STREAMS
responses, each woken once a step for STEPS steps, as the engine thread's deltas wake them. Two ways the server
waits: awaiting the job's queue directly (a stream, whose disconnect Starlette watches) and the timed wait that
also polls the client (a non-streaming request). Prints microseconds of event-loop time per event, min / median /
max of REPEATS runs; at 64 streams every microsecond is 64 us of a decode step's host time on the event loop's
thread (which shares the GIL with the engine thread).

    python benchmarks/serve_event_cost.py
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import commit_id            # noqa: E402
from kimik3.serve.engine_loop import Job            # noqa: E402
from kimik3.serve.exchange import _Exchange         # noqa: E402

STREAMS, STEPS, REPEATS = 64, 300, 5


class _Connected:
    async def is_disconnected(self) -> bool:
        return False


async def _run(watched: bool) -> float:
    exchanges = []
    for i in range(STREAMS):
        ex = _Exchange(None, _Connected(), Job(f"j{i}", [], None), 0, None)
        ex.watch_disconnect = watched
        exchanges.append(ex)

    async def consume(ex):
        for _ in range(STEPS):
            await ex.next_event()
    tasks = [asyncio.create_task(consume(ex)) for ex in exchanges]
    await asyncio.sleep(0)
    t0 = time.perf_counter()
    for step in range(STEPS):
        for ex in exchanges:            # not lists: the wait alone, no metrics
            ex.job.queue.put_nowait(step)
        while any(ex.job.queue.qsize() for ex in exchanges):
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return (time.perf_counter() - t0) / (STREAMS * STEPS)


def main() -> None:
    print(f"# event wait per stream and step, {STREAMS} streams x {STEPS} steps, {REPEATS} runs, commit {commit_id()}")
    print("| wait | us per event (min / median / max) |")
    print("|---|---|")
    for name, watched in (("stream: the queue awaited", False), ("watched: timed wait + disconnect poll", True)):
        runs = [asyncio.run(_run(watched)) * 1e6 for _ in range(REPEATS)]
        print(f"| {name} | {min(runs):.1f} / {statistics.median(runs):.1f} / {max(runs):.1f} |")


if __name__ == "__main__":
    main()
