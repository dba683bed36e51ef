"""Speculative decoding with a draft model against plain decoding: decode tokens/s and acceptance.

For each batch size (``--batches``) and prompt kind -- ``heldout`` (windows of the default model's held-out text:
``.corpus/val.txt`` when prepared, else ``tests/data/default_model_heldout.txt``) and ``random`` (uniform random
token ids: the adversarial case, where drafts fail) -- it runs the same greedy requests through a plain engine and
one with ``--speculative-config`` (default: the Eagle3 draft shipped with the default model, k = 4), checks that
both produce the same tokens, and reports generated tokens per second of the whole ``generate`` call (prefill
included, the same for both), the ratio draft/plain, and the draft's mean accepted length (1 + accepted drafts per
verify step, vLLM's definition) with the acceptance rate at each draft position. ``--eager-draft-engine`` also times
the draft engine with ``enforce_eager`` (on a GPU: what the CUDA graphs of its decode and verify steps give, the
ratio graphs/eager of one run, and the share of the draft engine's steps that replayed a graph; ``draft_graph_steps``:
the draft's own steps that replayed its graphs, ``model/draft_graphs.py``).
``cpu_time_ratio``: the same ratio by this process's CPU seconds (on a shared CPU machine, where other processes
stretch wall time, the steadier of the two; on a GPU the host's time only). ``--repeat``: alternating runs of the
two engines, the best of each kept.

    python benchmarks/bench_spec.py                                   # CPU, default model + shipped draft
    python benchmarks/bench_spec.py --device cuda --dtype bfloat16 --out bench_out/spec.json
    python benchmarks/bench_spec.py --device cuda --dtype bfloat16 --eager-draft-engine --out bench_out/spec_graphs.json
    python benchmarks/bench_spec.py --batches 1 --kinds heldout --windows 8 --speculative-config \
        '{"method": "eagle3", "model": "default", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": [[1, 512, 4]]}'
                                      # fixed depth 4 (vLLM's table; no controller): the draft's mean accepted length
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kimik3 import LLM, SamplingParams  # noqa: E402
from kimik3.loader import DEFAULT_MODEL  # noqa: E402

HELDOUT = [ROOT / ".corpus" / "val.txt", ROOT / "tests" / "data" / "default_model_heldout.txt"]


def prompts(kind: str, tok, n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    if kind == "random":
        return [[rng.randrange(vocab - 256) for _ in range(length)] for _ in range(n)]
    text = next(p for p in HELDOUT if p.is_file()).read_text()
    ids = tok.encode(text)
    stride = max(1, (len(ids) - length) // max(n, 1))
    return [ids[i * stride:i * stride + length] for i in range(n)]


def run(llm: LLM, batch: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    outs, wall, _ = run_timed(llm, batch, max_tokens)
    return outs, wall


def run_timed(llm: LLM, batch: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, float]:
    """(outputs, wall seconds, this process's CPU seconds) of one ``generate`` call."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0, time.process_time() - c0


def run_windows(llm: LLM, batch: list[list[int]], max_tokens: int, size: int = 0):
    """``run_timed`` of the prompts ``size`` at a time (one ``generate`` call each; 0: all at once): the outputs
    in order, the wall and CPU seconds summed."""
    size = size or len(batch)
    outs, wall, cpu = [], 0.0, 0.0
    for i in range(0, len(batch), size):
        o, w, c = run_timed(llm, batch[i:i + size], max_tokens)
        outs, wall, cpu = outs + o, wall + w, cpu + c
    return outs, wall, cpu


def timed_pair(plain: LLM, drafted: LLM, batch: list[list[int]], max_tokens: int, repeat: int, size: int = 0):
    """Alternating runs of both engines: (plain outputs, draft outputs, best wall and CPU seconds of each).
    ``size``: the prompts go ``size`` at a time (``run_windows``)."""
    best = {"plain": [float("inf")] * 2, "spec": [float("inf")] * 2}
    for _ in range(repeat):
        for name, llm in (("plain", plain), ("spec", drafted)):
            outs, wall, cpu = run_windows(llm, batch, max_tokens, size)
            best[name] = [min(best[name][0], wall), min(best[name][1], cpu)]
            if name == "plain":
                out_plain = outs
            else:
                out_spec = outs
    return out_plain, out_spec, best["plain"], best["spec"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--speculative-config", default='{"method": "eagle3", "model": "default", "num_speculative_tokens": 4}')
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--kinds", default="heldout,random")
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs of each case (the best is kept)")
    ap.add_argument("--windows", type=int, default=1,
                    help="batches per case: a batch-b case runs windows x b prompts, b at a time (more text measured)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    ap.add_argument("--eager-draft-engine", action="store_true",
                    help="also time the draft engine with enforce_eager (graphs vs eager on a GPU)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    common = dict(dtype=args.dtype, max_model_len=args.prompt_tokens + args.max_tokens + 16, max_num_seqs=32,
                  enable_prefix_caching=False, **({"device": args.device} if args.device else {}))
    if (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda"):
        common["kv_cache_memory_bytes"] = 2 << 30   # two or three engines share one GPU: each gets a cache, not 0.9 of it
    spec = json.loads(args.speculative_config)
    plain = LLM(args.model, **common)
    drafted = LLM(args.model, speculative_config=spec, **common)
    eager = LLM(args.model, speculative_config=spec, enforce_eager=True, **common) if args.eager_draft_engine else None
    tok = plain.get_tokenizer()
    vocab = plain.engine.vocab_size
    rows = []
    for kind in args.kinds.split(","):
        for b in (int(x) for x in args.batches.split(",")):
            batch = prompts(kind, tok, b * args.windows, args.prompt_tokens, vocab, seed=b)
            run(plain, batch[:b], 4)     # warm both engines at the case's batch size: the draft controller's first
            run(drafted, batch[:b], 4)   # steps at a new batch size explore (one draft each), not its steady state
            e = drafted.engine
            before = (e.num_drafts, e.num_accepted_tokens, list(e.accepted_per_position))
            steps0 = (e.runner.num_steps, e.runner.num_graph_steps)
            draft_graphs = getattr(getattr(e.scheduler.drafter, "executor", None), "graphs", None)
            replays0 = draft_graphs.num_replays if draft_graphs is not None else 0
            t_eager = float("inf")
            out_plain, out_spec, (t_plain, c_plain), (t_spec, c_spec) = timed_pair(plain, drafted, batch,
                                                                                   args.max_tokens, args.repeat, b)
            steps = (e.runner.num_steps - steps0[0], e.runner.num_graph_steps - steps0[1])
            if eager is not None:
                run(eager, batch[:1], 4)
                for _ in range(args.repeat):
                    out_eager, t, _ = run_windows(eager, batch, args.max_tokens, b)
                    t_eager = min(t_eager, t)
            drafts = (e.num_drafts - before[0]) / args.repeat
            accepted = (e.num_accepted_tokens - before[1]) / args.repeat
            per_pos = [(a - (before[2][j] if j < len(before[2]) else 0)) / args.repeat / max(drafts, 1)
                       for j, a in enumerate(e.accepted_per_position)]
            n_tok = sum(len(o) for o in out_plain)
            rows.append({"kind": kind, "batch": b, "identical": out_plain == out_spec,
                         "plain_tok_s": round(n_tok / t_plain, 1), "spec_tok_s": round(n_tok / t_spec, 1),
                         "ratio": round(t_plain / t_spec, 3), "cpu_time_ratio": round(c_plain / c_spec, 3),
                         "verify_steps": drafts,
                         "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else None,
                         "acceptance_per_position": [round(x, 3) for x in per_pos],
                         "graph_step_share": round(steps[1] / max(steps[0], 1), 3),
                         "draft_graph_steps": (draft_graphs.num_replays - replays0) / args.repeat
                         if draft_graphs is not None else None})
            if eager is not None:
                rows[-1].update(eager_spec_tok_s=round(n_tok / t_eager, 1), graphs_vs_eager=round(t_eager / t_spec, 3),
                                eager_identical=out_eager == out_spec)
            print(json.dumps(rows[-1]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    report = {"device": device, "commit": commit, "date": datetime.date.today().isoformat(), "model": args.model,
              "speculative_config": spec, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
              "windows": args.windows, "torch_threads": torch.get_num_threads(), "rows": rows}
    print(f"\n{device}, commit {commit}, {report['date']}; {spec}")
    print(f"{'prompts':>8} {'batch':>5} {'plain tok/s':>11} {'draft tok/s':>11} {'ratio':>6} {'cpu-s ratio':>11} "
          f"{'accepted len':>12}  same")
    for r in rows:
        print(f"{r['kind']:>8} {r['batch']:>5} {r['plain_tok_s']:>11} {r['spec_tok_s']:>11} {r['ratio']:>6} "
              f"{r['cpu_time_ratio']:>11} {str(r['mean_accepted_length']):>12}  {r['identical']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    if not all(r["identical"] for r in rows):      # exact in fp32 (tests); bf16 verify rows may break near-ties
        print("note: some outputs differ from plain decoding (bf16 near-ties between a verify row and a decode row?)")


if __name__ == "__main__":
    main()
