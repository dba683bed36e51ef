"""The draft's own step (``model/draft_step.DraftExecutor.run``: catch-up + one forward per draft position) eager
against its CUDA graphs (``model/draft_graphs.py``), on the default model's shipped Eagle3 draft (bf16).

A decode step's draft work as the engine gives it after a verify step: every one of ``--batches`` requests
catches up 2 rows (its input and one accepted draft) at a context of ``--context`` tokens and drafts ``d``
tokens (d = 1 .. k). Target states are random (the draft's cost does not depend on their values). Timed as the
host sees it (the call, which ends with the drafts on the host), median of ``--iters`` after a warm-up; ratio =
eager / graphs in one run. The drafts of both paths are compared (bf16: equal but for near-ties).

    PYTHONPATH=. python benchmarks/gpu/bench_draft_graphs.py        (writes $OUT/bench_draft_graphs.json)
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import commit_id, log, save_results  # noqa: E402
import kimik3  # noqa: E402
from kimik3.loader.drafts import load_draft  # noqa: E402
from kimik3.model.draft_attention import extend_tables  # noqa: E402
from kimik3.model.draft_graphs import DraftGraphs, capture_draft_or_none  # noqa: E402
from kimik3.model.draft_step import DraftExecutor, DraftWork, draft_cache_shape  # noqa: E402

BS = 16


def work_of(batch: int, context: int, depth: int, blocks_each: int, scratch_from: int, block_size: int = BS,
            rows_each: int = 3) -> tuple[DraftWork, int]:
    """Each request's first 2 of its ``rows_each`` rows of the target's step caught up (at context - 2 and - 1), then
    ``depth`` drafts from the second; (the work, the target step's rows)."""
    BS = block_size
    rows, ids, pos, slots, heads, tables = [], [], [], [], [], []
    for i in range(batch):
        table = list(range(1 + i * blocks_each, 1 + (i + 1) * blocks_each))
        start = context - 2
        rows.extend([rows_each * i, rows_each * i + 1])  # a rejected draft's row after them is not caught up
        pos.extend([start, start + 1])
        slots.extend(table[p // BS] * BS + p % BS for p in (start, start + 1))
        ids.extend([100 + i, 200 + i])
        heads.append(len(rows) - 1)
        tables.append(table)
    scratch = [[scratch_from + 2 * i, scratch_from + 2 * i + 1] for i in range(batch)]
    tables = extend_tables([depth] * batch, [context] * batch, tables, BS, scratch)
    return DraftWork(rows, ids, pos, slots, heads, [depth] * batch, tables), rows_each * batch


def host_us(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    target = kimik3.load_model(kimik3.DEFAULT_MODEL, device="cuda", dtype=torch.bfloat16)
    draft = load_draft("eagle3", "default", target)
    batches = [int(b) for b in args.batches.split(",")]
    max_len = args.context + 2 * args.k + BS
    blocks_each = -(-max_len // BS)
    total = 1 + max(batches) * (blocks_each + 2)
    cache = torch.randn(draft_cache_shape(draft, total, BS), device="cuda").to(torch.bfloat16)
    eager = DraftExecutor(draft, cache, BS)
    graphed = DraftExecutor(draft, cache, BS)
    graphed.graphs = capture_draft_or_none(DraftGraphs(draft, cache, BS, max(batches), max_len, args.k,
                                                       target.dtype))
    assert graphed.graphs is not None, "the draft's graphs did not capture"
    width = len(draft.aux_layer_ids) * target.config.text.hidden_size
    rows = []
    for b in batches:
        for d in range(1, args.k + 1):
            work, T = work_of(b, args.context, d, blocks_each, 1 + max(batches) * blocks_each)
            states = torch.randn(T, width, device="cuda", dtype=target.dtype)
            want, got = eager.run(work, states), graphed.run(work, states)
            same = sum(w == g for w, g in zip(want, got)) / max(len(want), 1)
            t_eager = host_us(lambda: eager.run(work, states), args.iters)
            t_graph = host_us(lambda: graphed.run(work, states), args.iters)
            rows.append({"batch": b, "depth": d, "context": args.context, "eager_us": round(t_eager, 1),
                         "graph_us": round(t_graph, 1), "eager_over_graph": round(t_eager / t_graph, 3),
                         "same_drafts_share": round(same, 3)})
            log(rows[-1])
    report = {"device": torch.cuda.get_device_name(), "commit": commit_id(), "date": datetime.date.today().isoformat(),
              "draft": "default eagle3 (bf16)", "rows": rows}
    log(f"saved {save_results('bench_draft_graphs.json', report)}")


if __name__ == "__main__":
    main()
