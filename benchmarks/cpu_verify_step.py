"""The target's verify step against a plain decode step on the CPU (#55: the verify step's cost caps speculative
decoding): one plain decode step of BATCH sequences and one verify step of BATCH sequences with k = 4 drafts each
(5 rows a sequence, the shipped Eagle3 draft at a fixed depth) are captured from real greedy ``generate`` calls of
the embedded default model, then each is replayed (``ModelRunner.run``: the packed forward and the sampled rows'
logits; the cache rows it writes are the same each time) and timed by process CPU time (``time.process_time``)
and wall time.

A mixed verify step (``--mixed=4``: that many sequences with 2 rows, the last token and one draft, the rest 1 row,
as a step where only a few requests carry drafts) and an all-1-row step are cut from the captured verify step
(``ForwardBatch.build`` over the same slots and blocks).

    python benchmarks/cpu_verify_step.py [--batches=1,32] [--steps=25] [--threads=1] [--mixed=4]

Prints per batch the median CPU and wall ms of each step and their ratio verify / decode. The box these run on is
shared: compare runs made together, at similar load (or alternate two trees' runs).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import arg, log  # noqa: E402
from kimik3 import LLM, SamplingParams  # noqa: E402
from kimik3.model.batch import ForwardBatch  # noqa: E402

SPEC = {"method": "eagle3", "model": "default", "num_speculative_tokens": 4,
        "num_speculative_tokens_per_batch_size": [[1, 512, 4]]}


def capture(batch: int) -> dict:
    """{"decode" | "verify": (runner, input ids, ForwardBatch, rows)}: the first plain decode step of ``batch``
    sequences and the first verify step with 5 rows for each of ``batch`` sequences."""
    common = dict(max_model_len=128, max_num_seqs=max(batch, 1), enable_prefix_caching=False)
    got = {}
    for name, llm in (("decode", LLM(**common)), ("verify", LLM(speculative_config=SPEC, **common))):
        runner = llm.engine.runner
        run = runner.run

        def record(ids, fb, rows, name=name, runner=runner, run=run):
            lens = fb.query_lens_cpu
            wanted = fb.is_decode if name == "decode" else (fb.row_state_slots is not None and set(lens) == {5})
            if wanted and len(lens) == batch and name not in got:
                got[name] = (runner, ids.clone(), fb, list(rows))
            return run(ids, fb, rows)
        runner.run = record
        prompts = [{"prompt_token_ids": [300 + i + j for j in range(48)]} for i in range(batch)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        runner.run = run
    return got


def cut(step, rows_per_seq: list[int]):
    """The captured verify step with sequence n's first ``rows_per_seq[n]`` rows (its slots and blocks as captured;
    every row's logits sampled, as a verify step does)."""
    runner, ids, fb, _ = step
    starts = fb.cu_seqlens[:-1].tolist()
    keep = [s + r for s, q in zip(starts, rows_per_seq) for r in range(q)]
    tables = [[b for b in row if b >= 0] for row in fb.block_tables.tolist()]
    cut_fb = ForwardBatch.build(rows_per_seq, fb.context_lens_cpu, fb.state_slots.tolist(), tables,
                                runner.batches.block_size)
    return runner, ids[keep].clone(), cut_fb, list(range(len(keep)))


def time_steps(step, n: int) -> tuple[float, float]:
    """Median CPU and wall ms of ``n`` replays of a captured step."""
    runner, ids, fb, rows = step
    cpu, wall = [], []
    with torch.inference_mode():
        for _ in range(n):
            c, w = time.process_time(), time.perf_counter()
            runner.run(ids, fb, rows)
            cpu.append((time.process_time() - c) * 1e3)
            wall.append((time.perf_counter() - w) * 1e3)
    return statistics.median(cpu), statistics.median(wall)


def main() -> None:
    torch.set_num_threads(int(arg("threads", "1")))
    steps = int(arg("steps", "25"))
    for batch in (int(b) for b in arg("batches", "1,32").split(",")):
        got = capture(batch)
        mixed = min(int(arg("mixed", "4")), batch)
        got["mixed"] = cut(got["verify"], [2] * mixed + [1] * (batch - mixed))
        got["one row"] = cut(got["verify"], [1] * batch)
        res = {}
        for name in got:
            time_steps(got[name], 3)                       # warm
        for name in got:
            res[name] = time_steps(got[name], steps)
        (dc, dw), (vc, vw) = res["decode"], res["verify"]
        log(f"batch {batch:3d}: decode cpu {dc:7.2f} ms (wall {dw:7.2f}), verify (5 rows a sequence) cpu {vc:7.2f} ms "
            f"(wall {vw:7.2f}); verify / decode cpu {vc / dc:.3f}, wall {vw / dw:.3f}")
        for name, what in (("mixed", f"{mixed} of {batch} sequences 2 rows, the rest 1"), ("one row", "every sequence 1 row")):
            c, w = res[name]
            log(f"batch {batch:3d}: verify cut ({what}) cpu {c:7.2f} ms (wall {w:7.2f}); / decode cpu {c / dc:.3f}")
    log(f"torch threads {torch.get_num_threads()}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
