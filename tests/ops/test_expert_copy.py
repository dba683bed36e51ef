"""Expert-offload ops on CPU (Triton through TRITON_INTERPRET=1, tests/ops/conftest.py): the staging copy
(reference and kernel) moves exactly the used experts' rows, and the expert kernels reading a pool of rows
through ``slots`` give the bits of the experts stacked in id order, on every path (one token, blocks,
library grouped GEMMs, dense and MXFP4)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kimik3.ops import mxfp4                                            # noqa: E402
from kimik3.ops.expert_copy import byte_rows, copy_experts             # noqa: E402

BF16 = torch.bfloat16


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("row_bytes", [48, 7], ids=["int32-words", "bytes"])
@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "triton"])
def test_copy_experts_moves_only_the_used_experts(row_bytes, kernel):
    g = gen(row_bytes)
    E, R = 6, 9
    src = torch.randint(0, 256, (E, row_bytes), generator=g, dtype=torch.uint8)
    dst = torch.randint(0, 256, (R, row_bytes), generator=g, dtype=torch.uint8)
    before = dst.clone()
    experts = torch.tensor([5, 1, 3, 0])           # staging rows hold experts 5, 1, 3, 0 ...
    rows = torch.tensor([2, 7, 8, 4])              # ... at these pool rows
    used = torch.zeros(E, dtype=torch.bool)
    used[[1, 0, 2]] = True                         # 2 is cached elsewhere: not in ``experts``
    s, d = byte_rows(src), byte_rows(dst)
    assert s.dtype == (torch.int32 if row_bytes % 4 == 0 else torch.uint8)
    if kernel:
        from kimik3.ops.triton.expert_copy import copy_experts_triton
        copy_experts_triton(s, d, experts, rows, used)
    else:
        copy_experts(s, d, experts, rows, used)
    want = before.clone()
    want[7], want[4] = src[1], src[0]
    assert torch.equal(dst, want)


def _pool(stacked: torch.Tensor, slots: torch.Tensor, rows: int, fill) -> torch.Tensor:
    pool = torch.full((rows, *stacked.shape[1:]), fill, dtype=stacked.dtype)
    pool[slots] = stacked
    return pool


def _packed(E, N, K, g):
    codes = torch.randint(0, 16, (E * N, K), generator=g, dtype=torch.uint8)
    scale = torch.randint(120, 124, (E * N, K // 32), generator=g, dtype=torch.uint8)
    return mxfp4.pack_codes(codes).view(E, N, K // 2), scale.view(E, N, K // 32)


@pytest.mark.parametrize("T", [1, 5, 40], ids=["one-token", "blocks", "grouped"])
@pytest.mark.parametrize("packed", [False, True], ids=["bf16", "mxfp4"])
def test_moe_kernels_through_slots_equal_stacked_experts(T, packed, monkeypatch, kernel_options):
    from kimik3.ops.triton import moe as kernels
    if T == 40:                                     # the library paths (prefill) at a small size
        kernel_options(grouped_mm_rows_per_expert=4, mxfp4_grouped_mm_rows_per_expert=4)
        monkeypatch.setattr(kernels, "_gate_up_kernel", None)            # must not run
    g = gen(7 + T)
    E, L, I, k, R = 8, 64, 32, 3, 13
    slots = torch.randperm(R, generator=g)[:E]
    x = torch.randn(T, L, generator=g).to(BF16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    if packed:
        w13 = _packed(E, 2 * I, L, g)
        w2 = _packed(E, L, I, g)
        p13 = tuple(_pool(t, slots, R, 255 if i else 0) for i, t in enumerate(w13))   # scale 255 = NaN elsewhere
        p2 = tuple(_pool(t, slots, R, 255 if i else 0) for i, t in enumerate(w2))
        half = lambda w, h: (w[0][:, h * I:(h + 1) * I], w[1][:, h * I:(h + 1) * I])  # noqa: E731
        stacked = (half(w13, 0), w2, half(w13, 1))
        pooled = (half(p13, 0), p2, half(p13, 1))
    else:
        w13 = (torch.randn(E, 2 * I, L, generator=g) * L ** -0.5).to(BF16)
        w2 = (torch.randn(E, L, I, generator=g) * I ** -0.5).to(BF16)
        p13, p2 = _pool(w13, slots, R, float("nan")), _pool(w2, slots, R, float("nan"))
        stacked = (w13[:, :I], w2, w13[:, I:])
        pooled = (p13[:, :I], p2, p13[:, I:])
    want = kernels.fused_moe_triton(x, *stacked, weights, ids, True, 4.0, 25.0)
    got = kernels.fused_moe_triton(x, *pooled, weights, ids, True, 4.0, 25.0, slots=slots)
    assert not want.isnan().any()
    assert torch.equal(got, want)


@pytest.mark.parametrize("T", [3, 12], ids=["decode", "prefill"])
def test_fp8_moe_kernels_through_slots_equal_stacked_experts(T, kernel_options):
    """FP8 experts (E4M3 codes, float32 channel scales) in a pool whose other rows are poisoned (NaN scales): the
    kernels with ``slots`` equal them stacked in id order, bit for bit, at decode (weights widened) and prefill
    (activations quantised per 128 columns) sizes: what offloaded FP8 experts run."""
    from kimik3.ops.moe import fp8_act_group
    from kimik3.ops.triton import moe as kernels
    from tests.ops.test_moe_fp8 import fp8_experts, ragged_ids
    g = torch.Generator().manual_seed(11 + T)
    E, L, I, k, R = 6, 128, 64, 2, 9
    if T > 3:
        kernel_options(fp8_experts_quant_rows_per_expert=T * k // E)
    slots = torch.randperm(R, generator=g)[:E]
    _, q13 = fp8_experts(E, 2 * I, L, g)
    _, q2 = fp8_experts(E, L, I, g)
    p13 = (_pool(q13[0], slots, R, 0.0), _pool(q13[1], slots, R, float("nan")))
    p2 = (_pool(q2[0], slots, R, 0.0), _pool(q2[1], slots, R, float("nan")))
    half = lambda w, h: (w[0][:, h * I:(h + 1) * I], w[1][:, h * I:(h + 1) * I])  # noqa: E731
    x = torch.randn(T, L, generator=g).to(torch.float16)
    ids = ragged_ids(T, E, k, g)
    weights = torch.rand(T, k, generator=g)
    group = fp8_act_group(ids, E)
    assert group == (128 if T > 3 else None)
    want = kernels.fused_moe_triton(x, half(q13, 0), q2, half(q13, 1), weights, ids, True, 4.0, 25.0, act_group=group)
    got = kernels.fused_moe_triton(x, half(p13, 0), p2, half(p13, 1), weights, ids, True, 4.0, 25.0, act_group=group,
                                   slots=slots)
    assert not want.isnan().any()
    assert torch.equal(got, want)
