"""A draft model under tensor parallelism, CUDA graphs against eager: decode tokens/s.

The draft engine with CUDA graphs (the target's decode / verify graphs and the draft's own, captured by every rank:
``docs/speculative.md``) against the same engine eager, and against plain decoding with graphs, on the default
model + its shipped Eagle3 draft (bf16, k = 4) over ``--tp`` GPUs.

Greedy requests of the held-out text (``bench_spec.prompts``) at each batch size; tokens/s of the whole ``generate``
call (prefill included, the same for all three), best of ``--repeat``; ratios of one run: graphs / eager (the
draft engine) and draft / plain (both on graphs). Reports whether the outputs are identical (bf16: near-ties may
part them), the share of target steps that replayed a graph and the draft steps that replayed the draft's graphs.
The engines run one after another (one TP group at a time).

    PYTHONPATH=. python benchmarks/gpu/bench_draft_tp_graphs.py --tp 2      (writes $OUT/bench_draft_tp_graphs.json)

``--device cpu`` runs the script's logic on CPU ranks (float32, no graphs there: a smoke test, not a measurement).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_spec import prompts, run_timed  # noqa: E402
from benchmarks.common import commit_id, log, save_results  # noqa: E402
from kimik3 import LLM  # noqa: E402
from kimik3.loader import DEFAULT_MODEL  # noqa: E402

SPEC = {"method": "eagle3", "model": "default", "num_speculative_tokens": 4}


def measure(mode: str, args, sizes: list[int]) -> dict[int, dict]:
    """Per batch size: (outputs, best seconds, target graph-step share, draft steps on the draft's graphs) of one
    engine: ``mode`` "plain" (graphs, no draft), "graphs" or "eager" (the draft engine)."""
    cuda = args.device == "cuda"
    kw = dict(dtype=torch.bfloat16 if cuda else torch.float32, device=args.device, tensor_parallel_size=args.tp,
              max_num_seqs=max(sizes),
              max_model_len=args.prompt_tokens + args.max_tokens + 16, enable_prefix_caching=False,
              kv_cache_memory_bytes=(1 << 30) if cuda else (1 << 26), enforce_eager=mode == "eager")
    if mode != "plain":
        kw["speculative_config"] = SPEC
    out = {}
    with LLM(str(DEFAULT_MODEL), **kw) as llm:
        e = llm.engine
        graphs = getattr(getattr(e.scheduler.drafter, "executor", None), "graphs", None)
        for b in sizes:             # the same prompts in every mode (the same tokenizer, seeds)
            batch = prompts("heldout", llm.get_tokenizer(), b, args.prompt_tokens, e.vocab_size, seed=b)
            run_timed(llm, batch[:1], 4)                    # warm
            steps0, graph0 = e.runner.num_steps, e.runner.num_graph_steps
            replays0 = graphs.num_replays if graphs is not None else 0
            best = float("inf")
            for _ in range(args.repeat):
                outs, wall, _ = run_timed(llm, batch, args.max_tokens)
                best = min(best, wall)
            share = (e.runner.num_graph_steps - graph0) / max(e.runner.num_steps - steps0, 1)
            replays = (graphs.num_replays - replays0) / args.repeat if graphs is not None else None
            out[b] = {"outs": outs, "seconds": best, "graph_step_share": round(share, 3), "draft_graph_steps": replays}
            log(mode, b, round(sum(map(len, outs)) / best, 1), "tok/s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        raise SystemExit(f"needs {args.tp} GPUs, found {torch.cuda.device_count()}")
    sizes = [int(x) for x in args.batches.split(",")]
    runs = {mode: measure(mode, args, sizes) for mode in ("plain", "graphs", "eager")}
    rows = []
    for b in sizes:
        plain, graphs, eager = (runs[m][b] for m in ("plain", "graphs", "eager"))
        n = sum(map(len, graphs["outs"]))
        rows.append({"batch": b, "plain_tok_s": round(n / plain["seconds"], 1),
                     "graphs_tok_s": round(n / graphs["seconds"], 1), "eager_tok_s": round(n / eager["seconds"], 1),
                     "graphs_over_eager": round(eager["seconds"] / graphs["seconds"], 3),
                     "draft_over_plain": round(plain["seconds"] / graphs["seconds"], 3),
                     "identical": plain["outs"] == graphs["outs"] == eager["outs"],
                     "graph_step_share": graphs["graph_step_share"], "draft_graph_steps": graphs["draft_graph_steps"]})
        log(rows[-1])
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke run, not a measurement)"
    report = {"device": f"{args.tp} x {card}", "commit": commit_id(),
              "date": datetime.date.today().isoformat(), "speculative_config": SPEC, "prompt_tokens": args.prompt_tokens,
              "max_tokens": args.max_tokens, "rows": rows}
    log(f"saved {save_results('bench_draft_tp_graphs.json', report)}")


if __name__ == "__main__":
    main()
