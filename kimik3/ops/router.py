"""MoE routing (spec text-backbone §3.1-3.4): logits, scores, bias-corrected grouped top-k, weights."""

from __future__ import annotations

import torch

from kimik3.ops.backend import use_fast_path
from kimik3.ops.norm import acc_dtype

# The router logits run as our Triton kernel on CUDA (bf16/fp16 x; the gate weight in x's dtype, as the
# checkpoint stores it, or fp32) up to this many tokens, and up to ROUTER_LOGITS_MAX_TOKENS_LARGE for
# weights over 2**20 elements. H200 (benchmarks/gpu/bench_router_align.py, fp32 weight): Kimi-Linear's
# 256 x 2304 weight 2.0x / 1.2x faster than the cast + GEMM at 32 / 64 tokens, 1.05x at 128; K3 release's
# 896 x 7168 2.3x at 16 tokens but 0.66x at 32 (the kernel's fp32 products, no tensor cores, outgrow the
# weight read there).
ROUTER_LOGITS_MAX_TOKENS = 64
ROUTER_LOGITS_MAX_TOKENS_LARGE = 16
# Past those, a tiled Triton GEMM on tensor cores at fp32 accuracy: for a 16-bit weight of x's dtype
# always (the 16-bit products are exact: nothing to round, and no fp32 copies of x and the weight,
# which the cast + SIMT fp32 GEMM wrote every step); for an fp32 weight (TF32 x3) from this many logits
# (tokens x experts: prefill chunks), where its 128 x 64 tiles fill the GPU. H200 at 6e3384c
# (bench_router_align.py): 167 / 450 us against 262 / 570 us for the cast + SIMT GEMM at (8192 tokens,
# 256 experts) / (2048, 896); it lost below (123 against 87 us at (2048, 256), 325 against 316 at
# (1024, 896)); at (8192, 64) it won by 1.08x (318 us).
ROUTER_LOGITS_GEMM_MIN_LOGITS = 1 << 20


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, D] @ weight [E, D]^T with both operands upcast to ``acc_dtype(x.dtype)`` (fp32 logits
    for bf16/fp16/fp32 x, fp64 for fp64; spec §3.1). CUDA (bf16/fp16 x, weight fp32 or x's dtype):
    up to ``ROUTER_LOGITS_MAX_TOKENS`` tokens one Triton kernel that reads both in their own dtypes;
    beyond, a tiled Triton GEMM on tensor cores (exact 16-bit products, or TF32 x3 for an fp32 weight
    from ``ROUTER_LOGITS_GEMM_MIN_LOGITS`` logits), fp32 accumulation: error at fp32's level."""
    if (use_fast_path(x) and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype in (torch.float32, x.dtype)
            and x.dim() == 2):
        if x.shape[0] <= (ROUTER_LOGITS_MAX_TOKENS if weight.numel() <= 1 << 20 else ROUTER_LOGITS_MAX_TOKENS_LARGE):
            from kimik3.ops.triton.router import router_logits_triton
            return router_logits_triton(x, weight)
        wide = weight.dtype == torch.float32
        if ((not wide or x.shape[0] * weight.shape[0] >= ROUTER_LOGITS_GEMM_MIN_LOGITS)
                and x.stride(1) == 1 and weight.stride(1) == 1):
            from kimik3.ops.triton.router import router_logits_gemm_triton
            return router_logits_gemm_triton(x, weight)
    acc = acc_dtype(x.dtype)
    return x.to(acc) @ weight.to(acc).t()


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
