"""FP8 on one GPU (issue #56), one device call:

1. ceilings: copy bandwidth, the bf16 matmul rate and the FP8 matmul rate (``torch._scaled_mm``, E4M3 x E4M3,
   row-wise scales, 8192^3);
2. FP8 weights, projection by projection: every dense projection shape of the Kimi-Linear slice at M = 1 / 32 /
   128 rows (decode: our FP8 GEMV against bf16 cuBLAS and against its floor, weight bytes / bandwidth) and at
   M = 8192 (prefill: fp8_linear, activations quantised included, against the FP8 matmul rate);
3. the Kimi-Linear-width slice (``kimi-linear-slice4.config.json``: 3 KDA + 1 MLA layers, 256 bf16 experts,
   random weights) decoding at batch 1 / 32 / 128 over a 4k context in CUDA graphs, in bf16 and with FP8
   weights (``kimik3.loader.fp8.quantize_fp8``), each against its floor (bytes from the shapes, the FP8
   projections at one byte a weight; the larger of bytes / bandwidth and FLOPs / bf16 rate), and an 8k-token
   prefill in both;
4. the FP8 latent cache: the MLA decode kernel alone at H = 32 (Kimi-Linear) and 96 (K3), batch 1 / 32 / 128 over
   4k and 32k contexts, bf16 cache against FP8 cache, each against its floor (the cache bytes it reads).

    PYTHONPATH=. python benchmarks/gpu/bench_fp8.py          (writes $OUT/bench_fp8.json)
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import commit_id, copy_rate, cuda_time, log, matmul_rate, save_results  # noqa: E402
from benchmarks.gpu.bench_slice import (BLOCK, CONTEXT, KIMI_LINEAR_CONFIG, build_slice, counts,  # noqa: E402
                                        decode_setup, graph_time, step_fn, touched_experts)
from kimik3.loader.fp8 import quantize_fp8                              # noqa: E402
from kimik3.model.batch import ForwardBatch, HybridCache                 # noqa: E402
from kimik3.model.layers import Linear, MergedLinear                     # noqa: E402
from kimik3.ops import fp8                                              # noqa: E402
from kimik3.ops.linear import fp8_linear                                # noqa: E402
from kimik3.ops.mla import mla_decode_attention                         # noqa: E402

results: dict = {}
KNOWN = {"--skip-slice", "--skip-cache", "--skip-shapes"}


def save():
    save_results("bench_fp8.json", results)


def fp8_matmul_rate(n: int = 8192) -> float:
    """FLOP/s of torch._scaled_mm on E4M3 operands with row-wise float32 scales (the cuBLAS FP8 GEMM)."""
    a = torch.randn(n, n, device="cuda").to(fp8.FP8)
    b = torch.randn(n, n, device="cuda").to(fp8.FP8).t()
    sa, sb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
    return 2 * n ** 3 / cuda_time(lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16),
                                  iters=20)


def ceilings() -> tuple[float, float, float]:
    bw, mm, mm8 = copy_rate(), matmul_rate(), fp8_matmul_rate()
    results["ceilings"] = {"copy_bytes_per_s": bw, "bf16_matmul_flops": mm, "fp8_matmul_flops": mm8}
    log(f"copy {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s, FP8 matmul {mm8 / 1e12:.0f} TFLOP/s")
    return bw, mm, mm8


def projection_shapes(model) -> dict[str, tuple[int, int]]:
    """(N, K) of every dense projection ``quantize_fp8`` would quantise, one per distinct shape."""
    from kimik3.loader.fp8 import FP8_PROJECTIONS
    shapes = {}
    for name, m in model.named_modules():
        if isinstance(m, (Linear, MergedLinear)) and FP8_PROJECTIONS.match(name):
            shapes.setdefault(tuple(m.weight.shape), name)
    return {name: shape for shape, name in shapes.items()}


def bench_shapes(model, bw, mm8) -> None:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (N, K) in projection_shapes(model).items():
        w = torch.randn(N, K, device="cuda", generator=g, dtype=torch.bfloat16) / K ** 0.5
        codes, scale = fp8.quantize_weight(w, None)
        scale = scale.view(-1)
        for M in (1, 32, 128, 8192):
            x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
            t8 = cuda_time(lambda: fp8_linear(x, codes, scale), iters=20)
            t16 = cuda_time(lambda: torch.nn.functional.linear(x, w), iters=20)
            row = {"projection": name, "M": M, "N": N, "K": K, "fp8_us": t8 * 1e6, "bf16_cublas_us": t16 * 1e6,
                   "fp8_speedup_vs_bf16": t16 / t8}
            if M <= 128:
                floor = (N * K + 4 * N + 2 * M * (N + K)) / bw
                row.update(floor_us=floor * 1e6, fp8_over_floor=t8 / floor)
            else:
                row.update(fp8_fraction_of_fp8_matmul_rate=2 * M * N * K / t8 / mm8)
            rows.append(row)
            log(row)
    results["projections"] = rows
    save()


def fp8_param_count(model) -> int:
    return sum(m.weight.numel() for m in model.modules() if getattr(m, "weight_scale", None) is not None)


def bench_slice_modes(bw, mm) -> None:
    cfg = json.loads(KIMI_LINEAR_CONFIG.read_text())
    model = build_slice(cfg, str(KIMI_LINEAR_CONFIG))
    rows = []
    for mode in ("bf16", "fp8_weights"):
        if mode == "fp8_weights":
            quantize_fp8(model)
        saved = fp8_param_count(model)                 # a byte a weight instead of two
        for N in (1, 32, 128):
            cache, batch, ids = decode_setup(model, N)
            fast = step_fn(model, ids, batch, cache)
            model.use_side_stream(torch.cuda.Stream())
            t = graph_time(fast)
            model.use_side_stream(None)
            byts, flops = counts(model, N, 0, "decode", touched_experts(fast))
            byts -= saved
            floor = max(byts / bw, flops / mm)
            rows.append({"mode": mode, "case": f"decode b{N} ctx{CONTEXT}", "t_graph_ms": None if t is None else t * 1e3,
                         "floor_ms": floor * 1e3, "time_over_floor": None if t is None else t / floor})
            log(rows[-1])
            del cache, batch
            torch.cuda.empty_cache()
        T = 8192
        cache = HybridCache.allocate(model.config.text, num_slots=2, num_blocks=T // BLOCK + 1, block_size=BLOCK,
                                     dtype=torch.bfloat16, device="cuda")
        batch = ForwardBatch.build([T], [0], [1], [list(range(1, T // BLOCK + 1))], BLOCK, device="cuda")
        ids = torch.randint(0, model.config.text.vocab_size, (T,), device="cuda")
        t = cuda_time(step_fn(model, ids, batch, cache, last_only=True), warmup=2, iters=5)
        rows.append({"mode": mode, "case": f"prefill {T}", "t_eager_ms": t * 1e3})
        log(rows[-1])
        results["slice"] = rows
        save()
        del cache
        torch.cuda.empty_cache()


def decode_times(q, qp, tables, lens, ctx: int, per_seq: int, g) -> tuple[float, float]:
    """Seconds of one MLA decode over a bf16 latent cache, then over the same rows in FP8 with their scales."""
    R, P = q.shape[-1], qp.shape[-1]
    cache = torch.randn(1 + q.shape[0] * per_seq, BLOCK, R + P, device="cuda", generator=g, dtype=torch.bfloat16)
    t16 = cuda_time(lambda: mla_decode_attention(q, qp, cache, tables, lens, R, 0.07, max_seq_len=ctx + 1))
    codes, scale = fp8.quantize_rows(cache)
    t8 = cuda_time(lambda: mla_decode_attention(q, qp, codes, tables, lens, R, 0.07, max_seq_len=ctx + 1,
                                                cache_scale=scale))
    return t16, t8


def bench_cache(bw) -> None:
    rows = []
    R, P = 512, 64
    g = torch.Generator(device="cuda").manual_seed(1)
    for H in (32, 96):
        for ctx in (4096, 32768):
            for N in (1, 32, 128):
                per_seq = -(-(ctx + 1) // BLOCK)
                if N * per_seq * BLOCK * (R + P) * 2 > 8 << 30:
                    continue
                tables = torch.arange(1, 1 + N * per_seq, device="cuda", dtype=torch.int32).view(N, per_seq)
                lens = torch.full((N,), ctx + 1, device="cuda", dtype=torch.int32)
                q = torch.randn(N, H, R, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05
                qp = torch.randn(N, H, P, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05
                t16, t8 = decode_times(q, qp, tables, lens, ctx, per_seq, g)
                tokens = N * (ctx + 1)
                f16, f8 = tokens * (R + P) * 2 / bw, tokens * (R + P + 4) / bw
                rows.append({"H": H, "context": ctx, "batch": N, "bf16_us": t16 * 1e6, "fp8_us": t8 * 1e6,
                             "bf16_over_floor": t16 / f16, "fp8_over_floor": t8 / f8, "fp8_speedup": t16 / t8})
                log(rows[-1])
                torch.cuda.empty_cache()
    results["latent_cache_decode"] = rows
    save()


def main() -> None:
    unknown = [a for a in sys.argv[1:] if a not in KNOWN]
    if unknown:
        raise SystemExit(f"bench_fp8.py: unknown argument(s) {unknown}; known: {sorted(KNOWN)}")
    results.update(device=torch.cuda.get_device_name(), commit=commit_id(), date=datetime.date.today().isoformat())
    bw, mm, mm8 = ceilings()
    if "--skip-shapes" not in sys.argv:
        cfg = json.loads(KIMI_LINEAR_CONFIG.read_text())
        bench_shapes(build_slice(cfg, str(KIMI_LINEAR_CONFIG)), bw, mm8)
        torch.cuda.empty_cache()
    if "--skip-cache" not in sys.argv:
        bench_cache(bw)
    if "--skip-slice" not in sys.argv:
        bench_slice_modes(bw, mm)
    log("saved", save_results("bench_fp8.json", results))


if __name__ == "__main__":
    main()
