"""Interleaved-pair rotary embedding (kimik3/ops/rope.py) against float64 rotations written from the
math; the Triton kernel runs on CPU tensors through Triton's interpreter, reading Q and K as the
first two slots of one qkv projection (strided heads)."""

import math

import pytest
import torch

from kimik3.ops.backend import reference_ops
from kimik3.ops.rope import rotate_pairs

F64 = torch.float64


def rotated_from_math(x, angles):
    """out[l, h, 2m] = x[2m] cos t - x[2m+1] sin t, out[l, h, 2m+1] = x[2m] sin t + x[2m+1] cos t, t = angles[l, m]."""
    L, H, dh = x.shape
    out = torch.empty(L, H, dh, dtype=F64)
    for l_ in range(L):
        for m in range(dh // 2):
            c, s = math.cos(angles[l_, m]), math.sin(angles[l_, m])
            a, b = x[l_, :, 2 * m].double(), x[l_, :, 2 * m + 1].double()
            out[l_, :, 2 * m], out[l_, :, 2 * m + 1] = a * c - b * s, a * s + b * c
    return out


def _qkv(L, H, dh, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(L, 3 * H, dh, generator=g, dtype=F64).to(dtype)
    angles = torch.rand(L, dh // 2, generator=g, dtype=F64) * 40 - 20
    return qkv[:, :2 * H], angles


def test_reference_in_float64_matches_the_math():
    x, angles = _qkv(5, 2, 8, F64, 0)
    out = rotate_pairs(x, angles.cos(), angles.sin())
    assert (out - rotated_from_math(x, angles)).abs().max() < 1e-13


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("L,H,dh", [(1, 2, 8), (37, 3, 24), (9, 2, 128)])
def test_kernel_matches_the_math(L, H, dh, dtype, kernel_options):
    kernel_options(cpu_kernels=True)                                     # the kernel on CPU tensors
    x, angles = _qkv(L, H, dh, dtype, L + dh)
    cos, sin = angles.cos().float(), angles.sin().float()
    out = rotate_pairs(x, cos, sin)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    ref = rotated_from_math(x, angles)
    # errors against each pair's length, which the rotation keeps: one bf16 rounding (2^-7: the
    # interpreter's conversion truncates; a GPU's rounds to nearest, 2^-8), fp32 ~1e-7
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-6
    assert (_pair_err(out, ref) / _pair_len(x)).max() < tol
    # the reference path, also in float32: the two differ by at most one rounding of the output
    with reference_ops():
        assert (_pair_err(out, rotate_pairs(x, cos, sin)) / _pair_len(x)).max() < tol


def _pair_len(x):
    return x.double().reshape(*x.shape[:-1], -1, 2).norm(dim=-1).clamp_min(1e-6)


def _pair_err(a, b):
    return (a.double() - b.double()).reshape(*a.shape[:-1], -1, 2).norm(dim=-1)


def test_shapes_are_checked():
    x = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match=r"cos and sin of \[4, 4\]"):
        rotate_pairs(x, torch.zeros(4, 3), torch.zeros(4, 3))
