"""The MoE block's variant is chosen once from the config: plain (experts on D) or latent (down/up
projections around the experts, the norm when asked), and the token-sharded exchange from the
parallel context. Each variant's output is checked against the spec's formula in float64."""

import dataclasses

import pytest
import torch

from kimik3.config import parse_config
from kimik3.distributed import ParallelContext
from kimik3.model.layers import GLUActivation
from kimik3.model.moe import LatentMoE, MoE, MoEConfig, build_moe
from kimik3.model.moe_exchange import AllToAllExchange, GatherScatterExchange, make_exchange
from kimik3.testing import tiny_k3_config, tiny_kimi_linear_config


def _text(make, **changes):
    return dataclasses.replace(parse_config(make(), "tiny").text, **changes)


def _filled(moe: MoE, seed: int) -> MoE:
    g = torch.Generator().manual_seed(seed)
    moe = moe.double()
    for p in moe.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    return moe


def _spec_output(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Spec §3.5-3.7 straight from the weights: y = [norm(sum_j w_j E_j(z))] W_up^T + y_shared."""
    weights, ids = moe.route(x)
    latent = isinstance(moe, LatentMoE)
    z = x @ moe.routed_expert_down_proj.weight.t() if latent else x
    act = moe.act
    u = torch.zeros_like(z)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            h = act(z[t] @ moe.experts.w1[e].t(), z[t] @ moe.experts.w3[e].t())
            u[t] += w * (h @ moe.experts.w2[e].t())
    if latent:
        if moe.routed_expert_norm is not None:
            eps = moe.cfg.rms_norm_eps
            u = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps) * moe.routed_expert_norm.weight
        u = u @ moe.routed_expert_up_proj.weight.t()
    if moe.shared_experts is not None:
        sx = moe.shared_experts.gate_up_proj.weight
        gate, up = (x @ sx.t()).chunk(2, dim=-1)
        u = u + act(gate, up) @ moe.shared_experts.down_proj.weight.t()
    return u


@pytest.mark.parametrize("make,latent,norm", [(tiny_kimi_linear_config, None, False), (tiny_k3_config, 32, True),
                                              (tiny_k3_config, 32, False)])
def test_variant_is_chosen_from_the_config_and_computes_the_spec(make, latent, norm):
    text = _text(make, routed_expert_hidden_size=latent, latent_moe_use_norm=norm)
    act = GLUActivation(text.hidden_act, text.situ_beta, text.situ_linear_beta)
    moe = _filled(build_moe(text, act), seed=1)
    assert type(moe) is (MoE if latent is None else LatentMoE)
    assert MoEConfig.from_text(text).variant == ("plain" if latent is None else "latent")
    assert hasattr(moe, "routed_expert_down_proj") == (latent is not None)
    assert (getattr(moe, "routed_expert_norm", None) is not None) == norm
    assert moe.exchange is None
    x = torch.randn(6, text.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(moe(x), _spec_output(moe, x), rtol=1e-10, atol=1e-10)


def test_exchange_is_chosen_from_the_parallel_mode():
    assert make_exchange(ParallelContext()) is None
    assert make_exchange(ParallelContext(tp_rank=0, tp_size=2, ep_size=2, moe_mode="tep")) is None
    assert type(make_exchange(ParallelContext(tp_rank=0, tp_size=2, ep_size=2, moe_mode="a2a"))) is AllToAllExchange
    assert type(make_exchange(ParallelContext(tp_rank=1, tp_size=2, ep_size=2, moe_mode="agrs"))) is GatherScatterExchange


def test_config_without_experts_has_no_moe_config():
    text = _text(tiny_kimi_linear_config, num_experts=None)
    with pytest.raises(ValueError, match="num_experts is None"):
        MoEConfig.from_text(text)
