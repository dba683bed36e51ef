"""Mixture of experts (spec text-backbone §3): fp32 router with bias-corrected grouped top-k,
routed experts (on a latent width for K3), shared experts on the original input."""

from __future__ import annotations

import torch
from torch import nn

from kimik3.config import TextConfig
from kimik3.model.layers import MLP, GLUActivation, RMSNorm, linear
from kimik3.ops.moe import fused_moe
from kimik3.ops.norm import acc_dtype
from kimik3.ops.router import route


class Router(nn.Module):
    """``gate.weight`` [E, D] and ``gate.e_score_correction_bias`` [E] (fp32 by default, D4)."""

    def __init__(self, hidden_size: int, num_experts: int, with_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        if with_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        acc = acc_dtype(x.dtype)   # both operands upcast: logits in fp32 (spec §3.1)
        return x.to(acc) @ self.weight.to(acc).t()


class Experts(nn.Module):
    """Routed experts stacked per projection: w1 (gate) and w3 (up) [E, I, L], w2 (down) [E, L, I].
    The checkpoint stores them one by one (``experts.{e}.w{1,2,3}``); ``load_expert`` places them."""

    def __init__(self, num_experts: int, width: int, intermediate: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(num_experts, intermediate, width))
        self.w2 = nn.Parameter(torch.zeros(num_experts, width, intermediate))
        self.w3 = nn.Parameter(torch.zeros(num_experts, intermediate, width))

    def load_expert(self, expert: int, which: str, tensor: torch.Tensor, name: str) -> None:
        target = getattr(self, which)
        if not 0 <= expert < target.shape[0]:
            raise ValueError(f"{name}: expert {expert} out of range (model has {target.shape[0]} experts)")
        if tuple(tensor.shape) != tuple(target.shape[1:]):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(target.shape[1:])}")
        target.data[expert].copy_(tensor)


class MoE(nn.Module):
    def __init__(self, cfg: TextConfig, act: GLUActivation):
        super().__init__()
        D = cfg.hidden_size
        width = cfg.routed_expert_hidden_size or D
        self.cfg = cfg
        self.act = act
        self.gate = Router(D, cfg.num_experts, with_bias=True)
        self.experts = Experts(cfg.num_experts, width, cfg.moe_intermediate_size)
        if cfg.routed_expert_hidden_size is not None:
            self.routed_expert_down_proj = linear(D, width)
            self.routed_expert_up_proj = linear(width, D)
        if cfg.latent_moe_use_norm:
            self.routed_expert_norm = RMSNorm(width, cfg.rms_norm_eps)
        if cfg.num_shared_experts:
            self.shared_experts = MLP(D, cfg.moe_intermediate_size * cfg.num_shared_experts, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        weights, ids = route(self.gate.logits(x), self.gate.e_score_correction_bias, cfg.num_experts_per_token,
                             cfg.moe_router_activation_func, cfg.num_expert_group, cfg.topk_group,
                             cfg.moe_renormalize, cfg.routed_scaling_factor, cfg.numerics.router_renorm_eps)
        z = self.routed_expert_down_proj(x) if hasattr(self, "routed_expert_down_proj") else x
        u = fused_moe(z, self.experts.w1, self.experts.w2, self.experts.w3, weights, ids, self.act,
                      cfg.numerics.moe_combine_fp32)
        if hasattr(self, "routed_expert_norm"):
            u = self.routed_expert_norm(u)
        y = self.routed_expert_up_proj(u) if hasattr(self, "routed_expert_up_proj") else u
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(x)
        return y
