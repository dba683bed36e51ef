"""Expert offload on one GPU (``--cpu-offload-gb``, ``kimik3/model/expert_offload.py``), one device call:

1. the copy rates: a pinned host -> GPU ``copy_`` (DMA) of 1 GiB, and the staging kernel
   (``kimik3.ops.triton.expert_copy``: the GPU reading pinned rows through unified addressing) moving
   48 whole K3 experts; and, for the policy, one K3 expert computed on the host (the torch reference,
   MXFP4 dequantized, one token) against copying it in;
2. the K3-width slice (``kimi-k3-slice4.config.json``: 3 MoE layers of 64 MXFP4 experts, top-16, random
   weights and routing) decoding at batch 1 / 8 / 32 over a 4k context as CUDA graphs (the MoE side stream on,
   as the engine's graphs run), fully resident, then with 30% and 60% of its experts in host memory: the
   step time, the experts staged per step, the logits against the resident step's (must be equal), and the
   planner's prediction (``kimik3.sizing.predict_decode``) from the measured rates: the whole estimate, and
   the measured resident step plus the planner's copy time (target: within 25%). "hot" re-times a step after
   one refresh has cached the experts that step routes to (a bound: real decoding moves its routing).

    PYTHONPATH=. python benchmarks/gpu/bench_offload.py          (writes $OUT/bench_offload.json)

``--config=benchmarks/gpu/kimi-linear-slice4.config.json``: the Kimi-Linear-48B-width slice (256 bf16 experts,
top-8) instead (``$OUT/bench_offload_kimi-linear-slice4.json``). ``--batches=1,8,32`` and ``--fractions=0.3,0.6``
name other cases.
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
from kimik3.ops.expert_copy import byte_rows                            # noqa: E402
from kimik3.sizing import Rates, compute_sizing, predict_decode          # noqa: E402

BATCHES = (1, 8, 32)
FRACTIONS = (0.3, 0.6)
results: dict = {}
KNOWN = {"--batches", "--fractions", "--config"}


def args() -> tuple[tuple[int, ...], tuple[float, ...], Path]:
    batches, fractions, config = BATCHES, FRACTIONS, CONFIG
    for a in sys.argv[1:]:
        key, _, value = a.partition("=")
        if key not in KNOWN or not value:
            raise SystemExit(f"bench_offload.py: unknown argument {a!r}; known: {sorted(KNOWN)} (as --name=value)")
        if key == "--batches":
            batches = tuple(int(v) for v in value.split(","))
        elif key == "--fractions":
            fractions = tuple(float(v) for v in value.split(","))
        else:
            config = Path(value)
    return batches, fractions, config


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


def timed_step(model, N: int):
    """(graph seconds of one decode step of N sequences, its logits, staged experts per step)."""
    cache, batch, ids = decode_setup(model, N)
    fn = step_fn(model, ids, batch, cache, last_only=False)
    graph, out = capture_graph(fn)
    o = model.expert_offload
    before = int(o.copies.sum()) if o else 0
    graph.replay()
    torch.cuda.synchronize()
    staged = (int(o.copies.sum()) - before) if o else 0
    seconds = cuda_time(graph.replay, warmup=2, iters=10)
    return seconds, out.clone(), staged, (graph, fn, cache, batch, ids)


def prediction(cfg, offloaded_bytes: int, N: int, rates: Rates) -> dict:
    """The planner's estimate for this GPU with ``offloaded_bytes`` of experts in host memory."""
    gpu = "H200" if "H200" in torch.cuda.get_device_name() else "H100"
    s = compute_sizing(cfg, 1, 1, gpu=gpu, cpu_offload_gb=offloaded_bytes / (1 << 30))
    d = predict_decode(cfg, s, N, rates)
    return {"step_s": d.step_seconds, "gpu_s": d.gpu_seconds, "copy_s": d.copy_seconds, "host_s": d.host_seconds,
            "missed_bytes": d.missed_bytes}


def main() -> None:
    batches, fractions, config = args()
    results.update(commit=commit_id(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   device=torch.cuda.get_device_name(), context=CONTEXT, config=config.name)
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
    planner = Rates(pcie=rates["staging_kernel_bytes_per_s"], context=CONTEXT)    # the measured copy rate
    results["planner_rates"] = planner.describe()
    layers = len(model.moe_blocks())
    total = layers * model.moe_blocks()[0].experts.w13.shape[0] * per
    rows = {}
    resident = {}
    for N in batches:
        t, logits, _, _ = timed_step(model, N)
        resident[N] = (t, logits)
        rows[f"resident b{N}"] = {"ms": t * 1e3, "tok_s": N / t, "planner_ms": prediction(cfg, 0, N, planner)["step_s"] * 1e3}
        log(f"resident  b{N:>2}: {t * 1e3:8.3f} ms  {N / t:9.1f} tok/s  (planner {rows[f'resident b{N}']['planner_ms']:.3f} ms)")
    for f in fractions:
        model.offload_experts(ExpertOffloadConfig(int(f * total), refresh_interval=1))
        o = model.expert_offload
        for N in batches:
            t, logits, staged, keep = timed_step(model, N)
            p = prediction(cfg, o.staging_size * layers * per, N, planner)
            hybrid = resident[N][0] + p["copy_s"]
            exact = bool(torch.equal(logits, resident[N][1]))
            o.refresh()                                    # the next refresh: the counts of the timed replays
            o.refresh()
            hot = cuda_time(keep[0].replay, warmup=1, iters=5)
            row = {"offloaded_experts_per_layer": o.staging_size, "ms": t * 1e3, "tok_s": N / t,
                   "vs_resident": t / resident[N][0], "staged_per_step": staged,
                   "staged_bytes": staged * per, "planner_ms": p["step_s"] * 1e3,
                   "planner_missed_experts": p["missed_bytes"] / per,
                   "resident_plus_planner_copy_ms": hybrid * 1e3, "measured_over_prediction": t / hybrid,
                   "measured_over_planner": t / p["step_s"], "exact": exact, "hot_ms": hot * 1e3}
            rows[f"offload {int(f * 100)}% b{N}"] = row
            log(f"offload {int(f * 100)}% b{N:>2}: {t * 1e3:8.3f} ms {N / t:8.1f} tok/s ({t / resident[N][0]:.2f}x resident), "
                f"staged {staged} experts/step (planner {p['missed_bytes'] / per:.1f}); prediction resident+copy "
                f"{hybrid * 1e3:.3f} ms (x{t / hybrid:.2f}), planner {p['step_s'] * 1e3:.3f} ms (x{t / p['step_s']:.2f}); "
                f"logits {'EXACT' if exact else 'DIFFER'}; hot set {hot * 1e3:.3f} ms")
            del keep
        torch.cuda.empty_cache()
    results["cases"] = rows
    name = "bench_offload.json" if config == CONFIG else f"bench_offload_{config.name.split('.')[0]}.json"
    log(f"wrote {save_results(name, results)}")


if __name__ == "__main__":
    main()
