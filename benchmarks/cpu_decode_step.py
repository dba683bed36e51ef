"""The CPU engine step of the default model (#52: an n=64 hostile request's steps set the innocent stream's
gaps; a 1-token completion is one prefill step): ``LLMEngine.step`` timed step by step on the embedded default
model (``kimik3.loader.DEFAULT_MODEL``, CPU, the server's default settings) with BATCH sequences decoding
(one request with n=BATCH, ``logprobs``: 20 as the hostile case asks, or none with ``--no-logprobs``), on one torch
thread by default as ``kimik3 serve`` runs on this 2-core box (the cores less one).

    python benchmarks/cpu_decode_step.py [--batches=1,65] [--steps=40] [--threads=1] [--no-logprobs] [--profile]
        [--torch-profile]

Prints per batch: the median (p10-p90) wall ms and process-CPU ms (``time.process_time``) of the decode steps
(the prefill step left out), with the load average from ``os.getloadavg`` before and after. ``--profile``: the
top functions by cumulative time over the decode steps of the largest batch (cProfile); ``--torch-profile``: the
top torch ops by self CPU time (``torch.profiler``). The box these run on is shared by several sessions: the
figures are noisy; compare runs made together, at similar load.
"""

from __future__ import annotations

import cProfile
import contextlib
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import arg  # noqa: E402
from kimik3.engine import LLM, SamplingParams  # noqa: E402

FLAGS = ("--batches=", "--steps=", "--threads=", "--no-logprobs", "--profile", "--torch-profile")


def run_steps(llm: LLM, batch: int, steps: int, logprobs: int | None, tag: str, around=None):
    """Add one request of n=``batch`` and time each decode step (inside the context manager ``around``, e.g. a
    profiler); returns (wall ms, cpu ms) lists."""
    eng = llm.engine
    params = SamplingParams(n=batch, temperature=1.0, seed=1, max_tokens=steps + 1, ignore_eos=True, logprobs=logprobs)
    eng.add_request(tag, "The quick brown fox", params)   # short: every sample's prefill fits one step
    eng.step()                                           # the prefill step (and the first token)
    eng.step()
    walls, cpus = [], []
    with around or contextlib.nullcontext():
        while eng.has_unfinished_requests():
            w, c = time.perf_counter(), time.process_time()
            eng.step()
            walls.append((time.perf_counter() - w) * 1e3)
            cpus.append((time.process_time() - c) * 1e3)
    return walls[:-1] or walls, cpus[:-1] or cpus        # the last step finishes the request: left out


def _q(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def main() -> None:
    bad = [a for a in sys.argv[1:] if not a.startswith(FLAGS)]
    if bad or "--help" in sys.argv:
        print(__doc__)
        sys.exit(2 if bad else 0)
    torch.set_num_threads(int(arg("threads", "1")))
    batches = [int(b) for b in arg("batches", "1,65").split(",")]
    steps = int(arg("steps", "40"))
    logprobs = None if "--no-logprobs" in sys.argv else 20
    llm = LLM(max_num_seqs=max(batches) + 1, max_logprobs=20)
    run_steps(llm, max(batches), 3, logprobs, "warm")
    load0 = os.getloadavg()[0]
    for i, batch in enumerate(batches):
        walls, cpus = run_steps(llm, batch, steps, logprobs, f"b{i}")
        print(f"batch {batch:3d}: wall {statistics.median(walls):7.2f} ms ({_q(walls, .1):.1f}-{_q(walls, .9):.1f}), "
              f"cpu {statistics.median(cpus):7.2f} ms ({_q(cpus, .1):.1f}-{_q(cpus, .9):.1f}) over {len(walls)} steps")
    print(f"load average {load0:.2f} -> {os.getloadavg()[0]:.2f}; torch threads {torch.get_num_threads()}; "
          f"torch {torch.__version__}")
    if "--profile" in sys.argv:
        prof = cProfile.Profile()                          # a context manager: enabled inside
        run_steps(llm, max(batches), min(steps, 10), logprobs, "prof", around=prof)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(45)
        print(out.getvalue())
    if "--torch-profile" in sys.argv:
        from torch.profiler import ProfilerActivity, profile
        tprof = profile(activities=[ProfilerActivity.CPU])
        run_steps(llm, max(batches), min(steps, 10), logprobs, "tprof", around=tprof)
        print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()
