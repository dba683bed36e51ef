"""FP8 routed experts on one GPU (issues #56 item 3, #57 item 2), one device call:

1. ceilings: copy bandwidth, the bf16 matmul rate, the FP8 matmul rate (``torch._scaled_mm``, 8192^3);
2. Kimi-Linear's experts (256 x [2304 -> 1024], top-8) in bf16 and as FP8 experts (``--quantization fp8``):
   prefill 8k tokens (tok/s; its FLOPs over the bf16 and over the FP8 matmul rate: the two floors), decode at
   batch 1 / 32 / 128 (the touched experts' bytes over the copy rate: each form's floor), and the FP8 experts'
   two forms side by side from 4 to 256 rows an expert (``KernelTuning.fp8_experts_quant_rows_per_expert``:
   where the E4M3 x E4M3 form starts to win);
3. K3's experts (the slice's 64 x [3584 -> 3072], top-16, MXFP4) with bf16 activations (the default paths) and
   W4A8 (``--enable-w4a8-moe``): prefill 8k (same floors), batched decode at 32 / 128 / 512 tokens against the
   bytes floor, and the two from 8 to 2048 rows an expert (``KernelTuning.w4a8_rows_per_expert``);
4. each FP8 form's distance from its bf16 path on these random weights (relative error of the layer output).

Every figure is a ratio measured in this run on this card. Random weights; the routing uniform at random.

    PYTHONPATH=. python benchmarks/gpu/bench_moe_fp8.py [--skip-kimi-linear] [--skip-k3]   (writes $OUT/bench_moe_fp8.json)
"""

from __future__ import annotations

import datetime
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import commit_id, copy_rate, cuda_time, log, matmul_rate, rel_err, save_results  # noqa: E402
from kimik3.ops import fp8                                              # noqa: E402
from kimik3.ops.moe import fused_moe, fused_moe_fp8, fused_moe_mxfp4    # noqa: E402
from kimik3.ops.options import kernel_options, use_kernel_options       # noqa: E402

results: dict = {}
KNOWN = {"--skip-kimi-linear", "--skip-k3"}
BF16 = torch.bfloat16


def save():
    save_results("bench_moe_fp8.json", results)


def fp8_matmul_rate(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda").to(fp8.FP8)
    b = torch.randn(n, n, device="cuda").to(fp8.FP8).t()
    sa, sb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
    return 2 * n ** 3 / cuda_time(lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=BF16), iters=20)


def routing(T: int, E: int, k: int, g) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.rand(T, E, generator=g, device="cuda").argsort(dim=1)[:, :k]
    return torch.rand(T, k, generator=g, device="cuda"), ids


def tuned(**changes):
    import dataclasses
    top = {k: v for k, v in changes.items() if k == "w4a8_moe"}
    rest = {k: v for k, v in changes.items() if k != "w4a8_moe"}
    return use_kernel_options(dataclasses.replace(kernel_options(), **top).tuned(**rest))


def expert_bytes(E_touched: float, L: int, I: int, per_weight: float, per_row: float) -> float:
    """Bytes of the touched experts' three matrices: per_weight a weight plus per_row an output row."""
    return E_touched * (3 * L * I * per_weight + (2 * I + L) * per_row)


def touched(ids: torch.Tensor) -> int:
    return int(torch.unique(ids).numel())


# ---- Kimi-Linear: bf16 experts and FP8 experts ------------------------------------------------------
def kimi_linear(bw: float, mm: float, mm8: float) -> None:
    E, L, I, k = 256, 2304, 1024, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * I, L, generator=g, device="cuda", dtype=BF16) / math.sqrt(L)
    w2 = torch.randn(E, L, I, generator=g, device="cuda", dtype=BF16) / math.sqrt(I)
    c13, s13 = torch.empty(E, 2 * I, L, dtype=fp8.FP8, device="cuda"), torch.empty(E, 2 * I, device="cuda")
    c2, s2 = torch.empty(E, L, I, dtype=fp8.FP8, device="cuda"), torch.empty(E, L, device="cuda")
    for e in range(E):
        c, s = fp8.quantize_weight(w13[e], None)
        c13[e], s13[e] = c, s.view(-1)
        c, s = fp8.quantize_weight(w2[e], None)
        c2[e], s2[e] = c, s.view(-1)
    dense = (w13[:, :I], w2, w13[:, I:])
    quant = ((c13[:, :I], s13[:, :I]), (c2, s2), (c13[:, I:], s13[:, I:]))

    def bf16(x, weights, ids):
        return fused_moe(x, *dense, weights, ids, "silu", 1.0, None, True)

    def fp8_experts(x, weights, ids):
        return fused_moe_fp8(x, *quant, weights, ids, "silu", 1.0, None, True)

    rows = []
    T = 8192
    weights, ids = routing(T, E, k, g)
    x = torch.randn(T, L, generator=g, device="cuda", dtype=BF16)
    flops = 2 * T * k * 3 * L * I
    t16, t8 = cuda_time(lambda: bf16(x, weights, ids), iters=5), cuda_time(lambda: fp8_experts(x, weights, ids), iters=5)
    rows.append({"case": f"prefill {T}", "bf16_ms": t16 * 1e3, "fp8_ms": t8 * 1e3, "bf16_tok_per_s": T / t16,
                 "fp8_tok_per_s": T / t8, "fp8_speedup": t16 / t8, "bf16_over_bf16_floor": t16 / (flops / mm),
                 "fp8_over_bf16_floor": t8 / (flops / mm), "fp8_over_fp8_floor": t8 / (flops / mm8),
                 "fp8_rel_err_vs_bf16": rel_err(fp8_experts(x, weights, ids), bf16(x, weights, ids))})
    log(rows[-1])
    for N in (1, 32, 128):
        weights, ids = routing(N, E, k, g)
        x = torch.randn(N, L, generator=g, device="cuda", dtype=BF16)
        n = touched(ids)
        f16, f8 = expert_bytes(n, L, I, 2, 0) / bw, expert_bytes(n, L, I, 1, 4) / bw
        t16, t8 = cuda_time(lambda: bf16(x, weights, ids)), cuda_time(lambda: fp8_experts(x, weights, ids))
        rows.append({"case": f"decode b{N}", "experts_touched": n, "bf16_us": t16 * 1e6, "fp8_us": t8 * 1e6,
                     "bf16_over_floor": t16 / f16, "fp8_over_floor": t8 / f8, "fp8_speedup": t16 / t8,
                     "fp8_rel_err_vs_bf16": rel_err(fp8_experts(x, weights, ids), bf16(x, weights, ids))})
        log(rows[-1])
    for rpe in (4, 8, 16, 32, 64, 128, 256):                 # the FP8 experts' two forms
        T = rpe * E // k
        weights, ids = routing(T, E, k, g)
        x = torch.randn(T, L, generator=g, device="cuda", dtype=BF16)
        with tuned(fp8_experts_quant_rows_per_expert=1 << 40):
            widened = cuda_time(lambda: fp8_experts(x, weights, ids))
        with tuned(fp8_experts_quant_rows_per_expert=0):
            quantised = cuda_time(lambda: fp8_experts(x, weights, ids))
        rows.append({"case": f"fp8 forms at {rpe} rows an expert ({T} tokens)", "widened_us": widened * 1e6,
                     "quantised_us": quantised * 1e6, "quantised_speedup": widened / quantised})
        log(rows[-1])
    results["kimi_linear_experts"] = rows
    save()


# ---- K3: MXFP4 experts, bf16 activations and W4A8 ----------------------------------------------------
def k3(bw: float, mm: float, mm8: float) -> None:
    E, L, I, k = 64, 3584, 3072, 16
    g = torch.Generator(device="cuda").manual_seed(1)

    def packed(N, K):
        codes = torch.randint(0, 256, (E, N, K // 2), generator=g, device="cuda", dtype=torch.uint8)
        base = 127 - round(math.log2(2 * math.sqrt(K)))
        scale = (base + torch.randint(-1, 2, (E, N, K // 32), generator=g, device="cuda")).to(torch.uint8)
        return codes, scale

    w13 = packed(2 * I, L)
    w1, w3 = (w13[0][:, :I], w13[1][:, :I]), (w13[0][:, I:], w13[1][:, I:])
    w2 = packed(L, I)
    scale_max = max(int(w13[1].max()), int(w2[1].max()))

    def run(x, weights, ids):
        return fused_moe_mxfp4(x, w1, w2, w3, weights, ids, "situ", 4.0, 25.0, True, scale_max)

    def pair(x, weights, ids, iters=10):
        t16 = cuda_time(lambda: run(x, weights, ids), iters=iters)
        with tuned(w4a8_moe=True, w4a8_rows_per_expert=0):
            t8 = cuda_time(lambda: run(x, weights, ids), iters=iters)
            y8 = run(x, weights, ids)
        return t16, t8, rel_err(y8, run(x, weights, ids))

    rows = []
    T = 8192
    weights, ids = routing(T, E, k, g)
    x = torch.randn(T, L, generator=g, device="cuda", dtype=BF16)
    flops = 2 * T * k * 3 * L * I
    t16, t8, err = pair(x, weights, ids, iters=5)
    rows.append({"case": f"prefill {T}", "bf16_act_ms": t16 * 1e3, "w4a8_ms": t8 * 1e3, "bf16_act_tok_per_s": T / t16,
                 "w4a8_tok_per_s": T / t8, "w4a8_speedup": t16 / t8, "bf16_act_over_bf16_floor": t16 / (flops / mm),
                 "w4a8_over_bf16_floor": t8 / (flops / mm), "w4a8_over_fp8_floor": t8 / (flops / mm8),
                 "w4a8_rel_err_vs_bf16_act": err})
    log(rows[-1])
    for N in (32, 128, 512):
        weights, ids = routing(N, E, k, g)
        x = torch.randn(N, L, generator=g, device="cuda", dtype=BF16)
        floor = expert_bytes(touched(ids), L, I, 17 / 32, 0) / bw
        t16, t8, err = pair(x, weights, ids)
        rows.append({"case": f"decode b{N}", "rows_per_expert": N * k / E, "bf16_act_us": t16 * 1e6,
                     "w4a8_us": t8 * 1e6, "bf16_act_over_floor": t16 / floor, "w4a8_over_floor": t8 / floor,
                     "w4a8_speedup": t16 / t8, "w4a8_rel_err_vs_bf16_act": err})
        log(rows[-1])
    for rpe in (8, 16, 32, 48, 64, 128, 256, 512, 1024, 2048):
        T = rpe * E // k
        weights, ids = routing(T, E, k, g)
        x = torch.randn(T, L, generator=g, device="cuda", dtype=BF16)
        t16, t8, _ = pair(x, weights, ids, iters=5)
        rows.append({"case": f"{rpe} rows an expert ({T} tokens)", "bf16_act_us": t16 * 1e6, "w4a8_us": t8 * 1e6,
                     "w4a8_speedup": t16 / t8, "tflops_w4a8": 2 * T * k * 3 * L * I / t8 / 1e12})
        log(rows[-1])
    results["k3_experts"] = rows
    save()


def main() -> None:
    unknown = [a for a in sys.argv[1:] if a not in KNOWN]
    if unknown:
        raise SystemExit(f"bench_moe_fp8.py: unknown argument(s) {unknown}; known: {sorted(KNOWN)}")
    results.update(device=torch.cuda.get_device_name(), commit=commit_id(), date=datetime.date.today().isoformat())
    bw, mm, mm8 = copy_rate(), matmul_rate(), fp8_matmul_rate()
    results["ceilings"] = {"copy_bytes_per_s": bw, "bf16_matmul_flops": mm, "fp8_matmul_flops": mm8}
    log(f"copy {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s, FP8 matmul {mm8 / 1e12:.0f} TFLOP/s")
    if "--skip-kimi-linear" not in sys.argv:
        kimi_linear(bw, mm, mm8)
        torch.cuda.empty_cache()
    if "--skip-k3" not in sys.argv:
        k3(bw, mm, mm8)
    log("saved", save_results("bench_moe_fp8.json", results))


if __name__ == "__main__":
    main()
