"""RMSNorm variants (spec text-backbone §2.1)."""

from __future__ import annotations

import torch

from kimik3.ops.backend import use_fast_kernel


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32 for low-precision inputs, the input dtype otherwise."""
    return torch.promote_types(dtype, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Kimi's RMSNorm: statistics in fp32, round to x's dtype, then multiply by the weight
    (two roundings for bf16; exact in fp32/fp64). x [..., D], weight [D]. ``dtype``: the norm of
    x rounded to it first (the result in ``dtype``). CUDA: one Triton kernel."""
    dtype = dtype or x.dtype
    if use_fast_kernel(x, weight, dtype):
        from kimik3.ops.triton.norm import KIMI, rms_norm_triton
        return rms_norm_triton(x, weight, eps, KIMI, dtype)
    x = x.to(dtype)
    xf = x.to(acc_dtype(x.dtype))
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y * weight.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s)) for s = x + residual in x's dtype: a residual stream's add and the norm that
    reads it; with ``residual2``, s = x + (residual + residual2) (a sub-layer's output in two parts, their
    sum rounded first). CUDA (same dtype and shape): one Triton kernel reads them all once."""
    parts = (residual,) if residual2 is None else (residual, residual2)
    if use_fast_kernel(x, *parts, weight) and all(r.dtype == x.dtype and r.shape == x.shape for r in parts):
        from kimik3.ops.triton.norm import KIMI, rms_norm_triton
        return rms_norm_triton(x, weight, eps, KIMI, x.dtype, residual=residual, residual2=residual2)
    s = x + (residual if residual2 is None else residual + residual2)
    return s, rms_norm(s, weight, eps)


def rms_norm_fp32_weight(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm with the weight multiply in fp32 and a single rounding (vLLM fused kernels)."""
    if use_fast_kernel(x, weight, out_dtype):
        from kimik3.ops.triton.norm import FP32_WEIGHT, rms_norm_triton
        return rms_norm_triton(x, weight, eps, FP32_WEIGHT, out_dtype)
    acc = acc_dtype(x.dtype)
    xf = x.to(acc)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(acc)).to(out_dtype)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """KDA output norm: rmsnorm(x) * weight * sigmoid(gate), all in fp32, one rounding.
    x, gate [..., V]; weight [V]. CUDA: one Triton kernel."""
    if use_fast_kernel(x, weight, gate, out_dtype):
        from kimik3.ops.triton.norm import GATED, rms_norm_triton
        return rms_norm_triton(x, weight, eps, GATED, out_dtype, gate)
    acc = torch.promote_types(acc_dtype(x.dtype), acc_dtype(gate.dtype))
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(acc)
    return (y * torch.sigmoid(gate.to(acc))).to(out_dtype)
