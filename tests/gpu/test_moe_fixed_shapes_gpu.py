"""Expert parallelism inside a CUDA graph on one card: an EP rank's share of the routed sum in fixed shapes
(``MoE.local_pairs`` inside ``moe.fixed_shape_experts``: every (token, slot) pair, other ranks' pairs at weight 0)
captured by ``cuda_graphs.capture_graph`` (the share by local pairs alone, ``nonzero``, syncs with the host and cannot
be captured), replayed over new routings copied into its fixed inputs, against the same rank's share run eagerly by
its local pairs and against a float64 sum from the layer's weights. Dense bf16, MXFP4 and FP8 experts (the Triton
kernels; one token takes the one-token paths). Rank 0 of EP2 and rank 1 of EP4: no collective runs, so one card
holds the check; the whole draft under EP (``tests/gpu/test_draft_tp_multi_gpu.py``) needs several.

    pytest -q -m gpu tests/gpu/test_moe_fixed_shapes_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from kimik3.distributed import ParallelContext
from kimik3.model.cuda_graphs import capture_graph
from kimik3.model.layers import GLUActivation
from kimik3.model.moe import MoE, MoEConfig, fixed_shape_experts, moe_blocks
from kimik3.ops import mxfp4
from tests.helpers import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CFG = MoEConfig(hidden_size=256, num_experts=64, top_k=4, intermediate_size=128, num_shared_experts=0,
                latent_size=None, latent_norm=False, rms_norm_eps=1e-6, router_activation="sigmoid",
                num_expert_group=1, topk_group=1, renormalize=True, routed_scaling_factor=2.5,
                router_renorm_eps=1e-20, combine_fp32=True)
ACT = GLUActivation("silu", 1.0, None)


def rank_layer(ep: int, rank: int, storage: str, device: str) -> tuple[MoE, list[torch.Tensor]]:
    """EP rank ``rank``'s layer (bf16) holding its slice of random experts stored as ``storage``; the float64
    weights it computes with ([w1, w2, w3] of its local experts, MXFP4 / FP8 dequantized)."""
    moe = MoE(CFG, ACT, ParallelContext(rank, ep, None, ep))
    n, I, L = moe.experts.w1.shape
    g = torch.Generator().manual_seed(10 * ep + rank)
    dense = {"w1": torch.randn(n, I, L, generator=g) / L ** 0.5, "w3": torch.randn(n, I, L, generator=g) / L ** 0.5,
             "w2": torch.randn(n, L, I, generator=g) / I ** 0.5}
    if storage == "mxfp4":
        moe.experts.use_mxfp4_storage()
    moe.to(device)
    if storage != "mxfp4":
        moe.to(torch.bfloat16)
    for which, w in dense.items():
        for j in range(n):
            moe.experts.load_expert(moe.experts.first_expert + j, which, w[j].to(device, torch.bfloat16), which)
    if storage == "fp8":
        moe.experts.to_fp8()
    return moe, [_dequantized(moe, which) for which in ("w1", "w2", "w3")]


def _dequantized(moe: MoE, which: str) -> torch.Tensor:
    e = moe.experts
    if e.mxfp4:
        packed, scale = e.packed(which)
        return torch.stack([mxfp4.dequantize(packed[j].cpu(), scale[j].cpu(), torch.float64, name=which)
                            for j in range(packed.shape[0])])
    if e.fp8:
        codes, scale = e.packed(which)
        return codes.double().cpu() * scale.double().cpu().unsqueeze(-1)
    return getattr(e, which).double().cpu()


def routing(T: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """z [T, L] bf16, fp32 weights and distinct expert ids [T, k] over all E experts (every rank's)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(T, CFG.hidden_size, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(CFG.num_experts, generator=g)[:CFG.top_k] for _ in range(T)])
    weights = torch.rand(T, CFG.top_k, generator=g)
    return z.to(device), weights.to(device), ids.to(device)


def local_sum(moe: MoE, w: list[torch.Tensor], z, weights, ids) -> torch.Tensor:
    """The rank's share in float64, pair by pair: its local experts' pairs only."""
    first, n = moe.experts.first_expert, w[0].shape[0]
    out = torch.zeros(z.shape, dtype=torch.float64)
    for t in range(z.shape[0]):
        x = z[t].double().cpu()
        for wt, i in zip(weights[t].tolist(), ids[t].tolist()):
            if first <= i < first + n:
                h = moe.act(x @ w[0][i - first].t(), x @ w[2][i - first].t())
                out[t] += wt * (h @ w[1][i - first].t())
    return out


@pytest.mark.parametrize("storage", ["bf16", "mxfp4", "fp8"])
@pytest.mark.parametrize("ep,rank", [(2, 0), (4, 1)])
@pytest.mark.parametrize("T", [1, 5, 32])
@torch.inference_mode()
def test_fixed_shape_share_captures_and_replays(storage, ep, rank, T):
    moe, w = rank_layer(ep, rank, storage, "cuda")
    z, weights, ids = routing(T, 0, "cuda")

    def share():
        with fixed_shape_experts(moe_blocks(moe)):
            return moe.local_experts(z, weights, ids)
    graph, out = capture_graph(share)
    for seed in (1, 2, 3):
        new = routing(T, seed, "cuda")
        for buf, src in zip((z, weights, ids), new):
            buf.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        eager = moe.local_experts(z, weights, ids)          # local pairs alone (nonzero, outside a graph)
        ref = local_sum(moe, w, z, weights, ids)
        if not ref.any():                                   # no pair on this rank's experts
            assert not out.any() and not eager.any(), seed
            continue
        assert rel_err(out.cpu(), ref) <= 1e-2, (seed, rel_err(out.cpu(), ref))
        assert rel_err(out, eager) <= 1e-2, (seed, rel_err(out, eager))
