"""Bias-free dense projections y = x W^T (every projection of the Kimi models).
Reference: torch's linear (cuBLAS on CUDA). CUDA, bf16/fp16, at most ``GEMV_MAX_ROWS`` rows: the
streaming kernel of ``kimik3.ops.triton.gemv``, where the H200 measurement chose it
(``benchmarks/gpu/bench_gemv.py``)."""

from __future__ import annotations

import torch

from kimik3.ops.backend import use_fast_path

# Rows (tokens) up to which a projection takes the streaming kernel on CUDA; 0: never.
GEMV_MAX_ROWS = 0


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N] in x's dtype."""
    if (GEMV_MAX_ROWS and use_fast_path(x) and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.is_contiguous() and 0 < x.numel() <= GEMV_MAX_ROWS * x.shape[-1]):
        from kimik3.ops.triton.gemv import gemv
        return gemv(x, weight)
    return torch.nn.functional.linear(x, weight)
