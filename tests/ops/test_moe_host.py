"""Routed experts with the uncached ones computed on the host (``kimik3.ops.moe_host``, expert offload's host
strategy): the byte-table MXFP4 decode gives ``mxfp4.dequantize``'s bits; the reference (the CPU path) gives the
resident reference's bits for any set of missed experts; the kernel path (Triton through TRITON_INTERPRET=1 with
``cpu_kernels``: what CUDA runs) never reads a missed expert's pool rows (they hold NaN here) and is no further
from float64 than the kernels on resident experts (bf16 intermediates) plus one rounding."""

from __future__ import annotations

import pytest
import torch

from kimik3.ops import mxfp4
from kimik3.ops.moe import fused_moe, fused_moe_mxfp4
from kimik3.ops.moe_host import decode, fused_moe_host_misses

BF16 = torch.bfloat16
E, L, I, R = 8, 64, 32, 13


def _packed(n, N, K, g):
    codes = torch.randint(0, 16, (n * N, K), generator=g, dtype=torch.uint8)
    scale = torch.randint(118, 126, (n * N, K // 32), generator=g, dtype=torch.uint8)
    return mxfp4.pack_codes(codes).view(n, N, K // 2), scale.view(n, N, K // 32)


@pytest.mark.parametrize("dtype", [torch.float32, BF16, torch.float64])
def test_decode_gives_dequantize_bits(dtype):
    g = torch.Generator().manual_seed(0)
    packed, scale = _packed(3, 16, 64, g)
    scale[1, 0, 0] = 0                                  # the smallest scale: subnormal values
    scale[2, 3, 1] = 254                                # the largest
    for e in range(3):
        assert torch.equal(decode((packed, scale), e, dtype), mxfp4.dequantize(packed[e], scale[e], dtype))


def _experts(packed: bool, g, poison: list[int], slots: torch.Tensor, dtype=BF16):
    """(host weights, pool weights) in fused_moe's formats; the pool holds the experts not in ``poison`` at their
    slots and NaN (dense) / codes 6.0 with scale 255 (MXFP4) everywhere else."""
    if packed:
        w13, w2 = _packed(E, 2 * I, L, g), _packed(E, L, I, g)
        pools = []
        for t in (*w13, *w2):
            pool = torch.full((R, *t.shape[1:]), 255 if t is w13[1] or t is w2[1] else 0x77, dtype=torch.uint8)
            keep = [e for e in range(E) if e not in poison]
            pool[slots[keep]] = t[keep]
            pools.append(pool)
        half = lambda w, h: (w[0][:, h * I:(h + 1) * I], w[1][:, h * I:(h + 1) * I])  # noqa: E731
        host = (half(w13, 0), w2, half(w13, 1))
        p13, p2 = (pools[0], pools[1]), (pools[2], pools[3])
        return host, (half(p13, 0), p2, half(p13, 1))
    w13 = (torch.randn(E, 2 * I, L, generator=g) * L ** -0.5).to(dtype)
    w2 = (torch.randn(E, L, I, generator=g) * I ** -0.5).to(dtype)
    pools = []
    for t in (w13, w2):
        pool = torch.full((R, *t.shape[1:]), float("nan"), dtype=dtype)
        keep = [e for e in range(E) if e not in poison]
        pool[slots[keep]] = t[keep]
        pools.append(pool)
    return (w13[:, :I], w2, w13[:, I:]), (pools[0][:, :I], pools[1], pools[0][:, I:])


def _float64(x, host, weights, ids, packed):
    """Straight from the math: y_t = sum_j w_tj SITU(x W1^T, x W3^T) W2^T in float64."""
    from kimik3.ops.activation import situ_and_mul
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            w1, w2, w3 = (decode(w, e, torch.float64) for w in host)
            xt = x[t:t + 1].double()
            out[t] += weights[t, j].double() * (situ_and_mul(xt @ w1.t(), xt @ w3.t(), 4.0, 25.0) @ w2.t())[0]
    return out


@pytest.mark.parametrize("missed", [[], [1, 4, 6], list(range(E))], ids=["none", "some", "all"])
@pytest.mark.parametrize("packed", [False, True], ids=["bf16", "mxfp4"])
def test_reference_equals_resident_bits(packed, missed):
    """The CPU path: the missed experts from the host tensors, the rest from the pool; the resident reference's
    bits (float32 activations, as the CPU engine runs)."""
    g = torch.Generator().manual_seed(5 + len(missed))
    slots = torch.randperm(R, generator=g)[:E]
    host, pool = _experts(packed, g, missed, slots, torch.float32)
    T, k = 7, 3
    x = torch.randn(T, L, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    mask = torch.zeros(E, dtype=torch.bool)
    mask[missed] = True
    run = fused_moe_mxfp4 if packed else fused_moe
    want = run(x, *host, weights, ids, "situ", 4.0, 25.0, True)
    got = fused_moe_host_misses(x, pool, host, weights, ids, mask, "situ", 4.0, 25.0, True, slots)
    assert torch.equal(got, want)
    assert not got.isnan().any()


@pytest.mark.parametrize("missed", [[], [1, 4, 6], list(range(E))], ids=["none", "some", "all"])
@pytest.mark.parametrize("packed", [False, True], ids=["bf16", "mxfp4"])
def test_kernel_path_agrees_with_float64(packed, missed, kernel_options):
    pytest.importorskip("triton")
    kernel_options(cpu_kernels=True)
    g = torch.Generator().manual_seed(11 + len(missed))
    slots = torch.randperm(R, generator=g)[:E]
    host, pool = _experts(packed, g, missed, slots)
    T, k = 5, 3
    x = torch.randn(T, L, generator=g).to(BF16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    mask = torch.zeros(E, dtype=torch.bool)
    mask[missed] = True
    got = fused_moe_host_misses(x, pool, host, weights, ids, mask, "situ", 4.0, 25.0, True, slots)
    assert got.dtype == BF16 and not got.isnan().any()
    resident = (fused_moe_mxfp4 if packed else fused_moe)(x, *host, weights, ids, "situ", 4.0, 25.0, True)
    if not missed:
        assert torch.equal(got, resident)
    # against float64: no further off than the kernels' own bf16 intermediates (twice their error on the
    # resident experts) plus a bf16 rounding of the largest output (the host sum added to the kernels')
    want = _float64(x, host, weights, ids, packed)
    err, own = ((t.double() - want).abs().max().item() for t in (got, resident))
    assert err <= 2 * own + 2 ** -8 * want.abs().max().item(), (err, own)
