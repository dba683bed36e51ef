"""Small building blocks shared by the blocks: RMSNorm and the GLU MLP."""

from __future__ import annotations

import torch
from torch import nn

from kimik3.ops.activation import silu_and_mul, situ_and_mul
from kimik3.ops.norm import rms_norm


def linear(in_features: int, out_features: int) -> nn.Linear:
    """Every projection in Kimi models is bias-free."""
    return nn.Linear(in_features, out_features, bias=False)


class Embedding(nn.Module):
    """Token embedding [vocab, D] (no random init: weights always come from a checkpoint)."""

    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class GLUActivation:
    """SITU (beta, linear_beta) or SiLU gating of a GLU MLP, from ``hidden_act``."""

    def __init__(self, hidden_act: str, beta: float, linear_beta: float | None):
        self.hidden_act, self.beta, self.linear_beta = hidden_act, beta, linear_beta

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.hidden_act == "situ":
            return situ_and_mul(gate, up, self.beta, self.linear_beta)
        return silu_and_mul(gate, up)


class MLP(nn.Module):
    """y = act(x W_gate^T, x W_up^T) W_down^T (dense layer-0 MLP and the shared experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: GLUActivation):
        super().__init__()
        self.gate_proj = linear(hidden_size, intermediate_size)
        self.up_proj = linear(hidden_size, intermediate_size)
        self.down_proj = linear(intermediate_size, hidden_size)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))
