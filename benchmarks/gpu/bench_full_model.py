"""One device call: the whole Kimi-Linear-48B-A3B (27 layers, its release config.json, random bf16
weights built on the GPU, about 92 GiB) through ``LLMEngine`` with CUDA graphs on one GPU.

  * the cache plan the engine makes with the memory left;
  * decode at batch 1 / 32 / 128 with 4k-token prompts: output tok/s of the steady decode steps
    (every request running; the median interval between steps, host work included), the decode
    graph's device time alone (replayed on the last step's inputs), both against the floor (bytes of
    the weights the batch touches + KDA states + latents, over the measured copy rate;
    ``bench_slice.counts``);
  * prefill of one 8k-token prompt: tok/s and its floor (FLOPs / matmul rate);
  * peak GPU memory.

    PYTHONPATH=. python benchmarks/gpu/bench_full_model.py [--async-scheduling] [--layers=N] [--trace]
                                                    (writes $OUT/bench_full_kimi_linear[_async][_Nlayers].json)

``--trace``: TRACE_STEPS of batch 32's steady decode steps under torch.profiler (left out of the median): the
device's busy time per step (the union of its kernels' intervals) against the steps' wall time, its idle gaps,
and the kernels that take most of it, to find where a step's time above its graph's goes.

``--layers=N`` keeps the release config's first N layers (with their KDA / MLA kinds), so that an 80 GB GPU can
run the same engine path; its ratios are to that model's own floor.

``--cpu-offload-gb=G [--expert-offload-policy=P]``: the whole model on one 80 GB H100 with expert offload: the
routed experts are built in pinned host memory (about 88 GiB of the host's memory) and G GiB of them stay there
(``kimik3/model/expert_offload.py``; the GPU caches the rest); the engine as with ``--cpu-offload-gb G``. Its
decode tok/s compare with this script's fully resident run on an H200 (writes
``$OUT/bench_full_kimi_linear_offload{G}[_P].json``; its floors are the resident model's, so step/floor is the
offload's cost). On an H100, ``--cpu-offload-gb=40`` leaves about 14 GiB for the cache (batch 128 of 4k
prompts needs 9.4 GiB; ``kimik3 inspect --model tests/data/kimi-linear-48b-a3b.config.json --gpu H100
--cpu-offload-gb 40`` plans it).
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
from bench_slice import build_slice, ceilings                           # noqa: E402

from benchmarks.common import commit_id, cuda_time, log, save_results       # noqa: E402

from kimik3.engine import EngineConfig, LLMEngine, SamplingParams       # noqa: E402

CONFIG = ROOT / "tests" / "data" / "kimi-linear-48b-a3b.config.json"
PROMPT = 4096
PREFILL = 8192          # the one-prompt prefill measured last: max_model_len must admit it
ASYNC = "--async-scheduling" in sys.argv
LAYERS = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--layers=")), None)
OFFLOAD_GB = next((float(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--cpu-offload-gb=")), 0.0)
POLICY = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--expert-offload-policy=")), "auto")
OUT_NAME = ("bench_full_kimi_linear" + ("_async" if ASYNC else "") + (f"_{LAYERS}layers" if LAYERS else "")
            + (f"_offload{OFFLOAD_GB:g}" + ("" if POLICY == "auto" else f"_{POLICY}") if OFFLOAD_GB else "") + ".json")
TRACE = "--trace" in sys.argv
TRACE_STEPS = (25, 31)      # the pure decode steps [first, last) traced at batch 32
results: dict = {}


def run_batch(engine, model, batch: int, max_tokens: int, g) -> dict:
    """``batch`` requests of PROMPT random tokens; times the steps in which all of them decode."""
    vocab = model.config.text.vocab_size
    for i in range(batch):
        engine.add_request(f"b{batch}.{i}", {"prompt_token_ids": torch.randint(1000, vocab, (PROMPT,), generator=g).tolist()},
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False))
    t0 = time.perf_counter()
    ends, touched = [], None      # ends: when each step in which every request decodes returned
    first = last = None
    prof, traced, trace = None, [], None
    while engine.has_unfinished_requests():
        sched = engine.scheduler
        pure = (not sched.waiting and len(sched.running) == batch
                and all(r.num_output_tokens > 0 for r in sched.running))
        if pure and touched is None:    # one eager decode step records how many experts it reads
            torch.cuda.synchronize()
            graphs, engine.runner.graphs = engine.runner.graphs, None
            touched = bench_slice.touched_experts(engine.step)
            engine.runner.graphs = graphs
            ends.append(None)
            continue
        if pure and first is None:     # the runner's host counters from the first timed step on
            first = runner_counters(engine.runner)
        n_pure = sum(e is not None for e in ends)
        tracing = TRACE and batch == 32 and pure and TRACE_STEPS[0] <= n_pure < TRACE_STEPS[1]
        if tracing and prof is None:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.start()
        t_step = time.perf_counter()
        engine.step()
        ends.append(time.perf_counter() if pure and not tracing else None)
        if tracing:
            traced.append(time.perf_counter() - t_step)
            if n_pure + 1 == TRACE_STEPS[1]:
                torch.cuda.synchronize()
                prof.stop()
                trace = trace_report(prof, traced)
        if pure:
            last = runner_counters(engine.runner)
    total = time.perf_counter() - t0
    gaps = [b - a for a, b in zip(ends, ends[1:]) if a is not None and b is not None]
    step = statistics.median(gaps)
    graphs = engine.runner.graphs
    key = (graphs.size_for(batch), 1) if graphs is not None else None
    replay = cuda_time(graphs.graphs[key][0].replay, warmup=2, iters=10) if key in (graphs.graphs if graphs else {}) else float("nan")
    return {"batch": batch, "experts_touched_per_layer": touched, "decode_steps_timed": len(gaps), "step_ms": step * 1e3,
            "output_tok_s": batch / step, "tpot_ms": step * 1e3, "graph_replay_ms": replay * 1e3, "wall_s": total,
            # per timed step: batch building, the replay's launch, building + sampling's host work
            **{f"{k}_ms_per_step": (last[k] - first[k]) / max(last["steps"] - first["steps"], 1) * 1e3
               for k in ("prepare", "launch", "host")}, **({"trace": trace} if trace else {})}


def trace_report(prof, walls: list[float]) -> dict:
    """The traced steps: device busy time (union of kernel and copy intervals) per step against their wall
    time, the idle gaps over 20 us, and the device ops by total time."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    busy, gaps, cur = 0.0, [], None
    for a, b in spans:
        if cur is None or a > cur[1]:
            if cur is not None:
                busy += cur[1] - cur[0]
                if a - cur[1] > 20:
                    gaps.append(round(a - cur[1], 1))
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    if cur is not None:
        busy += cur[1] - cur[0]
    n = len(walls)
    ops = sorted((e for e in prof.key_averages() if e.device_type.name == "CUDA"), key=lambda e: -e.self_device_time_total)
    report = {"steps": n, "wall_ms_per_step": sum(walls) / n * 1e3, "device_busy_ms_per_step": busy / 1e3 / n,
              "idle_gaps_us": gaps, "top_ops": [{"op": e.key[:100], "ms_per_step": e.self_device_time_total / 1e3 / n,
                                                 "per_step": e.count / n} for e in ops[:15]]}
    log(f"# trace: {n} steps, wall {report['wall_ms_per_step']:.2f} ms/step, device busy "
        f"{report['device_busy_ms_per_step']:.2f} ms/step, idle gaps (us) {gaps[:40]}")
    for o in report["top_ops"]:
        log(f"#   {o['ms_per_step']:7.3f} ms/step {o['per_step']:6.1f}/step  {o['op']}")
    return report


def runner_counters(runner) -> dict:
    return {"prepare": runner.prepare_seconds, "launch": runner.model_seconds, "host": runner.host_seconds,
            "steps": runner.num_steps}


def release_config(layers: int | None) -> dict:
    """The release config.json, or its first ``layers`` layers (1-indexed layer lists kept where they fall)."""
    cfg = json.loads(CONFIG.read_text())
    if layers is not None:
        if not 1 <= layers <= cfg["num_hidden_layers"]:
            raise SystemExit(f"--layers={layers}: the model has 1-{cfg['num_hidden_layers']} layers")
        cfg["num_hidden_layers"] = layers
        la = cfg["linear_attn_config"]
        for key in ("kda_layers", "full_attn_layers"):
            la[key] = [i for i in la[key] if i <= layers]
    return cfg


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    results.update(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), commit=commit_id(),
                   torch=torch.__version__, config=CONFIG.name, async_scheduling=ASYNC, layers=LAYERS)
    bw, mm = ceilings()
    results["ceilings"] = {"copy_bytes_per_s": bw, "bf16_matmul_flops": mm}
    t0 = time.time()
    model = build_slice(release_config(LAYERS), str(CONFIG), experts_on_host=bool(OFFLOAD_GB))
    if OFFLOAD_GB:
        from kimik3.model.expert_offload import ExpertOffloadConfig
        model.offload_experts(ExpertOffloadConfig.from_gib(OFFLOAD_GB, policy=POLICY))
        o = model.expert_offload
        results["offload"] = {"cpu_offload_gb": OFFLOAD_GB, "policy": POLICY, "rates": o.policy.rates.describe(),
                              "decisions": o.policy.describe(), "cached_per_layer": o.cache_size,
                              "host_per_layer": o.staging_size}
        log(o.policy.describe())
    weights = torch.cuda.memory_allocated()
    results["weights_bytes"] = weights
    results["build_s"] = time.time() - t0
    log(f"Kimi-Linear-48B ({LAYERS or 'all'} layers) built in {results['build_s']:.0f}s: {weights / 2**30:.1f} GiB of weights")
    t0 = time.time()
    # the engine's flags pick 64-token blocks when FlashMLA's library is named (EngineArgs.resolve_block_size)
    block = 64 if os.environ.get("KIMIK3_FLASH_MLA") else 16
    engine = LLMEngine(model, EngineConfig(max_num_seqs=128, max_model_len=PREFILL + 64, enable_prefix_caching=False,
                                             async_scheduling=ASYNC, block_size=block))
    results["block_size"], results["flash_mla"] = block, bool(os.environ.get("KIMIK3_FLASH_MLA"))
    results["engine_start_s"] = time.time() - t0
    results["plan"] = engine.plan.describe()
    results["graphs"] = engine.runner.graphs is not None and sorted(engine.runner.graphs.graphs)
    free, total = torch.cuda.mem_get_info()
    results["free_after_start_bytes"] = free
    log(results["plan"], "| graphs:", results["graphs"], f"| start {results['engine_start_s']:.0f}s")
    g = torch.Generator().manual_seed(0)
    E = model.config.text.num_experts
    rows = []
    budget = engine.config.max_num_batched_tokens
    for batch in (1, 32, 128):
        # the last prompt's prefill ends after batch * PROMPT / budget steps, while the first ones already decode:
        # 40 steps in which every request decodes come after that
        max_tokens = 40 + -(-batch * PROMPT // budget)
        row = run_batch(engine, model, batch, max_tokens, g)
        byts, flops = bench_slice.counts(model, batch, 0, "decode", row["experts_touched_per_layer"])
        floor = max(byts / bw, flops / mm)
        row.update(floor_ms=floor * 1e3, step_over_floor=row["step_ms"] / 1e3 / floor, floor_tok_s=batch / floor,
                   replay_over_floor=row["graph_replay_ms"] / 1e3 / floor)
        if OFFLOAD_GB:
            row["offload"] = model.expert_offload.stats()
        rows.append(row)
        log(row)
        results["decode"] = rows
        save_results(OUT_NAME, results)
    vocab = model.config.text.vocab_size
    torch.cuda.synchronize()
    engine.add_request("prefill", {"prompt_token_ids": torch.randint(1000, vocab, (PREFILL,), generator=g).tolist()},
                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False))
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    t = time.perf_counter() - t0
    byts, flops = bench_slice.counts(model, 1, PREFILL, "prefill", E)
    floor = max(byts / bw, flops / mm)
    results["prefill"] = {"tokens": PREFILL, "s": t, "tok_s": PREFILL / t, "floor_s": floor, "over_floor": t / floor,
                          "matmul_fraction": flops / t / mm, "chunk_budget": engine.config.max_num_batched_tokens}
    results["peak_bytes"] = torch.cuda.max_memory_allocated()
    log(results["prefill"], f"peak {results['peak_bytes'] / 2**30:.1f} GiB")
    save_results(OUT_NAME, results)
    log("\n| batch | step ms | output tok/s | graph replay ms | floor ms | step/floor | replay/floor |")
    log("|---|---|---|---|---|---|---|")
    for r in rows:
        log(f"| {r['batch']} | {r['step_ms']:.2f} | {r['output_tok_s']:.0f} | {r['graph_replay_ms']:.2f} | {r['floor_ms']:.2f} "
            f"| {r['step_over_floor']:.2f} | {r['replay_over_floor']:.2f} |")


if __name__ == "__main__":
    main()
