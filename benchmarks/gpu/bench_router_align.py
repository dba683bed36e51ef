"""The MoE router's logits and the expert alignment at decode sizes, one device call (under a minute).

(a) Router logits x [T, D] bf16 @ w [E, D]^T fp32 for (D, E) = Kimi-Linear (2304, 256), the K3
    slice (7168, 64) and K3 release (7168, 896) at T = 1 .. 256: the previous path (``x.float() @
    w.t()``: a cast kernel and cuBLAS's fp32 GEMM) against ``router_logits_triton`` (default tiles;
    ``--sweep`` adds LOGITS_SWEEP); the weight's bytes at the measured copy rate are the floor.
(a') The same logits with the gate weight in bf16, as the checkpoints store it, T = 1 .. 8192: the path
    every model took before (the cast of x and of the weight to fp32, then cuBLAS's fp32 GEMM) against
    ``router_logits`` (the decode kernel, then the bf16 tensor-core GEMM kernel) and that GEMM kernel at
    BF16_GEMM_SWEEP's tiles; floor: the bf16 weight's bytes at the copy rate.
(b) The alignment of R = T x top_k routed rows (``_sort_by_expert``) for Kimi-Linear (256 experts,
    top-8) and K3 release (896 experts, top-16) at R = 8/16 .. 4096: the previous one-program sort
    (``_sort_align_kernel`` below, 4 warps) against ``_align_kernel`` at ``align_warps(R)``;
    ``--sweep`` times the sort at 4 and 16 warps and ``_align_kernel`` at 1, 2, 4 and 8. Every variant's outputs must equal the torch path's.
(c) ``--split``: the MoE layer's routing (logits + routing kernel) with the checkpoint's bf16 gate weight at
    T = 1 .. 256 for the three (D, E): ``route_tokens`` (split-K partials summed by the routing kernel, from
    KernelTuning.router_split_min_tokens) against the unsplit logits (``router_logits``) + ``route``, and the split
    parameters router_split_min_steps x router_split_target_programs (``KernelTuning``) in SPLIT_SWEEP; floor: the weight's bytes. Every
    variant's experts must be a top-k of the float64 routing (``tests/gpu/test_router_align_gpu._routing_ok``).
Each time is one call's share of a CUDA graph of REPS calls back to back (as in a decode graph).

    PYTHONPATH=. python benchmarks/gpu/bench_router_align.py [--sweep] [--split] [--split-only]
                                                              (writes $OUT/bench_router_align.json)
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import capture_graph, commit_id, copy_rate, cuda_time, log, save_results  # noqa: E402
from kimik3.ops.backend import reference_ops                           # noqa: E402
from kimik3.ops.options import kernel_options, use_kernel_options     # noqa: E402

from kimik3.ops.triton import moe as moe_kernels                       # noqa: E402
from kimik3.ops.triton.router import logits_config, router_logits_triton  # noqa: E402

REPS = 20
LOGITS_SHAPES = {"kimi_linear": (2304, 256), "k3_slice": (7168, 64), "k3_release": (7168, 896)}
TOKENS = (1, 8, 16, 32, 64, 128, 256)
LOGITS_SWEEP = [dict(BT=bt, BE=be, BD=4096 // (bt * be), warps=w) for bt, be, w in
                ((1, 1, 4), (1, 2, 4), (1, 4, 4), (8, 1, 4), (8, 1, 8), (8, 2, 4), (8, 4, 4), (8, 8, 4),
                 (4, 8, 4), (16, 4, 4), (16, 8, 4), (8, 16, 4), (16, 16, 4), (16, 8, 8))]
BF16_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 8192)
BF16_GEMM_SWEEP = ((32, 32, 64, 4), (64, 32, 64, 4), (64, 64, 64, 4), (64, 16, 128, 4), (128, 64, 32, 4),
                   (128, 128, 64, 8))
ALIGN_SHAPES = {"kimi_linear": (256, 8), "k3_release": (896, 16)}      # experts, top-k
ALIGN_ROWS = (8, 256, 1024, 2048, 4096)
SPLIT_SHAPES = {"kimi_linear": (2304, 256, 8, 2.446), "k3_slice": (7168, 64, 16, 1.0), "k3_release": (7168, 896, 16, 1.0)}
SPLIT_SWEEP = ((2, 128), (4, 64), (4, 128), (4, 256), (8, 128))      # (router_split_min_steps, router_split_target_programs)


@triton.jit(do_not_specialize=["R", "cap"])
def _sort_align_kernel(ids, sorted_rows, block_expert, R, E, cap, BM: tl.constexpr, BR: tl.constexpr,
                       BE: tl.constexpr, BCAP: tl.constexpr):
    """The previous alignment (commit before this benchmark), for comparison: one program sorts
    the (expert, row) keys, counts per expert and places each row at its padded start + rank."""
    i = tl.arange(0, BR)
    e = tl.load(ids + i, mask=i < R, other=E).to(tl.int32)
    key = tl.sort(e * BR + i)
    se, sr = key // BR, key % BR
    counts = tl.histogram(se, BE)
    padded = (counts + BM - 1) // BM * BM
    start = tl.cumsum(counts, 0) - counts
    pad_start = tl.cumsum(padded, 0) - padded
    rank = i - tl.gather(start, se, 0)
    dest = tl.gather(pad_start, se, 0) + rank
    c = tl.arange(0, BCAP)
    tl.store(sorted_rows + c, tl.full([BCAP], 0, tl.int64) + R, mask=c < cap)
    tl.store(block_expert + c, tl.full([BCAP], -1, tl.int64), mask=c < cap // BM)
    tl.debug_barrier()
    real = se < E
    tl.store(sorted_rows + dest, sr.to(tl.int64), mask=real)
    tl.store(block_expert + dest // BM, se.to(tl.int64), mask=real & (rank % BM == 0))


def graph_time(fn) -> float:
    """Seconds per call of ``fn``: REPS calls captured in one CUDA graph, the replay timed."""
    graph, _ = capture_graph(lambda: [fn() for _ in range(REPS)])
    return cuda_time(graph.replay, warmup=3, iters=20) / REPS


def logits(results: dict, bw: float, sweep: bool) -> None:
    log("| (D, E) | T | previous us | triton us | speed-up | floor us | best sweep us (config) |")
    log("|---|---|---|---|---|---|---|")
    for name, (D, E) in LOGITS_SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(D + E)
        w = torch.randn(E, D, generator=g, device="cuda") * D ** -0.5
        for T in TOKENS:
            x = torch.randn(T, D, generator=g, device="cuda").to(torch.bfloat16)
            want = x.double() @ w.double().t()
            bound = 2 ** -20 * (x.double().abs() @ w.double().abs().t())
            row = {"D": D, "E": E, "T": T, "floor_us": E * D * 4 / bw * 1e6,
                   "previous_us": graph_time(lambda: x.float() @ w.t()) * 1e6, "config": logits_config(T, E)}
            row["triton_us"] = graph_time(lambda: router_logits_triton(x, w)) * 1e6
            row["sweep"] = []
            for cfg in [None] + (LOGITS_SWEEP if sweep else []):
                out = router_logits_triton(x, w, cfg)
                if not ((out.double() - want).abs() <= bound).all():
                    raise AssertionError(f"router logits off at {name} T={T} config={cfg}")
                if cfg:
                    row["sweep"].append({"config": cfg, "us": graph_time(lambda cfg=cfg: router_logits_triton(x, w, cfg)) * 1e6})
            best = min(row["sweep"] or [{"config": "default", "us": row["triton_us"]}], key=lambda s: s["us"])
            results["logits"].append(row)
            log(f"| ({D}, {E}) | {T} | {row['previous_us']:.2f} | {row['triton_us']:.2f} | "
                f"{row['previous_us'] / row['triton_us']:.2f}x | {row['floor_us']:.2f} | {best['us']:.2f} ({best['config']}) |")


PREFILL_TOKENS = (128, 512, 1024, 2048, 8192)


def prefill_logits(results: dict) -> None:
    """Long steps: the cast + cuBLAS fp32 GEMM against the TF32 x3 tile kernel (``router_logits_gemm_triton``),
    both checked against float64 within the fp32 bound; the kernel's rate from FLOPs 2 T E D."""
    from kimik3.ops.triton.router import router_logits_gemm_triton
    log("| (D, E) | T | cast + fp32 GEMM us | TF32x3 kernel us | speed-up | TFLOP/s kernel |")
    log("|---|---|---|---|---|---|")
    for name, (D, E) in LOGITS_SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(D + E + 1)
        w = torch.randn(E, D, generator=g, device="cuda") * D ** -0.5
        for T in PREFILL_TOKENS:
            x = torch.randn(T, D, generator=g, device="cuda").to(torch.bfloat16)
            want = x.double() @ w.double().t()
            bound = 2 ** -20 * (x.double().abs() @ w.double().abs().t())
            out = router_logits_gemm_triton(x, w)
            ok = bool(((out.double() - want).abs() <= bound).all())
            prev = cuda_time(lambda: x.float() @ w.t(), iters=20) * 1e6
            ours = cuda_time(lambda: router_logits_gemm_triton(x, w), iters=20) * 1e6
            results.setdefault("prefill_logits", []).append({"D": D, "E": E, "T": T, "previous_us": prev,
                                                             "kernel_us": ours, "within_fp32_bound": ok})
            log(f"| ({D}, {E}) | {T} | {prev:.1f} | {ours:.1f} | {prev / ours:.2f}x | {2 * T * E * D / ours / 1e6:.0f} |"
                + ("" if ok else " **outside the fp32 bound**"))


def bf16_weight_logits(results: dict, bw: float) -> None:
    """(a'): the checkpoint's bf16 gate weight; every variant checked against float64 within the fp32 bound."""
    from kimik3.ops.router import router_logits
    from kimik3.ops.triton.router import gemm_tiles, router_logits_gemm_triton
    log("| (D, E) bf16 weight | T | cast + fp32 GEMM us | router_logits us | speed-up | floor us | GEMM kernel default us "
        "| best GEMM tiles us |")
    log("|---|---|---|---|---|---|---|---|")
    for name, (D, E) in LOGITS_SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(D + E + 2)
        w = (torch.randn(E, D, generator=g, device="cuda") * D ** -0.5).to(torch.bfloat16)
        for T in BF16_TOKENS:
            x = torch.randn(T, D, generator=g, device="cuda").to(torch.bfloat16)
            want = x.double() @ w.double().t()
            bound = 2 ** -20 * (x.double().abs() @ w.double().abs().t())
            for fn in (lambda: router_logits(x, w), lambda: router_logits_gemm_triton(x, w),
                       *(lambda t=t: router_logits_gemm_triton(x, w, t) for t in BF16_GEMM_SWEEP)):
                if not ((fn().double() - want).abs() <= bound).all():
                    raise AssertionError(f"bf16-weight router logits off at {name} T={T}")
            timer = graph_time if T <= 256 else (lambda f: cuda_time(f, iters=20))
            row = {"D": D, "E": E, "T": T, "floor_us": E * D * 2 / bw * 1e6,
                   "previous_us": timer(lambda: x.float() @ w.float().t()) * 1e6,
                   "router_logits_us": timer(lambda: router_logits(x, w)) * 1e6,
                   "gemm_default_us": timer(lambda: router_logits_gemm_triton(x, w)) * 1e6,
                   "gemm_default_tiles": gemm_tiles(T, E, False),
                   "gemm_sweep": {str(t): timer(lambda t=t: router_logits_gemm_triton(x, w, t)) * 1e6
                                  for t in BF16_GEMM_SWEEP}}
            best = min(row["gemm_sweep"].items(), key=lambda kv: kv[1])
            results.setdefault("bf16_weight_logits", []).append(row)
            log(f"| ({D}, {E}) | {T} | {row['previous_us']:.2f} | {row['router_logits_us']:.2f} | "
                f"{row['previous_us'] / row['router_logits_us']:.2f}x | {row['floor_us']:.2f} | "
                f"{row['gemm_default_us']:.2f} | {best[1]:.2f} {best[0]} |")


ROUTE_SHAPES = {"kimi_linear": (256, 8, 2.446), "k3_slice": (64, 16, 1.0), "k3_release": (896, 16, 1.0)}


def routing(results: dict) -> None:
    """The routing kernel (scores, biased top-k, weights) at 1-128 tokens by warps a program; ids must equal
    the torch path's and weights match it."""
    from kimik3.ops.router import route
    from kimik3.ops.triton.router import route_triton, route_warps
    log("| experts, top-k | T | us at 1 / 2 / 4 / 8 warps | default warps |")
    log("|---|---|---|---|")
    for name, (E, k, scale) in ROUTE_SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(E + k)
        bias = torch.randn(E, generator=g, device="cuda") * 0.3
        for T in (1, 8, 32, 128):
            logits = torch.randn(T, E, generator=g, device="cuda") * 3
            args = (bias, k, "sigmoid", 1, 1, True, scale, 1e-20)
            with reference_ops():
                w_ref, i_ref = route(logits, *args)
            row = {"E": E, "top_k": k, "T": T, "us": {}}
            for warps in (1, 2, 4, 8):
                w, i = route_triton(logits, *args, num_warps=warps)
                if not torch.equal(i, i_ref) or not torch.allclose(w, w_ref, rtol=1e-6, atol=1e-7):
                    raise AssertionError(f"routing off at {name} T={T} warps={warps}")
                row["us"][warps] = graph_time(lambda warps=warps: route_triton(logits, *args, num_warps=warps)) * 1e6
            results.setdefault("route", []).append(row)
            log(f"| {E}, {k} | {T} | " + " / ".join(f"{row['us'][w]:.2f}" for w in (1, 2, 4, 8)) + f" | {route_warps(E)} |")


def split_routing(results: dict, bw: float) -> None:
    """(c): ``route_tokens`` split-K against the unsplit logits + routing, and the split parameters swept."""
    from kimik3.ops import router
    from kimik3.ops.triton import router as kernel
    from tests.gpu.test_router_align_gpu import _routing_ok
    log("\n| (D, E) | T | unsplit logits + route us | route_tokens us (splits) | speed-up | floor us | "
        "sweep (min steps, programs): us |")
    log("|---|---|---|---|---|---|---|")
    for name, (D, E, k, scale) in SPLIT_SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(D + E)
        w = (torch.randn(E, D, generator=g, device="cuda") * D ** -0.5).to(torch.bfloat16)
        bias = torch.randn(E, generator=g, device="cuda") * 0.1
        args = (bias, k, "sigmoid", 1, 1, True, scale, 0.0)
        for T in TOKENS:
            x = (torch.randn(T, D, generator=g, device="cuda") * 2).to(torch.bfloat16)
            unsplit = lambda: router.route(router.router_logits(x, w), *args)          # noqa: E731
            split = lambda: router.route_tokens(x, w, *args)                            # noqa: E731
            row = {"D": D, "E": E, "T": T, "floor_us": E * D * 2 / bw * 1e6, "unsplit_us": graph_time(unsplit) * 1e6,
                   "splits": kernel.split_tiles(T, E, D)[4] if router.splits_logits(T) else 1,
                   "route_tokens_us": graph_time(split) * 1e6, "sweep": {}}
            for fn in (unsplit, split):
                if not _routing_ok(*fn(), x, w, bias, k, scale):
                    raise AssertionError(f"routing off at {name} T={T}")
            if router.splits_logits(T):
                for steps, programs in SPLIT_SWEEP:
                    with use_kernel_options(kernel_options().tuned(router_split_min_steps=steps,
                                                                   router_split_target_programs=programs)):
                        if not _routing_ok(*split(), x, w, bias, k, scale):
                            raise AssertionError(f"split routing off at {name} T={T} {steps, programs}")
                        row["sweep"][f"{steps},{programs}"] = graph_time(split) * 1e6
            results.setdefault("split_routing", []).append(row)
            log(f"| ({D}, {E}) | {T} | {row['unsplit_us']:.2f} | {row['route_tokens_us']:.2f} ({row['splits']}) | "
                f"{row['unsplit_us'] / row['route_tokens_us']:.2f}x | {row['floor_us']:.2f} | "
                + ", ".join(f"({key}): {us:.2f}" for key, us in row["sweep"].items()) + " |")


def previous_align(ids: torch.Tensor, E: int, BM: int, warps: int):
    """``_sort_by_expert``'s previous launch of the one-program sort."""
    flat = ids.reshape(-1)
    R = flat.numel()
    cap = (R + min(E, R) * (BM - 1) + BM - 1) // BM * BM
    rows = torch.empty(cap, dtype=torch.int64, device=ids.device)
    blocks = torch.empty(cap // BM, dtype=torch.int64, device=ids.device)
    _sort_align_kernel[(1,)](flat, rows, blocks, R, E, cap, BM=BM, BR=triton.next_power_of_2(R),
                             BE=triton.next_power_of_2(E + 1), BCAP=triton.next_power_of_2(cap), num_warps=warps)
    return rows, blocks


def align(results: dict, sweep: bool) -> None:
    log("\n| experts, top-k | R | BM | previous (sort, 4 warps) us | new us (warps) | speed-up | sweep: us by warps |")
    log("|---|---|---|---|---|---|---|")
    real_warps = moe_kernels.align_warps
    for name, (E, k) in ALIGN_SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(E)
        for R in ALIGN_ROWS:
            T = max(1, R // k)
            R = T * k
            ids = torch.stack([torch.randperm(E, generator=g, device="cuda")[:k] for _ in range(T)])
            BM = moe_kernels._tiles(R / E)["BM"]
            with use_kernel_options(kernel_options().tuned(align_kernel_max_rows=-1)):
                want = moe_kernels._sort_by_expert(ids, E, BM)
            row = {"experts": E, "top_k": k, "R": R, "BM": BM, "new_warps": real_warps(R), "sort": {}, "new": {}}
            runs = [("sort", w) for w in ((4, 16) if sweep else (4,))]
            runs += [("new", w) for w in sorted({real_warps(R), *((1, 2, 4, 8) if sweep else ())})]
            try:
                for kind, warps in runs:
                    if kind == "sort":
                        fn = lambda warps=warps: previous_align(ids, E, BM, warps)            # noqa: E731
                    else:
                        moe_kernels.align_warps = lambda R, warps=warps: warps
                        fn = lambda: moe_kernels._sort_by_expert(ids, E, BM)                   # noqa: E731
                    if not all(torch.equal(a, b) for a, b in zip(fn(), want)):
                        raise AssertionError(f"{kind} alignment differs from the torch path: {name} R={R} warps={warps}")
                    row[kind][warps] = graph_time(fn) * 1e6
            finally:
                moe_kernels.align_warps = real_warps
            results["align"].append(row)
            base, new = row["sort"][4], row["new"][row["new_warps"]]
            swept = "; ".join(f"{kind} " + ", ".join(f"{w}: {us:.1f}" for w, us in row[kind].items())
                              for kind in ("sort", "new")) if sweep else ""
            log(f"| {E}, {k} | {R} | {BM} | {base:.2f} | {new:.2f} ({row['new_warps']}) | {base / new:.1f}x | {swept} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true", help="also time LOGITS_SWEEP and other warps for the alignment")
    ap.add_argument("--route-only", action="store_true", help="only the routing kernel by warps")
    ap.add_argument("--split", action="store_true", help="also (c): split-K routing against unsplit")
    ap.add_argument("--split-only", action="store_true", help="only (c)")
    args = ap.parse_args()
    bw = copy_rate()
    results = {"commit": commit_id(), "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
               "copy_rate_GBps": bw / 1e9, "reps_per_graph": REPS, "logits": [], "align": []}
    if args.route_only:
        routing(results)
    elif args.split_only:
        split_routing(results, bw)
    else:
        logits(results, bw, args.sweep)
        prefill_logits(results)
        bf16_weight_logits(results, bw)
        routing(results)
        align(results, args.sweep)
        if args.split:
            split_routing(results, bw)
    log(f"# wrote {save_results('bench_router_align.json', results)}")


if __name__ == "__main__":
    main()
