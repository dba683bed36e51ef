"""GLU activations: SITU (Kimi-K3) and SiLU (Kimi-Linear). Spec text-backbone §4."""

from __future__ import annotations

import torch

from kimik3.ops.backend import use_fast_kernel
from kimik3.ops.norm import acc_dtype


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """[beta * tanh(g / beta) * sigmoid(g)] * [linear_beta * tanh(u / linear_beta)], in fp32,
    cast back to the input dtype. ``linear_beta`` None leaves the up branch unclipped. CUDA: one
    Triton kernel (tanh as 2 sigmoid(2x) - 1, as the expert kernels compute it)."""
    if use_fast_kernel(gate) and up.dtype == gate.dtype:
        from kimik3.ops.triton.activation import glu_triton
        return glu_triton(gate, up, True, beta, linear_beta)
    acc = acc_dtype(gate.dtype)
    g, u = gate.to(acc), up.to(acc)
    gated = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    clipped = u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)
    return (gated * clipped).to(gate.dtype)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, cast back to the input dtype. CUDA: one Triton kernel."""
    if use_fast_kernel(gate) and up.dtype == gate.dtype:
        from kimik3.ops.triton.activation import glu_triton
        return glu_triton(gate, up, False)
    acc = acc_dtype(gate.dtype)
    return (torch.nn.functional.silu(gate.to(acc)) * up.to(acc)).to(gate.dtype)


def glu_activation(hidden_act: str, beta: float, linear_beta: float | None):
    """The GLU gating ``act(gate, up)`` named by ``hidden_act``: "situ" (beta, linear_beta) or "silu"."""
    if hidden_act == "situ":
        return lambda gate, up: situ_and_mul(gate, up, beta, linear_beta)
    if hidden_act == "silu":
        return silu_and_mul
    raise ValueError(f"hidden_act must be 'situ' or 'silu', got {hidden_act!r}")
