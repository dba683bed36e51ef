"""n-gram speculation against plain decoding at batch 1 (#18's target: never slower when the drafts are
rejected, faster when they are right), on the K3-width 4-layer slice with CUDA graphs.

A random-weight model repeats nothing and its logits are nearly flat (two runs part at near-ties),
so the slice is made to copy: its embeddings are scaled up until the embedding dominates the final
hidden state, and the LM-head row of token ``next[x]`` is set to the embedding of ``x``, so the
greedy token after ``x`` is ``next[x]`` by a wide margin (every layer still runs its random weights,
so a step costs what it always does). The real n-gram proposer and verifier then see three
workloads, each one request of ``--output`` greedy tokens, plain and with ``num_speculative_tokens``
3, timed as output tokens per second of the decode steps (each engine warmed by one pass, then
``--repeats`` timed passes, plain and speculative alternating; the speed-up is the median ratio):
- ``no_drafts``: a random prompt whose tokens have no ``next``: the continuation (random LM-head
  rows) seldom repeats an n-gram, so few drafts are proposed (the proposer's cost);
- ``rejected``: triples ``c_i c_(i+1) w_i`` with ``next[c_i] = c_(i+1)``, ending in ``c_0``: each
  output bigram ``c_i c_(i+1)`` occurs in the prompt, so the proposer drafts ``w_i ..`` at every
  step, which the model never emits (after the first failed verify step the request only watches its
  predictions, which never come true, so this stays close to plain decoding);
- ``repetitive``: ``next`` follows the prompt's own order (the model copies its prompt, as in
  editing code): every draft is right after the first token.
Plain and speculative tokens must agree (the margins leave no near-ties).

    PYTHONPATH=. python benchmarks/gpu/bench_speculative.py            (writes $OUT/bench_speculative.json)
    PYTHONPATH=. python benchmarks/gpu/bench_speculative.py --cpu      (the embedded tiny model: a smoke run)
    ... --async-scheduling   (both runs async: plain async against speculation under async)
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import commit_id, log, save_results  # noqa: E402
from kimik3.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

EMBED_SCALE = 64.0      # the embedding's share of the final hidden state (layer outputs are O(1) per element)


def make_engine(model, prompt: list[int], output: int, speculative: bool, eager: bool,
                async_scheduling: bool) -> LLMEngine:
    cfg = EngineConfig(max_num_seqs=1, max_num_batched_tokens=2048, max_model_len=len(prompt) + output + 16,
                       block_size=16, enable_prefix_caching=False, cache_memory_bytes=2 << 30,
                       enforce_eager=eager, num_speculative_tokens=3 if speculative else 0,
                       async_scheduling=async_scheduling)
    return LLMEngine(model, cfg)


def run(engine: LLMEngine, prompt: list[int], output: int, profile: bool = False) -> dict:
    """One request through ``engine``: its tokens and decode tokens/s (after the first token);
    ``profile``: the host's cProfile of the pass, top functions by own time, logged."""
    s0 = engine.stats()
    engine.add_request(f"r{time.perf_counter_ns()}", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=output, ignore_eos=True))
    tokens, t_first, steps = [], None, 0
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    while engine.has_unfinished_requests():
        for d in engine.step():
            tokens.extend(d.outputs[0].token_ids)
        if t_first is None and tokens:
            t_first, n_first = time.perf_counter(), len(tokens)
        steps += 1
    seconds = time.perf_counter() - t_first
    if prof:
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
        log(text.getvalue())
    s = engine.stats()
    return {"tokens": tokens, "decode_tok_s": (len(tokens) - n_first) / seconds, "steps": steps,
            "draft_tokens": s.num_draft_tokens - s0.num_draft_tokens,
            "accepted_tokens": s.num_accepted_tokens - s0.num_accepted_tokens}


def make_copying(model, successor: dict[int, int]) -> None:
    """Scale the embeddings by ``EMBED_SCALE`` and set LM-head row ``successor[x]`` to x's embedding."""
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    with torch.no_grad():
        embed.mul_(EMBED_SCALE)
        src = torch.tensor(list(successor), device=embed.device)
        dst = torch.tensor(list(successor.values()), device=embed.device)
        head[dst] = embed[src] / embed[src].norm(dim=-1, keepdim=True)     # unit rows, as the random ones


def workloads(vocab: int, n: int, seed: int = 0) -> tuple[dict[str, list[int]], dict[int, int]]:
    """The three prompts of about ``n`` tokens (disjoint token sets) and the successor map that makes them so."""
    rng = random.Random(seed)
    low = min(1000, vocab // 4)
    m = (n - 1) // 3
    pool = iter(rng.sample(range(low, vocab), 2 * n + 2 * m + 1))
    no_drafts = [next(pool) for _ in range(n)]
    cycle = [next(pool) for _ in range(m + 1)]           # rejected: c_0 c_1 w_0 c_1 c_2 w_1 ... c_0
    wrong = [next(pool) for _ in range(m)]
    rejected = [t for i in range(m) for t in (cycle[i], cycle[i + 1], wrong[i])] + cycle[:1]
    copy = [next(pool) for _ in range(n)]
    successor = {a: b for a, b in zip(cycle, cycle[1:] + cycle[:1])}          # the model's token after a
    successor.update({a: b for a, b in zip(copy, copy[1:] + copy[:1])})       # repetitive: the prompt's order
    return {"no_drafts": no_drafts, "rejected": rejected, "repetitive": copy}, successor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="the embedded tiny model on the CPU (a smoke run)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed passes of each engine, plain and speculative alternating (after one warm pass each)")
    ap.add_argument("--profile", action="store_true", help="log the host profile of the first timed speculative pass")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="both runs with async scheduling (speculative steps that may draft wait for the last token)")
    args = ap.parse_args()
    import kimik3
    if args.cpu:
        model, name = kimik3.load_model(kimik3.DEFAULT_MODEL, device="cpu", dtype=torch.float32), "embedded tiny K3 (CPU)"
    else:
        from benchmarks.gpu.bench_slice import CONFIG, build_slice
        model, name = build_slice(json.loads(CONFIG.read_text())), "K3-width 4-layer slice"
    eager = args.cpu
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.output > (args.prompt - 1) // 3:
        ap.error(f"--output {args.output} reaches past the rejected workload's cycle of {(args.prompt - 1) // 3 + 1} "
                 f"tokens (the output would repeat itself and its drafts come right): take --prompt >= 3 x --output + 1")
    prompts, successor = workloads(model.config.text.vocab_size, args.prompt)
    make_copying(model, successor)
    longest = max(prompts.values(), key=len)
    t0 = time.perf_counter()
    engines = {spec: make_engine(model, longest, args.output, spec, eager, args.async_scheduling) for spec in (False, True)}
    log(f"two engines built in {time.perf_counter() - t0:.1f} s")
    rows = []
    for wname, prompt in prompts.items():
        for spec, engine in engines.items():
            t0 = time.perf_counter()
            run(engine, prompt, args.output)            # the first pass compiles and captures what it meets
            log(f"{wname} {'speculative' if spec else 'plain'} warm pass: {time.perf_counter() - t0:.1f} s")
        passes = {False: [], True: []}
        for i in range(args.repeats):                   # alternating, so drifts of the machine hit both alike
            for spec, engine in engines.items():
                passes[spec].append(run(engine, prompt, args.output, args.profile and spec and i == 0))
                r = passes[spec][-1]
                log(f"{wname} {'speculative' if spec else 'plain'} pass {i}: {r['decode_tok_s']:.0f} tok/s, "
                    f"{r['steps']} steps, {r['accepted_tokens']} / {r['draft_tokens']} drafts accepted")
        plain, spec = passes[False], passes[True]
        ratios = [s["decode_tok_s"] / p["decode_tok_s"] for p, s in zip(plain, spec)]
        rows.append({"workload": wname, "plain_tok_s": statistics.median(p["decode_tok_s"] for p in plain),
                     "spec_tok_s": statistics.median(s["decode_tok_s"] for s in spec),
                     "speedup": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios),
                     "plain_steps": plain[0]["steps"], "spec_steps": spec[0]["steps"],
                     "draft_tokens": spec[0]["draft_tokens"], "accepted_tokens": spec[0]["accepted_tokens"],
                     "same_tokens": all(r["tokens"] == plain[0]["tokens"] for r in plain + spec),
                     "follows_successor": sum(successor.get(a) == b for a, b in
                                              zip([prompt[-1]] + plain[0]["tokens"], plain[0]["tokens"]))})
        log(f"{wname}: {rows[-1]}")
    print(f"# n-gram speculation (3 drafts) vs plain decoding, batch 1, {args.prompt}-token prompt, {args.output} "
          f"output tokens, model {name} made to copy, graphs {'off' if eager else 'on'}, async scheduling "
          f"{args.async_scheduling}, commit {commit_id()}, "
          f"{datetime.date.today()}")
    print(f"# medians of {args.repeats} alternating passes; speed-up: the median of the passes' ratios (min / max)")
    print("| workload | plain tok/s | speculative tok/s | speedup (min / max) | steps plain / spec "
          "| drafts accepted / proposed | same tokens | tokens = successor |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['plain_tok_s']:.0f} | {r['spec_tok_s']:.0f} | {r['speedup']:.3f} "
              f"({r['speedup_min']:.3f} / {r['speedup_max']:.3f}) | "
              f"{r['plain_steps']} / {r['spec_steps']} | {r['accepted_tokens']} / {r['draft_tokens']} | "
              f"{r['same_tokens']} | {r['follows_successor']} / {args.output} |")
    save_results("bench_speculative" + "_async" * args.async_scheduling,
                 {"commit": commit_id(), "model": name, "async_scheduling": args.async_scheduling, "rows": rows})


if __name__ == "__main__":
    main()
