"""MoE routing (spec text-backbone §3.1-3.4): scores, bias-corrected grouped top-k, weights."""

from __future__ import annotations

import torch


def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, activation: str,
          num_expert_group: int, topk_group: int, renormalize: bool, scaling_factor: float,
          renorm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (fp32 or wider) -> (weights [T, top_k] in logits' dtype, ids [T, top_k] int64).

    The correction bias only changes which experts are chosen; weights use the unbiased scores.
    """
    scores = torch.sigmoid(logits) if activation == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if bias is None else scores + bias.to(scores.dtype)
    T, E = choice.shape
    if num_expert_group > 1 and num_expert_group > topk_group:
        grouped = choice.view(T, num_expert_group, E // num_expert_group)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)                 # [T, G]
        keep = group_score.topk(topk_group, dim=-1).indices
        mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(T, E)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize and top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + renorm_eps)
    return weights * scaling_factor, ids
