"""Expert offload on one GPU (``--cpu-offload-gb``, ``kimik3/model/expert_offload.py``), one device call:

1. the copy rates: a pinned host -> GPU ``copy_`` (DMA) of 1 GiB, and the staging kernel
   (``kimik3.ops.triton.expert_copy``: the GPU reading pinned rows through unified addressing) moving
   48 whole K3 experts; and, for the policy, one K3 expert computed on the host (the torch reference,
   MXFP4 dequantized, one token) against copying it in; then the miss policy's own start-up measurement
   (``offload_policy.measure_rates``: staging copy, HBM, the host's expert rows at 1 and 8 tokens, round trip);
2. the K3-width slice (``kimi-k3-slice4.config.json``: 3 MoE layers of 64 MXFP4 experts, top-16, random
   weights and routing) decoding at batch 1 / 8 / 32 over a 4k context as CUDA graphs (the MoE side stream on,
   as the engine's graphs run), fully resident, then with 30% and 60% of its experts in host memory under each
   miss policy (``--policies``, default copy, prefetch, auto): the step time, tok/s against resident, the
   experts copied after routing and ahead per step, the prefetch's accuracy (the share of the misses it
   predicted), the logits against the resident step's (must be equal), what auto chose, and the planner's
   prediction (``kimik3.sizing.predict_decode`` with the measured rates, the measured prefetch accuracy and the
   policy): the whole estimate (target: within 25%), and the measured resident step plus the planner's miss
   time. "hot" re-times a step after one refresh has cached the experts that step routes to (a bound: real
   decoding moves its routing);
3. host compute on eager steps (batch 1 and 8, ``--policies`` naming host): the step with the misses computed
   on the host against the same eager step copying them, both against the policy's predicted costs, and the
   logits' largest difference from resident (host sums round differently: not bit-exact on a GPU).

Random routing makes the prediction near chance (the previous step's routing of a replayed step is the same
step's, so the predictor is the router, ``--prefetch-from=router``): the prefetch accuracy a trained model
reaches is not measured here.

    PYTHONPATH=. python benchmarks/gpu/bench_offload.py          (writes $OUT/bench_offload.json)

``--config=benchmarks/gpu/kimi-linear-slice4.config.json``: the Kimi-Linear-48B-width slice (256 bf16 experts,
top-8) instead (``$OUT/bench_offload_kimi-linear-slice4.json``). ``--batches=1,8,32``, ``--fractions=0.3,0.6``,
``--policies=copy,prefetch,auto,host`` and ``--prefetch-from=router|previous_step|both`` name other cases.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import capture_graph, commit_id, copy_rate, cuda_time, log, save_results  # noqa: E402
from benchmarks.gpu.bench_slice import CONFIG, CONTEXT, build_slice, decode_setup, step_fn  # noqa: E402
from kimik3.model.expert_offload import _kinds                          # noqa: E402
from kimik3.config import parse_config                                  # noqa: E402
from kimik3.model.expert_offload import ExpertOffloadConfig, expert_bytes  # noqa: E402
from kimik3.model.offload_policy import MissRates                       # noqa: E402
from kimik3.ops.expert_copy import byte_rows                            # noqa: E402
from kimik3.sizing import Rates, compute_sizing, predict_decode          # noqa: E402

BATCHES = (1, 8, 32)
FRACTIONS = (0.3, 0.6)
POLICIES = ("copy", "prefetch", "auto")
results: dict = {}
KNOWN = {"--batches", "--fractions", "--config", "--policies", "--prefetch-from"}


def args() -> dict:
    out = {"batches": BATCHES, "fractions": FRACTIONS, "config": CONFIG, "policies": POLICIES, "prefetch_from": "router"}
    for a in sys.argv[1:]:
        key, _, value = a.partition("=")
        if key not in KNOWN or not value:
            raise SystemExit(f"bench_offload.py: unknown argument {a!r}; known: {sorted(KNOWN)} (as --name=value)")
        if key == "--batches":
            out["batches"] = tuple(int(v) for v in value.split(","))
        elif key == "--fractions":
            out["fractions"] = tuple(float(v) for v in value.split(","))
        elif key == "--policies":
            out["policies"] = tuple(value.split(","))
        elif key == "--prefetch-from":
            out["prefetch_from"] = value
        else:
            out["config"] = Path(value)
    return out


def pinned_rates(model) -> dict:
    """Bytes/s of a pinned -> GPU copy_ (DMA) and of the staging kernel moving whole experts from pinned rows."""
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dma = host.numel() / cuda_time(lambda: dev.copy_(host, non_blocking=True), iters=10)
    from kimik3.ops.triton.expert_copy import copy_experts_triton
    experts = model.moe_blocks()[0].experts
    n = min(48, experts.w13.shape[0])
    src = {k: byte_rows(torch.empty(getattr(experts, k).shape, dtype=getattr(experts, k).dtype, pin_memory=True))
           for k in _kinds(experts)}
    dst = {k: torch.empty(n, v.shape[1], dtype=v.dtype, device="cuda") for k, v in src.items()}
    ids = torch.arange(n, device="cuda")
    used = torch.ones(experts.w13.shape[0], dtype=torch.bool, device="cuda")

    def stage():
        for k in src:
            copy_experts_triton(src[k], dst[k], ids, ids, used)

    kernel = n * expert_bytes(experts) / cuda_time(stage, iters=10)
    return {"pinned_copy_bytes_per_s": dma, "staging_kernel_bytes_per_s": kernel}


def host_expert_seconds(model) -> float:
    """One expert for one token on the host (the torch reference; MXFP4: dequantize, then three products)."""
    from kimik3.ops.moe import fused_moe, fused_moe_mxfp4
    e, act = model.moe_blocks()[0].experts, model.moe_blocks()[0].act
    w = {k: getattr(e, k)[:1].cpu() for k in _kinds(e)}
    half = lambda t, i: t[:, i * (t.shape[1] // 2):(i + 1) * (t.shape[1] // 2)]  # noqa: E731
    ids, weights = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1)
    x = torch.randn(1, e.w2.shape[1], dtype=torch.bfloat16)
    common = (weights, ids, act.hidden_act, act.beta, act.linear_beta, True)
    if e.mxfp4:
        w1, w3 = (half(w["w13"], 0), half(w["w13_scale"], 0)), (half(w["w13"], 1), half(w["w13_scale"], 1))
        run = lambda: fused_moe_mxfp4(x, w1, (w["w2"], w["w2_scale"]), w3, *common)  # noqa: E731
    else:
        run = lambda: fused_moe(x, half(w["w13"], 0), w["w2"], half(w["w13"], 1), *common)  # noqa: E731
    run()
    t = time.perf_counter()
    for _ in range(3):
        run()
    return (time.perf_counter() - t) / 3


def counters(o) -> dict:
    return {"late": int(o.copies.sum()), "ahead": int(o.prefetched.sum()), "ahead_used": int(o.prefetch_used.sum())}


def timed_step(model, N: int):
    """(graph seconds of one decode step of N sequences, its logits, counters of one replay, what to keep)."""
    cache, batch, ids = decode_setup(model, N)
    fn = step_fn(model, ids, batch, cache, last_only=False)
    graph, out = capture_graph(fn)
    o = model.expert_offload
    before = counters(o) if o else {}
    graph.replay()
    torch.cuda.synchronize()
    moved = {k: v - before[k] for k, v in counters(o).items()} if o else {}
    seconds = cuda_time(graph.replay, warmup=2, iters=10)
    return seconds, out.clone(), moved, (graph, fn, cache, batch, ids)


def eager_step(model, N: int) -> tuple[float, torch.Tensor]:
    """(seconds of one eager decode step of N sequences, host work included, its logits)."""
    cache, batch, ids = decode_setup(model, N)
    fn = step_fn(model, ids, batch, cache, last_only=False)
    out = fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(3):
        out = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / 3, out


def prediction(cfg, o, N: int, measured, accuracy: float, policy: str) -> dict:
    """The planner's estimate for this GPU with this offload, from the measured rates and prefetch accuracy."""
    gpu = "H200" if "H200" in torch.cuda.get_device_name() else "H100"
    layers = o.num_layers if o else 1
    offloaded = o.staging_size * layers * o.expert_bytes if o else 0
    s = compute_sizing(cfg, 1, 1, gpu=gpu, cpu_offload_gb=offloaded / (1 << 30))
    rates = Rates(pcie=measured.copy, host_memory=measured.host_bytes, host_flops=measured.host_flops,
                  host_sync=measured.host_sync, prefetch_accuracy=accuracy, context=CONTEXT)
    d = predict_decode(cfg, s, N, rates, policy)
    return {"step_s": d.step_seconds, "gpu_s": d.gpu_seconds, "miss_s": d.miss_seconds, "strategy": d.strategy,
            "copy_s": d.copy_seconds, "prefetch_s": d.prefetch_seconds, "host_s": d.host_seconds,
            "missed_experts": d.missed_bytes / o.expert_bytes if o else 0.0}


def offload(model, total: int, f: float, policy: str, prefetch_from: str, rates):
    model.offload_experts(ExpertOffloadConfig(int(f * total), refresh_interval=1, policy=policy,
                                              prefetch_from=prefetch_from, rates=rates))
    return model.expert_offload


def graph_cases(model, cfg, a: dict, total: int, resident: dict, rows: dict, measured):
    seen: dict = {}                 # (fraction, batch) -> the prefetch accuracy measured (for auto's prediction)
    for f in a["fractions"]:
        for policy in (p for p in a["policies"] if p != "host"):
            o = offload(model, total, f, policy, a["prefetch_from"], measured)
            measured = measured or o.policy.rates
            for N in a["batches"]:
                t, logits, moved, keep = timed_step(model, N)
                misses = moved["late"] + moved["ahead_used"]
                accuracy = moved["ahead_used"] / misses if misses and moved["ahead"] else None
                if accuracy is not None:
                    seen[f, N] = accuracy
                p = prediction(cfg, o, N, measured, seen.get((f, N), 0.5), policy)
                hybrid = resident[N][0] + p["miss_s"]
                exact = bool(torch.equal(logits, resident[N][1]))
                o.refresh()                                    # the next refresh: the counts of the timed replays
                o.refresh()
                hot = cuda_time(keep[0].replay, warmup=1, iters=5)
                row = {"policy": policy, "graph_strategy": o.policy.choose(N, graph=True),
                       "offloaded_experts_per_layer": o.staging_size, "ms": t * 1e3, "tok_s": N / t,
                       "vs_resident": t / resident[N][0], "per_step": moved, "prefetch_accuracy": accuracy,
                       "planner": p, "planner_ms": p["step_s"] * 1e3, "measured_over_planner": t / p["step_s"],
                       "resident_plus_planner_miss_ms": hybrid * 1e3, "measured_over_hybrid": t / hybrid,
                       "exact": exact, "hot_ms": hot * 1e3}
                rows[f"offload {int(f * 100)}% {policy} b{N}"] = row
                log(f"offload {int(f * 100)}% {policy:>8} ({row['graph_strategy']}) b{N:>2}: {t * 1e3:8.3f} ms "
                    f"{N / t:8.1f} tok/s ({t / resident[N][0]:.2f}x resident); per step {moved}"
                    f"{'' if accuracy is None else f', prefetch accuracy {accuracy:.2f}'}; planner "
                    f"{p['step_s'] * 1e3:.3f} ms by {p['strategy']} (x{t / p['step_s']:.2f}), resident + planner "
                    f"misses {hybrid * 1e3:.3f} ms (x{t / hybrid:.2f}); logits {'EXACT' if exact else 'DIFFER'}; "
                    f"hot set {hot * 1e3:.3f} ms")
                del keep
            torch.cuda.empty_cache()
    return measured


def host_cases(model, a: dict, total: int, rows: dict, measured) -> None:
    """Eager steps: misses computed on the host against copied, and the policy's predictions of both."""
    from kimik3.model.offload_policy import miss_costs
    force_host = MissRates(copy=1e3, host_sync=0.0)
    for f in a["fractions"]:
        for N in (1, 8):
            o = offload(model, total, f, "copy", a["prefetch_from"], measured)
            copy_s, want = eager_step(model, N)
            o = offload(model, total, f, "host", a["prefetch_from"], force_host)
            host_s, got = eager_step(model, N)
            costs = miss_costs(o.policy.shape, measured, N)
            diff = (got.float() - want.float()).abs().max().item()
            layers = o.num_layers
            row = {"eager_copy_ms": copy_s * 1e3, "eager_host_ms": host_s * 1e3, "host_over_copy": host_s / copy_s,
                   "predicted_copy_ms": layers * costs["copy"] * 1e3, "predicted_host_ms": layers * costs["host"] * 1e3,
                   "host_pairs": o.host_pairs, "logits_max_abs_diff": diff,
                   "greedy_equal": bool(torch.equal(got.argmax(-1), want.argmax(-1)))}
            rows[f"host eager {int(f * 100)}% b{N}"] = row
            log(f"host eager {int(f * 100)}% b{N}: {host_s * 1e3:.2f} ms vs copy {copy_s * 1e3:.2f} ms "
                f"(misses predicted: host {row['predicted_host_ms']:.2f} / copy {row['predicted_copy_ms']:.2f} ms); "
                f"logits max |diff| {diff:.3g}, greedy {'equal' if row['greedy_equal'] else 'DIFFER'}")


def main() -> None:
    a = args()
    config = a["config"]
    results.update(commit=commit_id(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   device=torch.cuda.get_device_name(), context=CONTEXT, config=config.name,
                   prefetch_from=a["prefetch_from"])
    raw = json.loads(config.read_text())
    cfg = parse_config(raw, str(config))
    model = build_slice(raw, str(config))
    model.use_side_stream(torch.cuda.Stream())            # as the engine's decode graphs run
    hbm = copy_rate()
    rates = pinned_rates(model)
    rates["hbm_copy_bytes_per_s"] = hbm
    rates["host_expert_s"] = host_expert_seconds(model)
    per = expert_bytes(model.moe_blocks()[0].experts)
    rates["expert_bytes"] = per
    results["rates"] = rates
    log(f"HBM copy {hbm / 1e12:.2f} TB/s; pinned copy_ {rates['pinned_copy_bytes_per_s'] / 1e9:.1f} GB/s; staging kernel "
        f"{rates['staging_kernel_bytes_per_s'] / 1e9:.1f} GB/s; one expert ({per / 1e6:.1f} MB) on the host "
        f"{rates['host_expert_s'] * 1e3:.1f} ms vs copied in {per / rates['staging_kernel_bytes_per_s'] * 1e3:.2f} ms")
    layers = len(model.moe_blocks())
    total = layers * model.moe_blocks()[0].experts.w13.shape[0] * per
    rows, resident = {}, {}
    for N in a["batches"]:
        t, logits, _, _ = timed_step(model, N)
        resident[N] = (t, logits)
        rows[f"resident b{N}"] = {"ms": t * 1e3, "tok_s": N / t}
        log(f"resident  b{N:>2}: {t * 1e3:8.3f} ms  {N / t:9.1f} tok/s")
    measured = graph_cases(model, cfg, a, total, resident, rows, None)
    results["policy_rates"] = measured.describe() if measured else None
    results["cases"] = rows
    if "host" in a["policies"]:
        host_cases(model, a, total, rows, measured or offload(model, total, a["fractions"][0], "copy",
                                                              a["prefetch_from"], None).policy.rates)
    name = "bench_offload.json" if config == CONFIG else f"bench_offload_{config.name.split('.')[0]}.json"
    log(f"wrote {save_results(name, results)}")


if __name__ == "__main__":
    main()
