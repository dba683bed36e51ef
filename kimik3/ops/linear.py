"""Bias-free dense projections y = x W^T (every projection of the Kimi models), and an MLP's gate/up
projection with its GLU activation. Reference: torch's linear (cuBLAS on CUDA), then the activation
op. CUDA, bf16/fp16, at most ``GEMV_MAX_ROWS`` rows: the streaming kernel of
``kimik3.ops.triton.gemv`` (the activation in its epilogue), where measurement chose it (on an H100:
``benchmarks/gpu/bench_gemv.py``, ``bench_slice.py --gemv-ab``)."""

from __future__ import annotations

import torch

from kimik3.ops.activation import glu_activation
from kimik3.ops.backend import use_fast_path

# Rows (tokens) up to which a projection takes the streaming kernel on CUDA (0: never). One row: on the
# lent GPU (H100, e9088c3 / 12cf350) it beat cuBLAS at M = 1 on 14 of the 19 slice shapes (up to 1.4x)
# and made the slices' batch-1 step 0.8-2.6% faster; from 4 rows it lost on most shapes (bench_gemv.py).
GEMV_MAX_ROWS = 1
# Below this reduction length cuBLAS stays faster (K3's f_b, K = 128: 4.1 against 4.3-4.6 us).
GEMV_MIN_K = 512


def _streams(x: torch.Tensor, weight: torch.Tensor) -> bool:
    K = x.shape[-1]
    return bool(GEMV_MAX_ROWS and use_fast_path(x) and x.dtype in (torch.bfloat16, torch.float16) and K >= GEMV_MIN_K
                and weight.dtype == x.dtype and weight.is_contiguous() and 0 < x.numel() <= GEMV_MAX_ROWS * K)


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N] in x's dtype; ``out_dtype``: that result (rounded to x's
    dtype) converted to it, in the same launch on the streaming kernel (the LM head's fp32 logits)."""
    if _streams(x, weight):
        from kimik3.ops.triton.gemv import gemv
        return gemv(x, weight, out_dtype=out_dtype)
    y = torch.nn.functional.linear(x, weight)
    return y if out_dtype is None else y.to(out_dtype)


def linear_glu(x: torch.Tensor, weight: torch.Tensor, hidden_act: str, beta: float,
               linear_beta: float | None) -> torch.Tensor:
    """act(x W_gate^T, x W_up^T) for weight = [W_gate; W_up] ([2I, K]): [..., I] in x's dtype, each
    product rounded to x's dtype before the activation (``kimik3.ops.activation.glu_activation``)."""
    if _streams(x, weight):
        from kimik3.ops.triton.gemv import gemv
        return gemv(x, weight, glu_act=(hidden_act == "situ", beta, linear_beta))
    return glu_activation(hidden_act, beta, linear_beta)(*linear(x, weight).chunk(2, dim=-1))
