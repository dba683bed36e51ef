"""MoE routing (spec text-backbone §3.1-3.4): logits, scores, bias-corrected grouped top-k, weights."""

from __future__ import annotations

import torch

from kimik3.ops.backend import use_fast_path
from kimik3.ops.norm import acc_dtype
from kimik3.ops.options import tuning

# The router logits run as our Triton kernels on CUDA (bf16/fp16 x; the gate weight in x's dtype, as the
# checkpoints store it, or fp32); the thresholds and their measurements: ``options.KernelTuning`` (router_*).


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, D] @ weight [E, D]^T with both operands upcast to ``acc_dtype(x.dtype)`` (fp32 logits
    for bf16/fp16/fp32 x, fp64 for fp64; spec §3.1). CUDA (bf16/fp16 x, weight fp32 or x's dtype):
    Triton kernels that read both in their own dtypes, fp32 accumulation (error at fp32's level):
    a SIMT kernel for few logits, a tensor-core GEMM for more (exact 16-bit products, or TF32 x3 for
    an fp32 weight); the thresholds: ``KernelTuning``."""
    if (use_fast_path(x) and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype in (torch.float32, x.dtype)
            and x.dim() == 2):
        T, E = x.shape[0], weight.shape[0]
        wide = weight.dtype == torch.float32
        tune = tuning()
        if wide:
            simt = T <= (tune.router_logits_max_tokens if weight.numel() <= 1 << 20
                         else tune.router_logits_max_tokens_large)
        else:
            simt = T * E <= tune.router_logits_simt_max_logits
        if simt:
            from kimik3.ops.triton.router import router_logits_triton
            return router_logits_triton(x, weight)
        if (not wide or T * E >= tune.router_logits_gemm_min_logits) and x.stride(1) == 1 and weight.stride(1) == 1:
            from kimik3.ops.triton.router import router_logits_gemm_triton
            return router_logits_gemm_triton(x, weight)
    acc = acc_dtype(x.dtype)
    return x.to(acc) @ weight.to(acc).t()


def splits_logits(num_tokens: int) -> bool:
    """Whether ``route_tokens`` takes split-K logits for a step of this many tokens (on the fast path)."""
    tune = tuning()
    return tune.router_split_min_tokens <= num_tokens <= tune.router_split_max_tokens


def route_tokens(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, activation: str,
                 num_expert_group: int, topk_group: int, renormalize: bool, scaling_factor: float,
                 renorm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``route(router_logits(x, weight), ...)``: the MoE layer's routing of x [T, D] by the gate weight
    [E, D]. CUDA, decode-sized steps (``router_split_min_tokens``..``router_split_max_tokens`` tokens, a weight
    of x's 16-bit dtype): split-K partial logits, summed by the routing kernel (two launches, the same fp32
    accuracy; the logits are never stored whole)."""
    T, E = x.shape[0], weight.shape[0]
    if (use_fast_path(x) and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and splits_logits(T) and E <= 4096 and x.stride(1) == 1 and weight.stride(1) == 1
            and weight.shape[1] == x.shape[1]):
        from kimik3.ops.triton.router import route_triton, router_logit_partials
        return route_triton(router_logit_partials(x, weight), bias, top_k, activation, num_expert_group, topk_group,
                            renormalize, scaling_factor, renorm_eps)
    return route(router_logits(x, weight), bias, top_k, activation, num_expert_group, topk_group, renormalize,
                 scaling_factor, renorm_eps)


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
