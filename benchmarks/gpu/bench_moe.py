"""One device call: the MXFP4 expert kernels at the slice's shapes (64 experts, latent 3584,
expert 3072, top-16) across tile choices and both dequantizations (integer bit placement "asm"
vs the fp16-placement path), each checked against the dense bf16 reference and timed as a CUDA
graph replay; Kimi-Linear's bf16 experts at decode sizes (the default tiles); then the slice model's
decode step with and without the MoE side stream.

Bytes per call: the packed codes + scales of every expert the batch touches (weights read once);
floor = bytes / measured copy rate.

    PYTHONPATH=. python benchmarks/gpu/bench_moe.py        (writes $OUT/bench_moe.json)
    ... --decode-only --no-model: decode sizes (1-128 tokens), the default tiles only
    ... --tokens=32,128: only these decode sizes (with the tile sweep unless --decode-only)
    ... --prefill-only: 512-8192 tokens (128-2048 rows an expert), the fused kernels' default tiles against
        the dequantize + torch._grouped_mm path, each against the FLOPs at the measured matmul rate
    ... --wgmma: beside the block kernels, ``moe_wgmma``'s register-operand kernels at each BT x warps
    ... --compare=OTHER_MOE_PY: beside each default-tile row, the kernels of another copy of
        ``kimik3/ops/triton/moe.py`` on the same weights, checked and timed the same way ("compared" rows)
    ... --compare-wgmma=PY[,PY..] (with --wgmma): the default register-operand tile on the kernels of other copies
        of ``kimik3/ops/triton/moe_wgmma.py`` ("old_wgmma": i rows; each with an ``expert_products`` as this one)
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from bench_slice import CONFIG, build_slice, ceilings, decode_setup, graph_time, profile, step_fn  # noqa: E402

from benchmarks.common import capture_graph, commit_id, cuda_time, load_module, log, rel_err, save_results  # noqa: E402

from kimik3.ops import mxfp4                                 # noqa: E402
from kimik3.ops.backend import reference_ops                 # noqa: E402
from kimik3.ops.moe import fused_moe                         # noqa: E402
from kimik3.ops.triton import moe as moe_kernels             # noqa: E402
from kimik3.ops.triton.moe import _sort_by_expert, _tiles, fused_moe_triton  # noqa: E402

E, L, I, K = 64, 3584, 3072, 16
results: dict = {}


def packed(N, Kd, g):
    codes = torch.randint(0, 256, (E, N, Kd // 2), generator=g, device="cuda", dtype=torch.uint8)
    base = 127 - round(math.log2(2 * math.sqrt(Kd)))
    scale = (base + torch.randint(-1, 2, (E, N, Kd // 32), generator=g, device="cuda")).to(torch.uint8)
    return codes, scale


CONFIGS = [  # (BN1, BN2, BKH, warps, stages)
    (64, 64, 64, 4, 3), (32, 32, 128, 4, 3), (64, 64, 128, 4, 3), (64, 64, 128, 4, 4),
    (128, 128, 64, 4, 3), (128, 128, 128, 8, 3), (32, 32, 256, 4, 2), (64, 64, 256, 4, 2),
    (64, 64, 256, 8, 3), (128, 128, 128, 4, 3), (32, 32, 64, 2, 4), (64, 64, 64, 4, 5),
    (32, 64, 128, 4, 4), (64, 128, 128, 4, 3),
]


def check_and_time(fn, ref, label: str, rows: list, key: dict) -> tuple[float, float] | None:
    """(seconds of a CUDA-graph replay of ``fn``, its error against ``ref``), or None after logging and
    recording the error of a launch config that fails (compile, resources)."""
    try:
        err = rel_err(fn(), ref)
        graph, _ = capture_graph(fn)
        return cuda_time(graph.replay, warmup=3, iters=20), err
    except Exception as exc:
        log(f"{label}: {exc!r}"[:300])
        rows.append({**key, "error": repr(exc)[:300]})
        return None


def dense_kernels(bw):
    """Kimi-Linear's bf16 experts (256, width 2304, intermediate 1024, top-8) at decode sizes: the
    default tiles against the touched experts' bytes."""
    g = torch.Generator(device="cuda").manual_seed(1)
    En, Ln, In, Kn = 256, 2304, 1024, 8
    w1, w3 = (torch.randn(En, In, Ln, generator=g, device="cuda").to(torch.bfloat16) * Ln ** -0.5 for _ in range(2))
    w2 = torch.randn(En, Ln, In, generator=g, device="cuda").to(torch.bfloat16) * In ** -0.5
    rows = []
    for T in (1, 8, 32, 128):
        x = torch.randn(T, Ln, generator=g, device="cuda").to(torch.bfloat16)
        ids = torch.stack([torch.randperm(En, generator=g, device="cuda")[:Kn] for _ in range(T)])
        weights = torch.rand(T, Kn, generator=g, device="cuda")
        floor = torch.unique(ids).numel() * 3 * Ln * In * 2 / bw
        with reference_ops():
            ref = fused_moe(x, w1, w2, w3, weights, ids, "silu", 1.0, None, True)
        cfg = _tiles(T * Kn / En)
        timed = check_and_time(lambda: fused_moe_triton(x, w1, w2, w3, weights, ids, False, 1.0, None, tiles=cfg),
                               ref, f"dense T={T} {cfg}", rows, {"T": T, "cfg": cfg})
        if timed is None:
            continue
        t, err = timed
        rows.append({"T": T, "cfg": cfg, "ms": t * 1e3, "floor_ms": floor * 1e3, "over_floor": t / floor,
                     "rel_err": err})
        log(f"dense T={T:4d} {cfg} {t * 1e3:.3f} ms  x{t / floor:.2f}  err {err:.2e}")
        results["dense_kernels"] = rows
        save_results("bench_moe.json", results)
    return rows


def compared_module():
    """The module named by ``--compare=PATH`` (another copy of kimik3/ops/triton/moe.py), or None."""
    path = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--compare=")), None)
    return None if path is None else load_module(path, "moe_compared")


@contextlib.contextmanager
def wgmma_module(module):
    """``moe``'s register-operand kernels taken from ``module`` (another moe_wgmma.py) inside the block."""
    import kimik3.ops.triton as package
    name = "kimik3.ops.triton.moe_wgmma"
    saved = sys.modules[name]
    sys.modules[name] = package.moe_wgmma = module
    try:
        yield
    finally:
        sys.modules[name] = package.moe_wgmma = saved


def kernels(bw):
    compared = compared_module()
    old_paths = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--compare-wgmma=")), "")
    old_wgmma = [load_module(path, f"moe_wgmma_compared{i}") for i, path in enumerate(old_paths.split(",")) if path]
    g = torch.Generator(device="cuda").manual_seed(0)
    w1, w3, w2 = packed(I, L, g), packed(I, L, g), packed(L, I, g)
    scale_max = max(int(w[1].max()) for w in (w1, w2, w3))
    per_expert = sum(t[0].numel() + t[1].numel() for t in (w1, w2, w3)) // E
    rows = []
    decode_only = "--decode-only" in sys.argv          # the default tiles at 1-128 tokens alone
    only = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--tokens=")), None)   # e.g. --tokens=32,128
    sizes = (1, 8, 32, 128) if decode_only else (1, 8, 32, 128, 2048)
    for T in [t for t in sizes if only is None or str(t) in only.split(",")]:
        x = torch.randn(T, L, generator=g, device="cuda").to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g, device="cuda")[:K] for _ in range(T)])
        weights = torch.rand(T, K, generator=g, device="cuda")
        used = torch.unique(ids)
        floor = used.numel() * per_expert / bw
        # reference: dense bf16 weights of the used experts only (the rest stay zero)
        d = [torch.zeros(E, *(w[0].shape[1], w[0].shape[2] * 2), dtype=torch.bfloat16, device="cuda") for w in (w1, w2, w3)]
        for e in used.tolist():
            for dst, w in zip(d, (w1, w2, w3)):
                dst[e] = mxfp4.dequantize(w[0][e], w[1][e], torch.bfloat16)
        with reference_ops():
            ref = fused_moe(x, d[0], d[1], d[2], weights, ids, "situ", 4.0, 25.0, True)
        del d
        base = _tiles(T * K / E, True)
        cands = [dict(base, asm=False), dict(base)]
        if T <= 32:
            cands += [dict(BM=16, BN1=a, BN2=b, BKH=c, warps=w, stages=s) for a, b, c, w, s in CONFIGS]
        elif T == 128:      # 32 rows an expert on average: BM = 64 dequantizes each expert's tiles once
            cands += [dict(BM=bm, BN1=a, BN2=b, BKH=c, warps=w, stages=s)
                      for bm in (16, 32, 64) for a, b, c, w, s in CONFIGS[:6]]
        else:
            cands += [dict(BM=128, BN1=64, BN2=128, BKH=64, warps=8, stages=3),
                      dict(BM=64, BN1=128, BN2=128, BKH=64, warps=4, stages=3),
                      dict(BM=128, BN1=128, BN2=128, BKH=32, warps=8, stages=3),
                      dict(BM=128, BN1=128, BN2=128, BKH=64, warps=8, stages=3),
                      dict(BM=64, BN1=64, BN2=128, BKH=64, warps=4, stages=4)]
        if decode_only:
            cands = [dict(base)]
        if "--wgmma" in sys.argv:         # the register-operand kernels (moe_wgmma): rows a block x warps
            cands += [dict(BT=bt, warps=w) for bt in (8, 16, 32, 64) for w in (4, 8)
                      if bt <= 4 * max(8, T * K // E)]
            cands += [dict(BT=bt, warps=w, two=True) for bt in (16, 32, 64) for w in (4, 8)
                      if bt <= 4 * max(8, T * K // E) and bt >= min(64, T * K // E)]
            wg = moe_kernels._wgmma_tiles(T * K / E)
            if wg is not None:
                cands += [dict(wg, old_wgmma=i) for i in range(len(old_wgmma))]
        if compared is not None:
            cands += [dict(base, compared=True)]
        for cfg in cands:
            def fn(cfg=cfg):
                if "old_wgmma" in cfg:
                    with wgmma_module(old_wgmma[cfg["old_wgmma"]]):
                        return fused_moe_triton(x, w1, w2, w3, weights, ids, True, 4.0, 25.0,
                                                high_scales=scale_max > 128,
                                                tiles={k: v for k, v in cfg.items() if k != "old_wgmma"})
                if cfg.get("compared"):
                    return compared.fused_moe_triton(x, w1, w2, w3, weights, ids, True, 4.0, 25.0,
                                                     high_scales=scale_max > 128, tiles=dict(base))
                return fused_moe_triton(x, w1, w2, w3, weights, ids, True, 4.0, 25.0,
                                        high_scales=scale_max > 128, tiles=cfg)
            timed = check_and_time(fn, ref, f"T={T} {cfg}", rows, {"T": T, "cfg": cfg})
            if timed is None:
                continue
            t, err = timed
            row = {"T": T, "cfg": cfg, "ms": t * 1e3, "floor_ms": floor * 1e3, "over_floor": t / floor,
                   "TB_s": used.numel() * per_expert / t / 1e12, "rel_err": err}
            rows.append(row)
            log(f"T={T:5d} {cfg} {t * 1e3:.3f} ms  {row['TB_s']:.2f} TB/s  x{row['over_floor']:.2f}  err {err:.2e}")
            results["kernels"] = rows
            save_results("bench_moe.json", results)
        if T <= 128:      # the sort/alignment step alone: one Triton program vs the torch ops
            from kimik3.ops.options import kernel_options, use_kernel_options
            for name, limit in (("kernel", kernel_options().tuning.align_kernel_max_rows), ("torch", -1)):
                with use_kernel_options(kernel_options().tuned(align_kernel_max_rows=limit)):
                    gs, _ = capture_graph(lambda: _sort_by_expert(ids, E, base["BM"]))
                results.setdefault("sort_ms", {}).setdefault(name, {})[T] = cuda_time(gs.replay, warmup=3, iters=20) * 1e3
                log(f"T={T} sort alone ({name}) {results['sort_ms'][name][T]:.4f} ms")
    return rows


def prefill_kernels(bw, mm):
    """MXFP4 experts at prefill sizes: the fused dequantizing kernels (their default tiles) against
    ``_grouped_mm_mxfp4_experts`` (chunks of experts dequantized to bf16, torch._grouped_mm), both checked
    against the dense bf16 reference; floor = max(FLOPs / matmul rate, packed bytes / copy rate)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    w1, w3, w2 = packed(I, L, g), packed(I, L, g), packed(L, I, g)
    high = max(int(w[1].max()) for w in (w1, w2, w3)) > 128
    d = [mxfp4.dequantize(w[0].reshape(-1, w[0].shape[-1]), w[1].reshape(-1, w[1].shape[-1]), torch.bfloat16)
         .view(E, w[0].shape[1], -1) for w in (w1, w2, w3)]
    per_expert = sum(t[0].numel() + t[1].numel() for t in (w1, w2, w3)) // E
    rows = []
    log("| tokens | rows an expert | fused ms | grouped ms | fused / grouped | floor ms | grouped TFLOP/s |")
    log("|---|---|---|---|---|---|---|")
    for T in (512, 1024, 2048, 4096, 8192):
        x = torch.randn(T, L, generator=g, device="cuda").to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g, device="cuda")[:K] for _ in range(T)])
        weights = torch.rand(T, K, generator=g, device="cuda")
        with reference_ops():
            ref = fused_moe(x, d[0], d[1], d[2], weights, ids, "situ", 4.0, 25.0, True)
        flops = 2 * T * K * 3 * L * I
        floor = max(flops / mm, E * per_expert / bw)
        fused = lambda: fused_moe_triton(x, w1, w2, w3, weights, ids, True, 4.0, 25.0, high_scales=high,  # noqa: E731
                                         tiles=_tiles(T * K / E, True))
        grouped = lambda: moe_kernels._grouped_mm_mxfp4_experts(x, w1, w2, w3, weights, ids, True, 4.0, 25.0, high)  # noqa: E731
        row = {"T": T, "rows_per_expert": T * K / E, "floor_ms": floor * 1e3, "flops": flops}
        for name, fn in (("fused", fused), ("grouped", grouped)):
            row[f"{name}_rel_err"] = rel_err(fn(), ref)
            row[f"{name}_ms"] = cuda_time(fn, warmup=2, iters=10) * 1e3
        rows.append(row)
        log(f"| {T} | {T * K // E} | {row['fused_ms']:.2f} | {row['grouped_ms']:.2f} | "
            f"{row['fused_ms'] / row['grouped_ms']:.2f}x | {row['floor_ms']:.2f} | {flops / row['grouped_ms'] / 1e9:.0f} |"
            f" errs {row['fused_rel_err']:.1e} / {row['grouped_rel_err']:.1e}")
        results["prefill"] = rows
        save_results("bench_moe.json", results)
    return rows


def side_stream():
    model = build_slice(json.loads(CONFIG.read_text()))
    rows = []
    for N in (1, 8, 32, 128):
        cache, batch, ids = decode_setup(model, N)
        fast = step_fn(model, ids, batch, cache)
        out = {}
        saved = [t.clone() for t in (cache.kda_conv, cache.kda_state, cache.mla_latent)]

        def restore():
            for dst, src in zip((cache.kda_conv, cache.kda_state, cache.mla_latent), saved):
                dst.copy_(src)
        for name, stream in (("serial", None), ("side", torch.cuda.Stream()), ("serial2", None)):
            model.use_side_stream(stream)
            restore()
            graph, graph_out = capture_graph(fast)     # the engine runs the overlap inside decode graphs
            restore()
            graph.replay()
            logits = graph_out.float().clone()
            out[name] = {"graph_ms": graph_time(fast) * 1e3, "eager_ms": cuda_time(fast, iters=10) * 1e3,
                         "logits": logits}
        model.use_side_stream(None)
        row = {"N": N, **{k: {"graph_ms": v["graph_ms"], "eager_ms": v["eager_ms"]} for k, v in out.items()},
               "side_vs_serial_logits_max_abs": (out["side"]["logits"] - out["serial"]["logits"]).abs().max().item(),
               "serial_repeat_logits_max_abs": (out["serial2"]["logits"] - out["serial"]["logits"]).abs().max().item()}
        rows.append(row)
        log(row)
        results["side_stream"] = rows
        save_results("bench_moe.json", results)
        del cache, batch
        torch.cuda.empty_cache()
    if "--profile" in sys.argv:
        cache, batch, ids = decode_setup(model, 1)
        results["profile_b1"] = profile("decode b1", step_fn(model, ids, batch, cache), row_limit=25)


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    results["gpu"] = torch.cuda.get_device_name()
    results["date"] = datetime.date.today().isoformat()
    results["commit"] = commit_id()
    t0 = time.time()
    bw, mm = ceilings()
    if "--prefill-only" in sys.argv:
        prefill_kernels(bw, mm)
        save_results("bench_moe.json", results)
        return
    if "--no-kernels" not in sys.argv:
        kernels(bw)
        dense_kernels(bw)
    log(f"kernels done at {time.time() - t0:.0f}s")
    if "--no-model" not in sys.argv:
        side_stream()
    log(f"done at {time.time() - t0:.0f}s")
    save_results("bench_moe.json", results)


if __name__ == "__main__":
    main()
