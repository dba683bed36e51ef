"""Bias-free dense projections y = x W^T (every projection of the Kimi models), and an MLP's gate/up
projection with its GLU activation. Reference: torch's linear (cuBLAS on CUDA), then the activation
op. CUDA, bf16/fp16, at most ``KernelTuning.gemv_max_rows`` rows: the streaming kernel of
``kimik3.ops.triton.gemv`` (the activation in its epilogue), where measurement chose it (on an H100:
``benchmarks/gpu/bench_gemv.py``, ``bench_slice.py --gemv-ab``)."""

from __future__ import annotations

import torch

from kimik3.ops.activation import glu_activation
from kimik3.ops.backend import use_fast_path
from kimik3.ops.fp8 import WEIGHT_BLOCK, dequantize_activations, dequantize_weight, quantize_activations
from kimik3.ops.options import tuning


def _streams(x: torch.Tensor, weight: torch.Tensor) -> bool:
    K, tune = x.shape[-1], tuning()
    return bool(tune.gemv_max_rows and use_fast_path(x) and x.dtype in (torch.bfloat16, torch.float16)
                and K >= tune.gemv_min_k and weight.dtype == x.dtype and weight.is_contiguous()
                and 0 < x.numel() <= tune.gemv_max_rows * K)


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None,
           weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N] in x's dtype; ``out_dtype``: that result (rounded to x's
    dtype) converted to it, in the same launch on the streaming kernel (the LM head's fp32 logits).
    ``weight_scale``: the weight is FP8 (E4M3 codes) with these scales (``fp8_linear``)."""
    if weight_scale is not None:
        y = fp8_linear(x, weight, weight_scale)
        return y if out_dtype is None else y.to(out_dtype)
    if _streams(x, weight):
        from kimik3.ops.triton.gemv import gemv
        return gemv(x, weight, out_dtype=out_dtype)
    y = _weight_first(x, weight) if _few_host_rows(x, weight) else torch.nn.functional.linear(x, weight)
    return y if out_dtype is None else y.to(out_dtype)


def _few_host_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A host GEMM of a few rows (``KernelTuning.host_weight_first_rows``), in one dtype."""
    lo, hi = tuning().host_weight_first_rows
    return x.device.type == "cpu" and x.dtype == weight.dtype and lo <= x.numel() // max(x.shape[-1], 1) <= hi


def _weight_first(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T as (W x^T)^T: the weight as the GEMM's first operand (row-major, read as it is stored), the few rows
    of x as the second; the result copied back to row-major [..., N]."""
    x2 = x.reshape(-1, x.shape[-1])
    return torch.mm(weight, x2.t()).t().contiguous().view(*x.shape[:-1], weight.shape[0])


def linear_glu(x: torch.Tensor, weight: torch.Tensor, hidden_act: str, beta: float,
               linear_beta: float | None, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """act(x W_gate^T, x W_up^T) for weight = [W_gate; W_up] ([2I, K]): [..., I] in x's dtype, each
    product rounded to x's dtype before the activation (``kimik3.ops.activation.glu_activation``);
    ``weight_scale``: an FP8 weight's scales (``fp8_linear``)."""
    if weight_scale is not None:
        return glu_activation(hidden_act, beta, linear_beta)(*fp8_linear(x, weight, weight_scale).chunk(2, dim=-1))
    if _streams(x, weight):
        from kimik3.ops.triton.gemv import gemv
        return gemv(x, weight, glu_act=(hidden_act == "situ", beta, linear_beta))
    return glu_activation(hidden_act, beta, linear_beta)(*linear(x, weight).chunk(2, dim=-1))


# FP8 weights (``--quantization fp8``; ``kimik3.ops.fp8``). Up to this many rows (decode) a projection keeps
# its activations as they are and reads the E4M3 weight (``ops.triton.fp8_linear``, weight-only); above it
# (prefill) the activations are quantised too, per token (per-channel weights: cuBLAS's FP8 GEMM through
# torch._scaled_mm with row-wise scales) or per token and 128 columns (block weights: our block-scaled
# kernel), and the product runs on the FP8 tensor cores.
FP8_GEMV_MAX_ROWS = 16


def fp8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ W^T in x's dtype, W = codes [N, K] (float8_e4m3fn) times ``scale``: [N] per output channel,
    or [ceil(N / 128), ceil(K / 128)] per 128 x 128 block. Reference (any device, forced or not a kernel dtype):
    the same numbers by e4m3 round trips: the weight dequantised, and above ``FP8_GEMV_MAX_ROWS`` rows the
    activations quantised and dequantised as the kernels quantise them; the product in float32 (float64 for a
    float64 model), rounded to x's dtype."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    blocked = scale.dim() == 2
    quant_a = M > FP8_GEMV_MAX_ROWS
    group = WEIGHT_BLOCK if blocked else None
    if use_fast_path(x) and x.dtype in (torch.bfloat16, torch.float16):
        from kimik3.ops.triton.fp8_linear import fp8_matmul
        if not quant_a:
            y = fp8_matmul(x2.contiguous(), codes, scale, x.dtype)
        else:
            xq, sx = quantize_activations(x2, group)
            if not blocked and x.dtype == torch.bfloat16 and K % 16 == 0 and codes.shape[0] % 16 == 0:   # row-wise: bf16 out
                y = torch._scaled_mm(xq, codes.t(), scale_a=sx, scale_b=scale.view(1, -1), out_dtype=x.dtype)
            else:
                y = fp8_matmul(xq, codes, scale, x.dtype, x_scale=sx)
        return y.view(*x.shape[:-1], -1)
    acc = torch.promote_types(x.dtype, torch.float32)
    w = dequantize_weight(codes, scale.view(-1, 1) if not blocked else scale, acc)
    xa = dequantize_activations(*quantize_activations(x2, group), acc) if quant_a else x2.to(acc)
    return torch.nn.functional.linear(xa, w).to(x.dtype).view(*x.shape[:-1], -1)
