"""MoE routing (spec text-backbone §3.1-3.4): scores, bias-corrected grouped top-k, weights."""

from __future__ import annotations

import torch

from kimik3.ops.backend import use_fast_path


def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, activation: str,
          num_expert_group: int, topk_group: int, renormalize: bool, scaling_factor: float,
          renorm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (fp32 or wider) -> (weights [T, top_k] in logits' dtype, ids [T, top_k] int64).

    The correction bias only changes which experts are chosen; weights use the unbiased scores.
    CUDA (fp32 logits, up to 4096 experts): one Triton kernel per token row.
    """
    if use_fast_path(logits) and logits.dtype == torch.float32 and logits.shape[1] <= 4096:
        from kimik3.ops.triton.router import route_triton
        return route_triton(logits, bias, top_k, activation, num_expert_group, topk_group, renormalize,
                            scaling_factor, renorm_eps)
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
