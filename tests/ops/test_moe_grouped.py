"""The CPU routed-experts path (``ops.moe._grouped_experts``: the assignments sorted by expert once, each used
expert's GEMMs into shared rows, one activation and one combine) against an independent float64 sum written
token by token from the formula, and against the expert loop it replaces (the same products row for row, up to
the GEMM library's rounding, which may depend on the buffers' alignment), at decode and verify sizes, with an expert cache's slot table and with an expert no token chose."""

from __future__ import annotations

import pytest
import torch

from kimik3.ops.activation import glu_activation
from kimik3.ops.moe import _expert_loop, fused_moe, fused_moe_mxfp4
from kimik3.ops import mxfp4

E, L, I, K = 8, 32, 64, 2      # I: MXFP4 groups of 32 (the dense test also runs an awkward 48)
F64 = torch.float64


def _routing(T, g, skip=None):
    """Top-K ids (distinct per token, expert ``skip`` never chosen) and fp32 weights."""
    choices = [e for e in range(E) if e != skip]
    ids = torch.stack([torch.tensor(choices)[torch.randperm(len(choices), generator=g)[:K]] for _ in range(T)])
    return torch.rand(T, K, generator=g), ids.view(T, K)


def _float64_sum(x, w1, w2, w3, weights, ids, beta, linear_beta):
    """y_t = sum_j weights[t, j] * E_{ids[t, j]}(x_t), E_e(x) = situ(x W1_e^T, x W3_e^T) W2_e^T, in float64."""
    x, w1, w2, w3 = (t.to(F64) for t in (x, w1, w2, w3))
    out = torch.zeros(x.shape, dtype=F64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = w1[e] @ x[t], w3[e] @ x[t]
            h = beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * linear_beta * torch.tanh(up / linear_beta)
            out[t] += float(weights[t, j]) * (w2[e] @ h)
    return out


@pytest.mark.parametrize("T", [1, 5, 32, 160])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("I", [I, 48])
def test_grouped_experts_match_float64_and_the_loop(T, dtype, cached, I):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, L, generator=g, dtype=dtype)
    w13 = torch.randn(E, 2 * I, L, generator=g, dtype=dtype) * L ** -0.5
    w2 = torch.randn(E, L, I, generator=g, dtype=dtype) * I ** -0.5
    w1, w3 = w13[:, :I], w13[:, I:]
    weights, ids = _routing(T, g, skip=3)
    slots = None
    if cached:                         # an expert cache: expert e's weights at pool row slots[e]
        slots = torch.randperm(E + 3, generator=g)[:E]
        pools = [torch.full((E + 3, *w.shape[1:]), float("nan"), dtype=dtype) for w in (w13, w2)]
        pools[0][slots], pools[1][slots] = w13, w2
        args = (pools[0][:, :I], pools[1], pools[0][:, I:])
    else:
        args = (w1, w2, w3)
    out = fused_moe(x, *args, weights, ids, "situ", 4.0, 25.0, True, slots=slots)
    ref = _float64_sum(x, w1, w2, w3, weights, ids, 4.0, 25.0)
    tol = 1e-12 if dtype == F64 else 2e-5
    torch.testing.assert_close(out.to(F64), ref, rtol=tol, atol=tol)
    act = glu_activation("situ", 4.0, 25.0)
    loop = _expert_loop(x, lambda e, which: (w1, w2, w3)[which - 1][e], weights, ids, act, True)
    torch.testing.assert_close(out, loop, rtol=tol / 10, atol=tol / 10)     # the same products, GEMM rounding apart


def test_grouped_experts_mxfp4_and_no_tokens():
    """MXFP4 experts (each used one dequantized) give the dense experts' sum of the dequantized weights; an
    empty batch gives an empty result."""
    g = torch.Generator().manual_seed(7)
    T = 6
    codes = [torch.randint(0, 16, (E * n, k), generator=g, dtype=torch.uint8) for n, k in ((2 * I, L), (L, I))]
    scales = [torch.randint(120, 128, (E * n, k // 32), generator=g, dtype=torch.uint8) for n, k in ((2 * I, L), (L, I))]
    w13 = (mxfp4.pack_codes(codes[0]).view(E, 2 * I, L // 2), scales[0].view(E, 2 * I, L // 32))
    w2 = (mxfp4.pack_codes(codes[1]).view(E, L, I // 2), scales[1].view(E, L, I // 32))
    dense13 = torch.stack([mxfp4.dequantize(w13[0][e], w13[1][e], F64) for e in range(E)])
    dense2 = torch.stack([mxfp4.dequantize(w2[0][e], w2[1][e], F64) for e in range(E)])
    half = lambda h: (w13[0][:, h * I:(h + 1) * I], w13[1][:, h * I:(h + 1) * I])   # noqa: E731
    x = torch.randn(T, L, generator=g, dtype=F64)
    weights, ids = _routing(T, g)
    out = fused_moe_mxfp4(x, half(0), w2, half(1), weights, ids, "situ", 4.0, 25.0, True)
    ref = _float64_sum(x, dense13[:, :I], dense2, dense13[:, I:], weights, ids, 4.0, 25.0)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    empty = fused_moe(x[:0], dense13[:, :I], dense2, dense13[:, I:], weights[:0], ids[:0], "situ", 4.0, 25.0, True)
    assert empty.shape == (0, L)
