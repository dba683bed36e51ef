"""Routed-expert storage: packed MXFP4 placement and the largest scale code the kernels rely on."""

from __future__ import annotations

import pytest
import torch

from kimik3.model.moe import Experts
from kimik3.ops import mxfp4


def _packed_pair(n: int, k: int, scale_code: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scale = torch.full((n, k // mxfp4.GROUP), scale_code, dtype=torch.uint8)
    scale[0, 0] = scale_code - 3
    return packed, scale


def test_scale_max_tracks_the_largest_loaded_scale_code():
    experts = Experts(num_experts=2, width=64, intermediate=32)
    experts.use_mxfp4_storage()
    assert experts.scale_max is None                       # unknown: kernels assume any scale
    experts.load_expert_mxfp4(0, "w1", *_packed_pair(32, 64, 120, 0), name="e0.w1")
    assert experts.scale_max == 120
    experts.load_expert_mxfp4(1, "w2", *_packed_pair(64, 32, 131, 1), name="e1.w2")
    assert experts.scale_max == 131
    experts.load_expert_mxfp4(1, "w3", *_packed_pair(32, 64, 100, 2), name="e1.w3")
    assert experts.scale_max == 131
    packed, scale = _packed_pair(32, 64, 120, 0)
    assert torch.equal(experts.w1[0], packed) and torch.equal(experts.w1_scale[0], scale)


def test_dense_weights_quantized_on_load_also_track_scale_max():
    experts = Experts(num_experts=1, width=64, intermediate=32)
    experts.use_mxfp4_storage()
    w = torch.randn(32, 64) * 2.0 ** -6
    experts.load_expert(0, "w1", w, name="e0.w1")
    _, scale = mxfp4.quantize(w)
    assert experts.scale_max == int(scale.max())


def test_nan_scale_is_rejected_and_not_recorded():
    experts = Experts(num_experts=1, width=64, intermediate=32)
    experts.use_mxfp4_storage()
    packed, scale = _packed_pair(32, 64, 120, 0)
    scale[3, 1] = 255
    with pytest.raises(ValueError, match="e0.w1: weight_scale holds 255"):
        experts.load_expert_mxfp4(0, "w1", packed, scale, name="e0.w1")
    assert experts.scale_max is None


def test_stored_experts_compute_what_the_checkpoint_holds():
    """Experts placed from checkpoint pairs give, through ``fused_moe_mxfp4`` (the CPU reference path), the
    float64 experts of the checkpoint's own dequantization."""
    from kimik3.ops.moe import fused_moe_mxfp4
    E, L, I, k, T = 3, 64, 32, 2, 5
    experts = Experts(num_experts=E, width=L, intermediate=I)
    experts.use_mxfp4_storage()
    dense = {}
    for e in range(E):
        for which, (n, kk) in {"w1": (I, L), "w2": (L, I), "w3": (I, L)}.items():
            packed, scale = _packed_pair(n, kk, 124, 10 * e + int(which[1]))
            experts.load_expert_mxfp4(e, which, packed, scale, name=f"e{e}.{which}")
            dense[e, which] = mxfp4.dequantize(packed, scale, torch.float64)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, L, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g, dtype=torch.float64)
    out = fused_moe_mxfp4(x, experts.packed("w1"), experts.packed("w2"), experts.packed("w3"), weights, ids, "silu",
                          1.0, None, combine_fp32=True)
    want = torch.zeros(T, L, dtype=torch.float64)
    for t in range(T):
        for j, e in enumerate(ids[t].tolist()):
            gate, up = dense[e, "w1"] @ x[t], dense[e, "w3"] @ x[t]
            want[t] += weights[t, j] * (dense[e, "w2"] @ (torch.nn.functional.silu(gate) * up))
    assert torch.allclose(out, want, rtol=1e-12, atol=1e-12)


def test_fp8_storage_quantises_each_placed_expert_and_moves_with_its_scales():
    """FP8 storage: each placed matrix E4M3 with its rows' scales (amax / 448); ``to_fp8`` on dense experts gives
    the same bytes; an EPLB move (``slot_tensors``, row by row) carries codes and scales together."""
    from kimik3.ops import fp8
    g = torch.Generator().manual_seed(4)
    E, L, I = 3, 64, 32
    ws = {(e, w): torch.randn(*((I, L) if w != "w2" else (L, I)), generator=g) for e in range(E) for w in ("w1", "w2", "w3")}
    q, dense = Experts(E, L, I), Experts(E, L, I)
    q.use_fp8_storage()
    for (e, w), t in ws.items():
        q.load_expert(e, w, t, name=f"e{e}.{w}")
        dense.load_expert(e, w, t, name=f"e{e}.{w}")
    dense.to_fp8()
    for which in ("w13", "w2"):
        assert torch.equal(getattr(q, which).view(torch.uint8), getattr(dense, which).view(torch.uint8))
        assert torch.equal(getattr(q, f"{which}_scale"), getattr(dense, f"{which}_scale"))
    codes, scale = fp8.quantize_weight(ws[(2, "w3")], block=None)
    assert torch.equal(q.w3[2].view(torch.uint8), codes.view(torch.uint8)) and torch.equal(q.w3_scale[2], scale.view(-1))
    tensors = q.slot_tensors()
    assert len(tensors) == 4 and all(t.shape[0] == E for t in tensors)
    for t in tensors:                                        # move expert 2 into slot 0, as a local EPLB copy
        t[0].copy_(t[2])
    assert torch.equal(q.w3[0].view(torch.uint8), codes.view(torch.uint8)) and torch.equal(q.w3_scale[0], scale.view(-1))
    with pytest.raises(ValueError, match="to_fp8 takes dense experts"):
        q.to_fp8()
