"""n-gram speculation against plain decoding at batch 1 (#18's target: never slower when the drafts are
rejected, faster when they are right), on the K3-width 4-layer slice with CUDA graphs.

Three workloads, each one request of ``--output`` greedy tokens, plain and with
``num_speculative_tokens`` 3, timed as output tokens per second of the decode steps:
- ``no_drafts``: a random prompt; n-grams seldom repeat, so few drafts are proposed (the proposer's cost);
- ``rejected``: the prompt is a random sequence written twice, so the proposer drafts the first copy's
  continuation at every step and the random model rejects it (the pause after failed verify steps
  is what keeps this close to plain decoding);
- ``oracle``: drafts are the plain run's own next tokens (a stand-in proposer, always right): the
  most speculation can give here, labelled as such, since a random model repeats nothing by itself.

    PYTHONPATH=. python benchmarks/gpu/bench_speculative.py            (writes $OUT/bench_speculative.json)
    PYTHONPATH=. python benchmarks/gpu/bench_speculative.py --cpu      (the embedded tiny model: a smoke run)
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import commit_id, log, save_results  # noqa: E402
from kimik3.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402


def run(model, prompt: list[int], output: int, speculative: bool, eager: bool) -> dict:
    """One request through a fresh engine: its tokens and decode tokens/s (after the first token)."""
    cfg = EngineConfig(max_num_seqs=1, max_num_batched_tokens=2048, max_model_len=len(prompt) + output + 16,
                       block_size=16, enable_prefix_caching=False, cache_memory_bytes=2 << 30,
                       enforce_eager=eager, num_speculative_tokens=3 if speculative else 0)
    engine = LLMEngine(model, cfg)
    for warm in range(2):                        # the first pass compiles and captures what it meets
        s0 = engine.stats()
        engine.add_request(f"r{warm}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=output, ignore_eos=True))
        tokens, t_first, steps = [], None, 0
        while engine.has_unfinished_requests():
            for d in engine.step():
                tokens.extend(d.outputs[0].token_ids)
            if t_first is None and tokens:
                t_first, n_first = time.perf_counter(), len(tokens)
            steps += 1
        seconds = time.perf_counter() - t_first
    s = engine.stats()
    return {"tokens": tokens, "decode_tok_s": (len(tokens) - n_first) / seconds, "steps": steps,
            "draft_tokens": s.num_draft_tokens - s0.num_draft_tokens,
            "accepted_tokens": s.num_accepted_tokens - s0.num_accepted_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="the embedded tiny model on the CPU (a smoke run)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=128)
    args = ap.parse_args()
    import kimik3
    import kimik3.engine.scheduler as scheduler
    if args.cpu:
        model, name = kimik3.load_model(kimik3.DEFAULT_MODEL, device="cpu", dtype=torch.float32), "embedded tiny K3 (CPU)"
    else:
        from benchmarks.gpu.bench_slice import CONFIG, build_slice
        model, name = build_slice(json.loads(CONFIG.read_text())), "K3-width 4-layer slice"
    eager = args.cpu
    vocab = model.config.text.vocab_size
    rng = random.Random(0)
    low = min(1000, vocab // 4)
    half = [rng.randrange(low, vocab) for _ in range(args.prompt // 2)]
    workloads = {"no_drafts": [rng.randrange(low, vocab) for _ in range(args.prompt)], "rejected": half + half,
                 "oracle": [rng.randrange(low, vocab) for _ in range(args.prompt)]}
    ngram = scheduler.propose_ngram
    rows = []
    for wname, prompt in workloads.items():
        plain = run(model, prompt, args.output, False, eager)
        if wname == "oracle":
            future, start = plain["tokens"], len(prompt)
            scheduler.propose_ngram = lambda ids, k, lo, hi, data=None: list(future[len(ids) - start:len(ids) - start + k])
        try:
            spec = run(model, prompt, args.output, True, eager)
        finally:
            scheduler.propose_ngram = ngram
        same = spec["tokens"] == plain["tokens"]
        rows.append({"workload": wname, "plain_tok_s": plain["decode_tok_s"], "spec_tok_s": spec["decode_tok_s"],
                     "speedup": spec["decode_tok_s"] / plain["decode_tok_s"], "plain_steps": plain["steps"],
                     "spec_steps": spec["steps"], "draft_tokens": spec["draft_tokens"],
                     "accepted_tokens": spec["accepted_tokens"], "same_tokens": same})
        log(f"{wname}: {rows[-1]}")
    print(f"# n-gram speculation (3 drafts) vs plain decoding, batch 1, {args.prompt}-token prompt, {args.output} "
          f"output tokens, model {name}, graphs {'off' if eager else 'on'}, commit {commit_id()}, {datetime.date.today()}")
    print("| workload | plain tok/s | speculative tok/s | speedup | steps plain / spec | drafts accepted / proposed | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['plain_tok_s']:.0f} | {r['spec_tok_s']:.0f} | {r['speedup']:.2f} | "
              f"{r['plain_steps']} / {r['spec_steps']} | {r['accepted_tokens']} / {r['draft_tokens']} | {r['same_tokens']} |")
    save_results("bench_speculative", {"commit": commit_id(), "model": name, "rows": rows})


if __name__ == "__main__":
    main()
