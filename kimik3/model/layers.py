"""Small building blocks shared by the blocks: RMSNorm and the GLU MLP."""

from __future__ import annotations

import torch
from torch import nn

from kimik3.distributed import ParallelContext
from kimik3.ops.activation import glu_activation
from kimik3.ops.linear import linear as ops_linear
from kimik3.ops.linear import linear_glu
from kimik3.ops.norm import rms_norm


class Linear(nn.Linear):
    """A bias-free projection (every projection in Kimi models) through ``kimik3.ops.linear``. With FP8
    weights (``kimik3.loader.fp8``) ``weight`` holds E4M3 codes and the buffer ``weight_scale`` their scales."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.register_buffer("weight_scale", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops_linear(x, self.weight, weight_scale=self.weight_scale)


def linear(in_features: int, out_features: int) -> Linear:
    return Linear(in_features, out_features, bias=False)


class MergedWeight(nn.Module):
    """Checkpoint tensors of one module kept as one weight stacked along dim 0 ([sum of rows, *tail]),
    so a step reads it as one operand. The checkpoint keeps one tensor per part: ``parts`` maps each
    one's module name (beside this module) to its rows, in order; the model's loading and naming read
    them through ``part``."""

    def __init__(self, tail: tuple[int, ...], parts: dict[str, int]):
        super().__init__()
        self.parts = dict(parts)
        self.weight = nn.Parameter(torch.zeros(sum(self.parts.values()), *tail))

    def part(self, name: str) -> torch.Tensor:
        """The rows of part ``name`` (a view of ``weight``)."""
        start = 0
        for part, rows in self.parts.items():
            if part == name:
                return self.weight.data[start:start + rows]
            start += rows
        raise KeyError(f"{name} is not one of {list(self.parts)}")


class MergedLinear(MergedWeight):
    """Bias-free projections of one input as one weight [sum of outs, in], so a step reads the input
    once and launches one GEMM (vLLM's merged column-parallel linears)."""

    def __init__(self, in_features: int, parts: dict[str, int]):
        super().__init__((in_features,), parts)
        self.register_buffer("weight_scale", None)              # FP8 weights: their scales (as ``Linear``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., sum of outs]: the projections side by side, in ``parts`` order."""
        return ops_linear(x, self.weight, weight_scale=self.weight_scale)


def tp_shards(par: ParallelContext, **dims: int) -> dict[str, tuple[int, int, int]]:
    """The loader's slicing rule for a module's TP-split parameters: name -> (dim, rank, size);
    empty in a single process. Parameter names use '__' for '.' (``q_proj__weight``)."""
    if not par.enabled:
        return {}
    return {name.replace("__", "."): (dim, par.tp_rank, par.tp_size) for name, dim in dims.items()}


class Embedding(nn.Module):
    """Token embedding [vocab, D] (no random init: weights always come from a checkpoint).

    Vocab-parallel under TP: rank r holds rows [r V/t, (r+1) V/t), looks up the ids in its range,
    zeros elsewhere, and an all-reduce completes the rows (bit-exact: one non-zero term each)."""

    def __init__(self, num_embeddings: int, dim: int, parallel: ParallelContext | None = None):
        super().__init__()
        self.par = par = parallel or ParallelContext()
        self.vocab_start, rows = par.split(num_embeddings, "vocab size") if par.enabled else (0, num_embeddings)
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.tp_shards = tp_shards(par, weight=0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.par.enabled:
            return torch.nn.functional.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = torch.nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.par.all_reduce(h.masked_fill(outside.unsqueeze(-1), 0))


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
        self._fn = glu_activation(hidden_act, beta, linear_beta)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self._fn(gate, up)


class MLP(nn.Module):
    """y = act(x W_gate^T, x W_up^T) W_down^T (dense layer-0 MLP and the shared experts).

    Under TP: gate/up column-parallel, down row-parallel over the intermediate; ``reduce=False``
    returns the rank's partial (the shared experts' partial joins the MoE tail's reduction)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: GLUActivation,
                 parallel: ParallelContext | None = None, reduce: bool = True):
        super().__init__()
        self.par = par = parallel or ParallelContext()
        _, inter = par.split(intermediate_size, "MLP intermediate size") if par.enabled else (0, intermediate_size)
        self.gate_up_proj = MergedLinear(hidden_size, {"gate_proj": inter, "up_proj": inter})
        self.down_proj = linear(inter, hidden_size)
        self.act = act
        self.reduce = reduce
        self.tp_shards = tp_shards(par, gate_proj__weight=0, up_proj__weight=0, down_proj__weight=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.act
        y = self.down_proj(linear_glu(x, self.gate_up_proj.weight, a.hidden_act, a.beta, a.linear_beta,
                                      self.gate_up_proj.weight_scale))
        return self.par.all_reduce(y) if self.reduce else y
