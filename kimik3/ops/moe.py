"""Routed experts (reference: a loop over the experts that received tokens)."""

from __future__ import annotations

from typing import Callable

import torch

from kimik3.ops.norm import acc_dtype


def fused_moe(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
              weights: torch.Tensor, ids: torch.Tensor,
              act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], combine_fp32: bool) -> torch.Tensor:
    """y_t = sum_j weights[t, j] * E_{ids[t, j]}(x_t), E_e(x) = act(x W1_e^T, x W3_e^T) W2_e^T.

    x [T, L]; w1, w3 [E, I, L]; w2 [E, L, I]; weights [T, k] fp32; ids [T, k].
    combine_fp32: each expert output (x's dtype) is scaled by its fp32 weight and summed in
    fp32, rounded once (official); else the sum is accumulated in x's dtype.
    """
    T, L = x.shape
    acc = acc_dtype(x.dtype) if combine_fp32 else x.dtype
    out = torch.zeros(T, L, dtype=acc, device=x.device)
    flat_ids = ids.reshape(-1)
    for e in torch.unique(flat_ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[tok]
        ye = act(xe @ w1[e].t(), xe @ w3[e].t()) @ w2[e].t()                 # [n, L] in x's dtype
        out.index_add_(0, tok, ye.to(acc) * weights[tok, slot].unsqueeze(-1).to(acc))
    return out.to(x.dtype)
