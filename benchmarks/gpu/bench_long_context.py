"""One device call: long prompts through ``LLMEngine`` on the 4-layer slices (random bf16 weights).

For each prompt length P (8k ... 1M tokens), one request of P random tokens with the engine's
default chunk budget and cache plan (max_model_len = the longest prompt + the decoded tokens):
  * time to first token, prefill tok/s, peak GPU memory (against weights + planned cache);
  * floor = max(bytes / copy rate, FLOPs / matmul rate) with the naive-form attention FLOPs of a
    causal prompt, P^2 x heads x (d_qk + d_v) per MLA layer (``bench_slice.counts``);
  * decode: the engine's steps after the first token (CUDA graph replays at batch 1, context P),
    against the decode floor at context P (weights + KDA states + P latents per MLA layer).

With ``--replay-only`` no prompt runs: for each length, the batch-1 decode graph is replayed with
its static inputs set to a context of that length (random blocks of the cache), giving the decode
step's device time against its floor in seconds instead of a prefill's minutes.

``--block-size=N``: the engine's cache block size (default: the engine's). With ``KIMIK3_FLASH_MLA`` set and
``--block-size=64``, decode attends through FlashMLA (``kimik3/ops/cuda/flash_mla.py``).

    PYTHONPATH=. python benchmarks/gpu/bench_long_context.py [--config=PATH] [--lengths=8192,32768,...]
        [--replay-only] [--block-size=64]   (writes $OUT/bench_long_<slice>[_replay][_bs<N>][_flashmla].json)
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

import bench_slice                                                       # noqa: E402
from bench_slice import build_slice, ceilings, config_path              # noqa: E402

from benchmarks.common import commit_id, cuda_time, log, save_results       # noqa: E402

from kimik3.engine import EngineConfig, LLMEngine, SamplingParams       # noqa: E402

DECODE_TOKENS = 16
results: dict = {}


def block_size() -> int | None:
    arg = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--block-size=")), None)
    return int(arg) if arg else None


def save():
    suffix = "_replay" if "--replay-only" in sys.argv else ""
    suffix += f"_bs{block_size()}" if block_size() else ""
    suffix += "_flashmla" if os.environ.get("KIMIK3_FLASH_MLA") else ""
    save_results(f"bench_long_{config_path().stem.split('.')[0]}{suffix}.json", results)


def lengths() -> list[int]:
    arg = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--lengths=")), None)
    return [int(x) for x in arg.split(",")] if arg else [8192, 32768, 131072, 524288, 1048576]


def decode_floor(model, context: int, bw: float) -> float:
    """Bytes of one batch-1 decode step at ``context``: bench_slice.counts at that context."""
    saved, bench_slice.CONTEXT = bench_slice.CONTEXT, context
    try:
        cfg = model.config.text
        byts, flops = bench_slice.counts(model, 1, 0, "decode", cfg.num_experts_per_token)
    finally:
        bench_slice.CONTEXT = saved
    return byts / bw


def graph_replay_s(engine) -> float:
    """Device time of the batch-1 decode graph alone, replayed on the last step's inputs (the
    engine step above adds its host work: scheduling, input packing, sampling). The replays
    advance this benchmark request's KDA state; its later tokens are not looked at."""
    graphs = engine.runner.graphs
    if graphs is None or (1, 1) not in graphs.graphs:
        return float("nan")
    return cuda_time(graphs.graphs[1, 1][0].replay, warmup=2, iters=10)


def replay_at(engine, context: int, perm: torch.Tensor) -> float:
    """The batch-1 decode graph's device time with its inputs set to one sequence at ``context``
    (its blocks: the first of ``perm``, a permutation of the cache's blocks)."""
    graphs = engine.runner.graphs
    bs = engine.cache.block_size
    blocks = perm[:context // bs + 1] + 1
    graphs.meta[:, 0] = 0                                # rows: see model.cuda_graphs.pack_decode_inputs
    graphs.meta[:4, 0] = torch.tensor([1000, context, 1, int(blocks[context // bs]) * bs + context % bs])
    graphs.block_tables[0].zero_()
    graphs.block_tables[0, :len(blocks)] = blocks.to(graphs.block_tables)
    return cuda_time(graphs.graphs[1, 1][0].replay, warmup=2, iters=20)


def replay_only(model, engine, bw):
    perm = torch.randperm(engine.plan.num_blocks - 1, generator=torch.Generator().manual_seed(0))
    rows = results["rows"] = []
    for P in sorted(lengths()):
        t = replay_at(engine, P, perm)
        d_floor = decode_floor(model, P, bw)
        rows.append({"context": P, "graph_replay_ms": t * 1e3, "decode_floor_ms": d_floor * 1e3, "over_floor": t / d_floor})
        log(rows[-1])
        save()


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    results.update(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), commit=commit_id(),
                   torch=torch.__version__, config=config_path().name, block_size=block_size(),
                   flash_mla=bool(os.environ.get("KIMIK3_FLASH_MLA")))
    bw, mm = ceilings()
    results["ceilings"] = {"copy_bytes_per_s": bw, "bf16_matmul_flops": mm}
    model = build_slice(json.loads(config_path().read_text()), str(config_path()))
    weights = torch.cuda.memory_allocated()
    E = model.config.text.num_experts
    longest = max(lengths())
    sized = {"block_size": block_size()} if block_size() else {}
    cfg = EngineConfig(max_num_seqs=4, max_model_len=longest + DECODE_TOKENS + 1, enable_prefix_caching=False, **sized)
    engine = LLMEngine(model, cfg)
    planned = engine.plan.total_bytes
    results["engine"] = {"max_num_batched_tokens": cfg.max_num_batched_tokens, "plan": engine.plan.describe(),
                         "weights_bytes": weights, "cache_bytes": planned}
    log(results["engine"])
    if "--replay-only" in sys.argv:
        return replay_only(model, engine, bw)
    rows = []
    g = torch.Generator().manual_seed(0)
    vocab = model.config.text.vocab_size
    # warm-up (Triton compiles every kernel variant once): a fresh chunk, continuations whose keys
    # span one and two attention pieces (PREFILL_BLOCK), a short continuation, decode
    warm = torch.randint(1000, vocab, (4 * cfg.max_num_batched_tokens + 100,), generator=g).tolist()
    engine.add_request("warm-up", {"prompt_token_ids": warm},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False))
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    results["warm_up_s"] = time.perf_counter() - t0
    for P in sorted(lengths()):
        prompt = torch.randint(1000, vocab, (P,), generator=g).tolist()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        engine.add_request(f"p{P}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=DECODE_TOKENS + 1, ignore_eos=True, detokenize=False))
        t0 = time.perf_counter()
        ttft, steps, stamps, replay_s, step_ends = None, 0, [], float("nan"), [t0]
        while engine.has_unfinished_requests():
            deltas = engine.step()
            torch.cuda.synchronize()
            now = time.perf_counter()
            steps += 1
            if ttft is None:
                step_ends.append(now)
            if any(d.outputs and d.outputs[0].token_ids for d in deltas):
                if ttft is None:
                    ttft = now - t0
                stamps.append(now)
                if len(stamps) == DECODE_TOKENS - 1:
                    replay_s = graph_replay_s(engine)
        peak = torch.cuda.max_memory_allocated()
        byts, flops = bench_slice.counts(model, 1, P, "prefill", E)
        floor = max(byts / bw, flops / mm)
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        t_dec = statistics.median(gaps) if gaps else float("nan")
        d_floor = decode_floor(model, P, bw)
        row = {"prompt": P, "ttft_s": ttft, "prefill_tok_s": P / ttft, "prefill_floor_s": floor,
               "prefill_over_floor": ttft / floor, "attention_flops": flops, "matmul_fraction": flops / ttft / mm,
               "peak_bytes": peak, "peak_over_weights_plus_cache_gib": (peak - weights - planned) / 2 ** 30,
               "prefill_steps": steps - DECODE_TOKENS,
               "prefill_step_ms": [round((b - a) * 1e3, 1) for a, b in zip(step_ends, step_ends[1:])][:64], "decode_step_ms": t_dec * 1e3, "decode_floor_ms": d_floor * 1e3,
               "decode_over_floor": t_dec / d_floor, "graph_replay_ms": replay_s * 1e3,
               "graph_replay_over_floor": replay_s / d_floor}
        rows.append(row)
        log(row)
        results["rows"] = rows
        save()
    log("\n| prompt | TTFT s | prefill tok/s | floor s | time/floor | peak GiB (over weights+cache) "
        "| decode ms | graph replay ms | decode floor ms | decode/floor | replay/floor |")
    log("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        log(f"| {r['prompt']} | {r['ttft_s']:.2f} | {r['prefill_tok_s']:.0f} | {r['prefill_floor_s']:.2f} "
            f"| {r['prefill_over_floor']:.2f} | {r['peak_bytes'] / 2**30:.1f} ({r['peak_over_weights_plus_cache_gib']:+.1f}) "
            f"| {r['decode_step_ms']:.2f} | {r['graph_replay_ms']:.2f} | {r['decode_floor_ms']:.2f} "
            f"| {r['decode_over_floor']:.2f} | {r['graph_replay_over_floor']:.2f} |")


if __name__ == "__main__":
    main()
