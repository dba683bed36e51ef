"""Rotary embedding of interleaved pairs (MoonViT's 2D RoPE, spec vision-multimodal §3.3): each pair
(x[2m], x[2m+1]) of a head turns by the angle whose cosine and sine are given per row."""

from __future__ import annotations

import torch

from kimik3.ops.backend import use_fast_kernel


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [L, H, dh] (unit feature stride, any row and head strides: e.g. the Q and K slots of one qkv
    projection as 2H heads), cos / sin [L, dh/2] -> [L, H, dh] in x's dtype:
    (a, b) -> (a cos - b sin, a sin + b cos), computed in cos's dtype, one rounding.
    CUDA: one Triton kernel (where torch launches about nine, with float32 temporaries)."""
    L, H, dh = x.shape
    if dh % 2 or cos.shape != (L, dh // 2) or sin.shape != cos.shape:
        raise ValueError(f"rotate_pairs: x {list(x.shape)} needs cos and sin of [{L}, {dh // 2}], "
                         f"got {list(cos.shape)} and {list(sin.shape)}")
    if use_fast_kernel(x, cos) and cos.dtype == sin.dtype == torch.float32:
        from kimik3.ops.triton.rope import rotate_pairs_triton
        return rotate_pairs_triton(x, cos, sin)
    ct = cos.dtype
    pairs = x.to(ct).reshape(L, H, dh // 2, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).reshape(x.shape).to(x.dtype)
