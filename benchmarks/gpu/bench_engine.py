"""Engine-level decode on one GPU, CUDA graphs vs eager, on the K3-width 4-layer slice (random
weights, bf16; ``kimi-k3-slice4.config.json``). One device call:

  (a) decode step at batch 1/8/32 over ~512-token contexts (max_model_len 4096): wall time of
      ``LLMEngine.step`` (scheduler + runner + sampling + bookkeeping), the device time of the same
      step (graph replay timed with CUDA events), and the host overhead = wall - device, with the
      runner's share of it (batch building) — graphs on and off, and graphs with async scheduling
      (its wall time per step should approach the device time: the host work overlaps it);
  (b) an offline workload (64 requests, prompts 128-512 tokens, 64 output tokens each, max_num_seqs
      32): end-to-end output tokens/s, in each of the three modes, each timed on its second pass over the
      same mix with the prefix cache emptied in between (run 1 had no warm-up and run 2 warmed up
      on another mix: prefill shapes then still JIT-compiled during the timed pass).

    PYTHONPATH=. python benchmarks/gpu/bench_engine.py        (writes $OUT/bench_engine.json)
"""

from __future__ import annotations

import datetime
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import commit_id, cuda_time, drain, log, save_results  # noqa: E402
from benchmarks.gpu.bench_slice import CONFIG, build_slice  # noqa: E402
from kimik3.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

results: dict = {}
PROMPT = 512
STEPS = 40


def make(model, eager: bool, max_num_seqs: int, async_scheduling: bool = False) -> LLMEngine:
    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096, max_model_len=4096, block_size=16,
                       enable_prefix_caching=True, cache_memory_bytes=6 << 30, enforce_eager=eager,
                       async_scheduling=async_scheduling)
    t0 = time.perf_counter()
    engine = LLMEngine(model, cfg)
    log(f"engine (enforce_eager={eager}, async_scheduling={async_scheduling}) ready in {time.perf_counter() - t0:.1f}s")
    return engine


def decode_steps(engine: LLMEngine, batch: int, rng: random.Random) -> dict:
    vocab = engine.vocab_size
    params = SamplingParams(temperature=0, max_tokens=STEPS + 20, ignore_eos=True)
    rids = []
    for i in range(batch):
        rid = f"d{batch}-{i}-{rng.random()}"
        engine.add_request(rid, {"prompt_token_ids": [rng.randrange(1000, vocab) for _ in range(PROMPT)]}, params)
        rids.append(rid)
    while engine.scheduler.waiting or any(r.num_output_tokens < 2 for r in engine.scheduler.running):
        engine.step()
    r, s0 = engine.runner, engine.stats()
    walls = []
    for _ in range(STEPS):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    s1 = engine.stats()
    n = s1.num_steps - s0.num_steps
    prepare = s1.prepare_seconds - s0.prepare_seconds
    row = {"batch": batch, "graph_steps": s1.num_graph_steps - s0.num_graph_steps, "steps": n,
           "wall_ms": statistics.median(walls) * 1e3,
           "runner_prepare_ms": prepare / n * 1e3,
           "runner_launch_ms": (s1.model_seconds - s0.model_seconds) / n * 1e3,
           "runner_sample_ms": (s1.host_seconds - s0.host_seconds - prepare) / n * 1e3}
    if r.graphs is not None:
        size = r.graphs.size_for(batch)
        graph, _ = r.graphs.graphs[size, 1]
        row["device_ms"] = cuda_time(graph.replay, iters=20) * 1e3     # replays the last step's inputs (state is garbage after)
        row["host_overhead_ms"] = row["wall_ms"] - row["device_ms"]
        row["host_share"] = row["host_overhead_ms"] / row["wall_ms"]
    for rid in rids:
        engine.abort_request(rid)
    engine.step()
    return row


def offline(engine: LLMEngine, seed: int, tag: str) -> dict:
    rng = random.Random(seed)
    vocab = engine.vocab_size
    reqs = [[rng.randrange(1000, vocab) for _ in range(rng.randint(128, 512))] for _ in range(64)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n_out = drain(engine, [(f"{tag}-{seed}-{i}", p) for i, p in enumerate(reqs)], params)
    dt = time.perf_counter() - t0
    return {"requests": len(reqs), "prompt_tokens": sum(map(len, reqs)), "output_tokens": n_out, "seconds": dt,
            "output_tok_s": n_out / dt, "total_tok_s": (n_out + sum(map(len, reqs))) / dt}


def main():
    results["gpu"] = torch.cuda.get_device_name()
    results["date"] = datetime.date.today().isoformat()
    results["commit"] = commit_id()
    t0 = time.time()
    model = build_slice(json.loads(CONFIG.read_text()))
    log(f"slice built in {time.time() - t0:.1f}s")
    for key in ("graphs", "eager", "async"):           # async: graphs with async scheduling
        engine = make(model, key == "eager", max_num_seqs=32, async_scheduling=key == "async")
        rng = random.Random(1)
        rows = []
        for batch in (1, 8, 32):
            rows.append(decode_steps(engine, batch, rng))
            log(key, rows[-1])
            results[f"decode_{key}"] = rows
            save_results("bench_engine.json", results)
        # warm-up on the very same mix (same prefill shapes, so every Triton variant is compiled),
        # then forget its cached prefixes so the timed pass computes everything again
        offline(engine, seed=7, tag="warm")
        engine.kv.reset_prefix_cache()
        results[f"offline_{key}"] = offline(engine, seed=7, tag="timed")
        log(key, results[f"offline_{key}"])
        save_results("bench_engine.json", results)
        del engine
        torch.cuda.empty_cache()
    log("\n| batch | graphs: step wall ms | device ms | host overhead ms (share) | runner prepare ms "
        "| eager: step wall ms | speed-up | async: step wall ms (host share) |")
    log("|---|---|---|---|---|---|---|---|")
    for g, e, a in zip(results["decode_graphs"], results["decode_eager"], results["decode_async"]):
        log(f"| {g['batch']} | {g['wall_ms']:.2f} | {g['device_ms']:.2f} | {g['host_overhead_ms']:.2f} "
            f"({g['host_share']:.0%}) | {g['runner_prepare_ms']:.3f} | {e['wall_ms']:.2f} | "
            f"{e['wall_ms'] / g['wall_ms']:.2f}x | {a['wall_ms']:.2f} ({a['host_share']:.0%}) |")
    og, oe = results["offline_graphs"], results["offline_eager"]
    log(f"offline 64 req x 64 out: graphs {og['output_tok_s']:.0f} out tok/s ({og['seconds']:.1f}s), "
        f"eager {oe['output_tok_s']:.0f} out tok/s ({oe['seconds']:.1f}s)")


if __name__ == "__main__":
    main()
