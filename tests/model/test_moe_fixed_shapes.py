"""Expert parallelism in fixed shapes (``MoE.local_pairs``, on inside ``moe.fixed_shape_experts``: what CUDA graphs
capture): each EP rank's share of the routed sum, every (token, slot) pair run with other ranks' pairs at weight 0,
against the same rank's share by its local pairs alone (``nonzero``: a host synchronisation) and, summed over the
ranks, against a float64 sum written from the whole layer's weights. One process: the share needs no collective."""

import dataclasses

import pytest
import torch

from kimik3.config import parse_config
from kimik3.distributed import ParallelContext
from kimik3.model.layers import GLUActivation
from kimik3.model.moe import build_moe, fixed_shape_experts, moe_blocks
from kimik3.testing import tiny_k3_config, tiny_kimi_linear_config


def _ranks(make, ep: int, top_k: int, dtype: torch.dtype):
    """The whole layer (random weights) and its e expert-parallel ranks' layers holding their slices."""
    text = dataclasses.replace(parse_config(make(), "tiny").text, num_experts_per_token=top_k)
    act = GLUActivation(text.hidden_act, text.situ_beta, text.situ_linear_beta)
    whole = build_moe(text, act).to(dtype)
    g = torch.Generator().manual_seed(ep)
    for p in whole.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    ranks = []
    for r in range(ep):
        moe = build_moe(text, act, ParallelContext(r, ep, None, ep)).to(dtype)
        first, n = moe.experts.first_expert, moe.experts.w13.shape[0]
        moe.experts.w13.data.copy_(whole.experts.w13[first:first + n])
        moe.experts.w2.data.copy_(whole.experts.w2[first:first + n])
        ranks.append(moe)
    return whole, ranks


def _routed_sum(whole, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """sum_j w_tj E_{ids_tj}(z_t) in float64, token by token and pair by pair from the whole layer's weights."""
    e, act = whole.experts, whole.act
    out = torch.zeros(z.shape, dtype=torch.float64)
    for t in range(z.shape[0]):
        x = z[t].double()
        for w, i in zip(weights[t].tolist(), ids[t].tolist()):
            if i < 0:
                continue
            h = act(x @ e.w1[i].double().t(), x @ e.w3[i].double().t())
            out[t] += w * (h @ e.w2[i].double().t())
    return out


def _routing(whole, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """z [T + 4, L] and the router's (weights, ids), then four hand-routed tokens: all on the last experts, all on
    the first, mixed, and a padding row (ids -1, weights 0: the all-gather exchange's)."""
    g = torch.Generator().manual_seed(seed)
    dtype = whole.gate.weight.dtype
    x = torch.randn(T + 4, whole.cfg.hidden_size, generator=g, dtype=torch.float64).to(dtype)
    weights, ids = whole.route(x)
    E, k = whole.cfg.num_experts, ids.shape[1]
    ids[T] = torch.arange(E - k, E)
    ids[T + 1] = torch.arange(k)
    ids[T + 2] = torch.arange(k) * (E // k)
    ids[T + 3], weights[T + 3] = -1, 0.0
    return whole.to_latent(x).detach(), weights, ids


@pytest.mark.parametrize("make", [tiny_k3_config, tiny_kimi_linear_config], ids=["k3-latent", "kimi-linear"])
@pytest.mark.parametrize("ep,top_k", [(2, 2), (4, 4), (8, 2)])
@torch.inference_mode()
def test_fixed_shape_share_is_the_local_pairs_share(make, ep, top_k, monkeypatch):
    whole, ranks = _ranks(make, ep, top_k, torch.float64)
    z, weights, ids = _routing(whole, 5, seed=ep)
    want = _routed_sum(whole, z, weights, ids)
    shares = [moe.local_experts(z, weights, ids) for moe in ranks]          # local pairs alone (nonzero)

    def no_sync(*args, **kwargs):
        raise AssertionError("a data-dependent shape (nonzero) in the fixed-shape path")
    monkeypatch.setattr(torch.Tensor, "nonzero", no_sync)
    total = torch.zeros_like(want)
    for moe, share in zip(ranks, shares):
        with fixed_shape_experts(moe_blocks(moe)):
            fixed = moe.local_experts(z, weights, ids)
        assert not moe.fixed_shapes                             # restored on leaving
        torch.testing.assert_close(fixed, share, rtol=1e-12, atol=1e-12)
        total += fixed
    torch.testing.assert_close(total, want, rtol=1e-12, atol=1e-12)
    # every rank's share adds up to the whole layer's routed sum (one process, no expert parallelism)
    torch.testing.assert_close(whole.local_experts(z[:-1], weights[:-1], ids[:-1]), want[:-1], rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("ep", [2, 4])
def test_other_ranks_pairs_read_no_other_expert(ep):
    """Each pair on another rank's expert: weight exactly 0, its expert one the step's local pairs read anyway (its
    token's smallest local one, else the step's smallest); a step with no local pair points them at local expert 0."""
    whole, ranks = _ranks(tiny_k3_config, ep, 2, torch.float32)
    _, weights, ids = _routing(whole, 6, seed=3)
    for moe in ranks:
        first, n = moe.experts.first_expert, moe.experts.w13.shape[0]
        mine = (ids >= first) & (ids < first + n)
        w, local = moe.local_pairs(weights, ids)
        assert local.shape == ids.shape and w.shape == weights.shape and w.dtype == weights.dtype
        assert torch.equal(w, torch.where(mine, weights, 0.0)) and torch.equal(local[mine], ids[mine] - first)
        used = set((ids[mine] - first).tolist())
        for t in range(ids.shape[0]):
            own = sorted(i - first for i, m in zip(ids[t].tolist(), mine[t].tolist()) if m)
            fill = own[0] if own else min(used, default=0)
            assert local[t][~mine[t]].tolist() == [fill] * int((~mine[t]).sum()), (t, own, local[t])
        other = (first + n) % whole.cfg.num_experts                 # another rank's expert
        one = torch.tensor([[first + n - 1, other], [other, other]])        # token 1 takes token 0's local expert
        assert moe.local_pairs(weights[:2], one)[1].tolist() == [[n - 1, n - 1], [n - 1, n - 1]]
        w, local = moe.local_pairs(weights[:2], torch.full_like(one, other))   # no local pair
        assert not w.any() and not local.any()
