"""Helpers shared by our Triton kernels."""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Triton's CPU interpreter (TRITON_INTERPRET=1, used by the CPU tests) multiplies bf16 dot
# operands as raw bits; there the kernels upcast dot operands to fp32 first.
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def dot(a, b, acc, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def glu(g, u, beta, linear_beta, SITU: tl.constexpr, CLIP_UP: tl.constexpr):
    """act(g) * u in fp32: SITU (beta tanh(g / beta) sigmoid(g), the up branch clipped to
    linear_beta tanh(u / linear_beta) when CLIP_UP) or SiLU (g sigmoid(g))."""
    if SITU:
        gated = beta * tanh(g / beta) * tl.sigmoid(g)
    else:
        gated = g * tl.sigmoid(g)
    if CLIP_UP:
        u = linear_beta * tanh(u / linear_beta)
    return gated * u
