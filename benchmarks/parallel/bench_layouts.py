"""Multi-GPU layouts end to end through ``LLM`` (one node: rank 0 spawns the workers): per layout, greedy
decode throughput of a batch of requests against one rank in the same run (ratio), and whether its greedy
tokens equal one rank's (bf16 on GPUs may differ in late tokens; float64 on CPU ranks must not).

    python benchmarks/parallel/bench_layouts.py --tiny                              # CPU ranks, float64
    python benchmarks/parallel/bench_layouts.py --model /path/ckpt --device cuda \\
        --layouts tp2,pp2,pp2-mb1,tp2-dcp2,tp2-ep-eplb2,pp2-tp2 --out results/layouts_h200x4.json   # 2-4 GPUs

A layout names its degrees joined by "-": tpN, ppN, mbN (pipeline micro-batches per step; default one per stage,
mb1 runs each step whole), dcpN, ep (whole experts over the TP ranks), eplbR (EPLB with R redundant slots; implies
ep). Timings: wall clock of ``LLM.generate`` after one warm-up request. An EPLB layout then rebalances live
(``LLM.rebalance_experts``) and runs the batch again: the max/mean of the EP ranks' measured loads before (mean over
the MoE layers) and as planned after, the tok/s and the tokens after.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LAYOUT_PART = re.compile(r"^(tp|pp|mb|dcp|eplb)(\d+)$|^ep$")


def parse_layout(name: str) -> dict:
    """"tp2-dcp2" -> LLM keyword arguments (ValueError naming a part it does not know)."""
    kw: dict = {}
    for part in name.split("-"):
        m = LAYOUT_PART.match(part)
        if not m:
            raise ValueError(f"layout {name!r}: unknown part {part!r} (tpN, ppN, mbN, dcpN, ep, eplbR)")
        if part == "ep":
            kw["enable_expert_parallel"] = True
        else:
            key = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size", "mb": "pp_micro_batches",
                   "dcp": "decode_context_parallel_size"}.get(m[1])
            if key:
                kw[key] = int(m[2])
            else:
                kw.update(enable_expert_parallel=True, enable_eplb=True, num_redundant_experts=int(m[2]))
    return kw


def skew_routers(path: Path, hot: list[int], boost: float = 0.2) -> None:
    """Raise experts ``hot``'s score-correction bias in every router of the checkpoint at ``path``."""
    from safetensors.torch import load_file, save_file
    for f in sorted(path.glob("*.safetensors")):
        tensors = load_file(f)
        for name, t in tensors.items():
            if name.endswith("gate.e_score_correction_bias"):
                t[hot] += boost
        save_file(tensors, f, metadata={"format": "pt"})


def run(model: str | None, layout: dict, args, prompts: list[list[int]]) -> tuple[list[list[int]], float, dict]:
    """(greedy tokens, seconds, EPLB extras: the live rebalance's report and the batch run again after it)."""
    from kimik3.engine import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    extra: dict = {}
    with LLM(model, dtype=args.dtype, device=args.device, max_model_len=args.prompt_len + args.max_tokens + 8,
             block_size=args.block_size, max_num_seqs=len(prompts), **layout) as llm:
        llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)          # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        if layout.get("enable_eplb"):
            report = llm.rebalance_experts()
            t0 = time.perf_counter()
            again = llm.generate(batch, params, use_tqdm=False)
            extra = {"eplb_before": sum(a for a, _ in report.values()) / len(report),
                     "eplb_planned": sum(b for _, b in report.values()) / len(report),
                     "seconds_after": time.perf_counter() - t0,
                     "same_after": [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]}
    return [o.outputs[0].token_ids for o in outs], seconds, extra


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: a tiny K3 with --tiny)")
    p.add_argument("--tiny", action="store_true", help="write a tiny random K3 (4 heads) and run on CPU ranks")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="default: float64 with --tiny, else auto")
    p.add_argument("--layouts", default="tp2,pp2,pp2-mb1,tp2-dcp2,tp2-ep-eplb2",
                   help="comma-separated layouts (default: tp2,pp2,pp2-mb1,tp2-dcp2,tp2-ep-eplb2)")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--skew-experts", default="2,4",
                   help="with --tiny: experts every router prefers (score-correction bias +0.2), a skewed load for "
                        "EPLB that the even placement leaves on one rank (default: 2,4; '' for none)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    layouts = {name: parse_layout(name) for name in args.layouts.split(",")}
    model = args.model
    if args.tiny:
        from kimik3.testing import make_tiny_checkpoint
        model = str(make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "k3", "kimi_k3", seed=0, num_heads=4,
                                         vision=False))
        if args.skew_experts:
            skew_routers(Path(model), [int(x) for x in args.skew_experts.split(",")])
        args.device = args.device or "cpu"
        args.dtype = args.dtype or "float64"
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or "auto"
    from kimik3.config import load_config
    vocab = load_config(model).text.vocab_size if model else 4352
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]
    base_tokens, base_s, _ = run(model, {}, args, prompts)
    n = args.requests * args.max_tokens
    rows = {"1 rank": {"tok_s": n / base_s, "ratio": 1.0, "same_tokens": True}}
    for name, kw in layouts.items():
        tokens, seconds, extra = run(model, kw, args, prompts)
        rows[name] = {"tok_s": n / seconds, "ratio": base_s / seconds, "same_tokens": tokens == base_tokens}
        if extra:
            rows[name].update(extra, tok_s_after=n / extra["seconds_after"],
                              same_tokens=tokens == base_tokens and extra["same_after"])
    card = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU ranks (gloo)"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"card": card, "commit": commit, "date": datetime.date.today().isoformat(), "model": model,
              "dtype": args.dtype, "requests": args.requests, "prompt_len": args.prompt_len,
              "max_tokens": args.max_tokens, "layouts": rows}
    print(f"{card}, {commit}, {args.dtype}: {args.requests} requests x {args.max_tokens} tokens, "
          f"prompt {args.prompt_len}")
    for name, r in rows.items():
        print(f"  {name:<16} {r['tok_s']:9.1f} tok/s  x{r['ratio']:.2f} of one rank  "
              f"{'same tokens' if r['same_tokens'] else 'TOKENS DIFFER'}")
        if "eplb_before" in r:
            print(f"  {'':<16} live rebalance: max/mean per EP rank {r['eplb_before']:.3f} measured -> "
                  f"{r['eplb_planned']:.3f} planned; {r['tok_s_after']:.1f} tok/s after")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if all(r["same_tokens"] for r in rows.values()) or args.dtype not in ("float64",) else 1


if __name__ == "__main__":
    sys.exit(main())
