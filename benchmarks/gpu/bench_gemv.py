"""Decode-sized projections: the library's GEMM (cuBLAS, and cuBLASLt) against our streaming kernel
(``kimik3.ops.triton.gemv``) on every dense projection shape of both slices, at 1-8 rows.

Each time is one call's share of a CUDA graph of REPS calls that cycle through enough copies of
the weight (> 2x the L2 cache) that every call reads its weight from memory, as a decode step does
(one layer's weight is not read again until the next step). Floor = weight bytes / copy rate.
``--sweep``: also every launch in SWEEP at M = 1 (and the best one at 2-8).
``--experts``: instead, one token's routed experts (``one_token_experts``, Kimi-Linear: 256 experts of
1024 x 2304, top-8; random experts each call) over gate/up launches (EXPERT_UP) with the default
down-and-combine, then down-and-combine launches (EXPERT_DOWN, loops and unrolled) with the best gate/up;
floor = the 8 experts' weight bytes / copy rate. Writes ``bench_gemv.json`` (``bench_gemv_experts.json``).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import capture_graph, commit_id, copy_rate, cuda_time, log, save_results  # noqa: E402
from kimik3.ops.triton.gemv import (GemvConfig, combine_config, expert_up_config, gemv, gemv_config,  # noqa: E402
                                    one_token_experts)

REPS = 24
# (N, K) of the dense projections (benchmarks/gpu/*-slice4.config.json), with the module they are
SHAPES = {
    "kl in_proj": (12576, 2304), "kl o_proj": (2304, 4096), "kl dense gate_up": (18432, 2304),
    "kl dense down": (2304, 9216), "kl shared gate_up": (2048, 2304), "kl shared down": (2304, 1024),
    "kl mla in_proj": (6720, 2304), "kl lm_head": (163840, 2304),
    "k3 in_proj": (49376, 7168), "k3 f_b": (12288, 128), "k3 o_proj": (7168, 12288),
    "k3 dense gate_up": (67584, 7168), "k3 dense down": (7168, 33792), "k3 latent down": (3584, 7168),
    "k3 latent up": (7168, 3584), "k3 shared gate_up": (12288, 7168), "k3 shared down": (7168, 6144),
    "k3 mla in_proj": (14400, 7168), "k3 q_b": (18432, 1536),
}
ROWS = (1, 2, 4, 8)
SWEEP = [GemvConfig(bn, bk, w, 3) for bn in (4, 8, 16) for bk in (256, 512, 1024) for w in (4, 8)
         if bn * bk <= 8192 and bn * bk >= 2048]

EXPERT_UP = [GemvConfig(bn, bk, w, 3) for bn in (4, 8) for bk in (128, 256, 512) for w in (4, 8)]
EXPERT_DOWN = [GemvConfig(bn, bk, w, 3, u) for bn in (4, 8, 16) for bk in (256, 512, 1024) for w in (4, 8)
               for u in (False, True) if bn * bk <= 8192]


def copies_for(nbytes: int) -> int:
    return max(2, min(REPS, -(-(200 << 20) // nbytes)))


def per_call(fn, weights) -> float:
    """Seconds per call: REPS calls over the weight copies in turn, one CUDA graph."""
    graph, _ = capture_graph(lambda: [fn(weights[i % len(weights)]) for i in range(REPS)])
    return cuda_time(graph.replay, warmup=3, iters=20) / REPS


def experts(bw: float, results: dict) -> None:
    """One token's experts at Kimi-Linear's shapes: the gate/up launches, then the down-and-combine ones."""
    E, I, L, k = 256, 1024, 2304, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, L, generator=g, device="cuda") * L ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, L, I, generator=g, device="cuda") * I ** -0.5).to(torch.bfloat16)
    w1, w3 = w13[:, :I], w13[:, I:]
    x = torch.randn(1, L, generator=g, device="cuda").to(torch.bfloat16)
    calls = [(torch.randperm(E, generator=g, device="cuda")[:k].view(1, k),
              torch.rand(1, k, generator=g, device="cuda") * 2.446 / k) for _ in range(REPS)]
    floor = k * 3 * I * L * 2 / bw
    ids0, wt0 = calls[0]
    ref = one_token_experts(x, w1, w2, w3, wt0, ids0, False, 1.0, None).double()

    def seconds(cfgs) -> float:
        out = one_token_experts(x, w1, w2, w3, wt0, ids0, False, 1.0, None, configs=cfgs).double()
        if not ((out - ref).abs() <= 2 ** -6 * ref.abs() + 1e-3).all():
            raise AssertionError(f"one_token_experts off with {cfgs}")
        graph, _ = capture_graph(lambda: [one_token_experts(x, w1, w2, w3, wt, ids, False, 1.0, None, configs=cfgs)
                                          for ids, wt in calls])
        return cuda_time(graph.replay, warmup=3, iters=20) / REPS

    default = (expert_up_config(L, I, k), combine_config(L, I))
    rows = [{"which": "default", "up": str(default[0]), "down": str(default[1]), "us": seconds(default) * 1e6}]
    log(f"# one token's experts (Kimi-Linear, top-{k}): floor {floor * 1e6:.1f} us, default {rows[0]['us']:.1f} us")
    up_us = {cfg: seconds((cfg, default[1])) * 1e6 for cfg in EXPERT_UP}
    rows += [{"which": "up", "up": str(cfg), "down": str(default[1]), "us": us} for cfg, us in up_us.items()]
    up = min(up_us, key=up_us.get)
    for cfg in EXPERT_DOWN:
        rows.append({"which": "down", "up": str(up), "down": str(cfg), "us": seconds((up, cfg)) * 1e6})
    log("| which | gate/up launch | down launch | us | / floor | / default |")
    log("|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["which"], r["us"])):
        log(f"| {r['which']} | {r['up']} | {r['down']} | {r['us']:.1f} | {r['us'] / (floor * 1e6):.2f} | "
            f"{r['us'] / rows[0]['us']:.3f} |")
    results["experts"] = {"floor_us": floor * 1e6, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true", help="time every launch of SWEEP at M=1")
    ap.add_argument("--experts", action="store_true", help="one token's experts' launches instead of the projections")
    ap.add_argument("--shapes", default="", help="comma-separated names of SHAPES to run (default all)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated M values (default 1,2,4,8)")
    args = ap.parse_args()
    bw = copy_rate()
    results = {"commit": commit_id(), "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
               "copy_rate_GBps": bw / 1e9, "reps_per_graph": REPS, "rows": []}
    log(f"# copy rate {bw / 1e9:.0f} GB/s")
    if args.experts:
        experts(bw, results)
        log(f"# wrote {save_results('bench_gemv_experts.json', results)}")
        return
    log("| shape | (N, K) | M | floor us | cuBLAS us | cuBLASLt us | ours (default) us | best swept us (config) | lib / ours | ours / floor |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    names = [s for s in args.shapes.split(",") if s] or list(SHAPES)
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in names:
        N, K = SHAPES[name]
        nbytes = N * K * 2
        ws = [torch.randn(N, K, generator=g, device="cuda").to(torch.bfloat16) for _ in range(copies_for(nbytes))]
        best_cfg = None
        for M in (int(m) for m in args.rows.split(",")):
            x = torch.randn(M, K, generator=g, device="cuda").to(torch.bfloat16)
            want = x.double() @ ws[0].double().t()
            bound = 2 ** -7 * (x.double().abs() @ ws[0].double().abs().t()) + 1e-30
            row = {"shape": name, "N": N, "K": K, "M": M, "floor_us": nbytes / bw * 1e6,
                   "default": str(gemv_config(M, N, K))}
            if not ((gemv(x, ws[0]).double() - want).abs() <= bound).all():
                raise AssertionError(f"gemv off at {name} M={M}")
            row["cublas_us"] = per_call(lambda w: torch.nn.functional.linear(x, w), ws) * 1e6
            try:
                torch.backends.cuda.preferred_blas_library("cublaslt")
                row["cublaslt_us"] = per_call(lambda w: torch.nn.functional.linear(x, w), ws) * 1e6
            finally:
                torch.backends.cuda.preferred_blas_library("cublas")
            row["ours_us"] = per_call(lambda w: gemv(x, w), ws) * 1e6
            row["sweep"] = []
            cfgs = SWEEP if (args.sweep and M == 1) else ([best_cfg] if best_cfg else [])
            for cfg in cfgs:
                if not ((gemv(x, ws[0], cfg).double() - want).abs() <= bound).all():
                    raise AssertionError(f"gemv off at {name} M={M} {cfg}")
                row["sweep"].append({"config": str(cfg), "us": per_call(lambda w, cfg=cfg: gemv(x, w, cfg), ws) * 1e6})
            if args.sweep and M == 1 and row["sweep"]:
                best_cfg = SWEEP[min(range(len(SWEEP)), key=lambda i: row["sweep"][i]["us"])]
            best = min(row["sweep"] or [{"config": "-", "us": float("nan")}], key=lambda s: s["us"])
            lib = min(row["cublas_us"], row["cublaslt_us"])
            ours = min(row["ours_us"], best["us"]) if row["sweep"] else row["ours_us"]
            results["rows"].append(row)
            log(f"| {name} | ({N}, {K}) | {M} | {row['floor_us']:.2f} | {row['cublas_us']:.2f} | {row['cublaslt_us']:.2f} | "
                f"{row['ours_us']:.2f} | {best['us']:.2f} ({best['config']}) | {lib / ours:.2f} | {ours / row['floor_us']:.2f} |")
        del ws
        torch.cuda.empty_cache()
    log(f"# wrote {save_results('bench_gemv.json', results)}")


if __name__ == "__main__":
    main()
