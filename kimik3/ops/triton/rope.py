"""Interleaved-pair rotary embedding in one pass (reference: ``kimik3.ops.rope``): rows of
(token, head) read through their strides, each pair turned in fp32 and rounded once. The row count
is not specialised on: one compile per (head dim, dtype)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimik3.ops.triton.common import pdl, pdl_entry


@triton.jit(do_not_specialize=["R", "H", "sx_t", "sx_h"])
def _rotate_pairs_kernel(x, c, s, y, R, H, sx_t, sx_h, HALF: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_entry(PDL)
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)          # (token, head) pairs
    m = tl.arange(0, BH)
    mask = (rows[:, None] < R) & (m[None, :] < HALF)
    tok, head = rows // H, rows % H
    src = x + tok[:, None] * sx_t + head[:, None] * sx_h + 2 * m[None, :]
    a = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)
    cs = tok[:, None] * HALF + m[None, :]
    cv = tl.load(c + cs, mask=mask, other=0.0)
    sv = tl.load(s + cs, mask=mask, other=0.0)
    dst = y + rows[:, None] * (2 * HALF) + 2 * m[None, :]
    tl.store(dst, (a * cv - b * sv).to(y.dtype.element_ty), mask=mask)
    tl.store(dst + 1, (a * sv + b * cv).to(y.dtype.element_ty), mask=mask)


def rotate_pairs_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [L, H, dh] (bf16/fp16/fp32, unit feature stride), cos / sin [L, dh/2] float32 -> [L, H, dh]
    contiguous in x's dtype."""
    L, H, dh = x.shape
    if x.stride(-1) != 1:
        raise ValueError("rotate_pairs_triton needs unit stride on the feature axis of x")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"rotate_pairs_triton takes float32 cos / sin, got {cos.dtype} / {sin.dtype}")
    c, s = cos.contiguous(), sin.contiguous()
    y = torch.empty(L, H, dh, dtype=x.dtype, device=x.device)
    R, half = L * H, dh // 2
    BH = triton.next_power_of_2(half)
    BR = max(1, 4096 // BH)
    if R:
        _rotate_pairs_kernel[(triton.cdiv(R, BR),)](x, c, s, y, R, H, x.stride(0), x.stride(1), HALF=half, BR=BR,
                                                   BH=BH, num_warps=4, **pdl(x))
    return y
