"""MoE routing (spec text-backbone §3.1-3.4): logits, scores, bias-corrected grouped top-k, weights."""

from __future__ import annotations

import torch

from kimik3.ops.backend import use_fast_path
from kimik3.ops.norm import acc_dtype

# The router logits run as our Triton kernels on CUDA (bf16/fp16 x; the gate weight in x's dtype, as the
# checkpoints store it, or fp32).
# 16-bit weight: the SIMT kernel up to ROUTER_LOGITS_SIMT_MAX_LOGITS logits (tokens x experts), then the
# tensor-core GEMM kernel (exact 16-bit products). The SIMT kernel's time grows with T x E x D, the GEMM
# kernel's at decode sizes with D alone (a latency-bound walk over the width), so they cross at a fixed
# T x E. H200 (bench_router_align.py, bf16 weight, 2d76027): SIMT 4.4 / 6.2 / 10.3 us against the GEMM's
# 5.4 at 8 / 16 / 32 tokens x 256 experts (D 2304); 9.7 / 14.0 against 13.8 at 32 / 64 x 64 (D 7168);
# 5.4 / 19.1 against 13.9 at 1 / 8 x 896 (D 7168). Both replace the cast of x and of the weight to fp32
# and cuBLAS's fp32 GEMM (8.7-24.9 us at one token, 19-83 at 8-16: every checkpoint's path before).
ROUTER_LOGITS_SIMT_MAX_LOGITS = 4096
# fp32 weight: the SIMT kernel up to this many tokens (ROUTER_LOGITS_MAX_TOKENS_LARGE for weights over 2**20
# elements); beyond, cuBLAS's fp32 GEMM on the upcast x, and from ROUTER_LOGITS_GEMM_MIN_LOGITS logits
# (prefill chunks) the tensor-core kernel with TF32 x3 products. H200 (6e3384c): Kimi-Linear's 256 x 2304
# weight 2.0x / 1.2x faster than the cast + GEMM at 32 / 64 tokens, 1.05x at 128; K3 release's 896 x 7168
# 2.3x at 16 tokens but 0.66x at 32; the TF32 x3 kernel 167 / 450 us against 262 / 570 us at (8192
# tokens, 256 experts) / (2048, 896), slower below (123 against 87 us at (2048, 256)).
ROUTER_LOGITS_MAX_TOKENS = 64
# ``route_tokens`` with a 16-bit weight from ROUTER_SPLIT_MIN_TOKENS to ROUTER_SPLIT_MAX_TOKENS tokens: split-K
# partial logits (``triton/router.py: router_logit_partials``) that the routing kernel sums, in place of the
# SIMT kernel (4.4-8.0 us at 8-16 tokens x 64-256 experts, 19-25 at 896) or the unsplit GEMM (13.8 / 5.4 us at
# D = 7168 / 2304, a latency-bound walk over the width). The bounds sit just past / at powers of two, so a step and
# the CUDA graph it is padded to (``cuda_graphs.graph_batch_sizes``: 1, 2, 4, 8, ...) take the same path and
# the same bits (an eager step of 5-7 tokens and its 8-row graph both split; otherwise a greedy token could
# differ between the two at an expert near-tie: seen on the H100 at 7f26387).
ROUTER_SPLIT_MIN_TOKENS = 5
ROUTER_SPLIT_MAX_TOKENS = 256
ROUTER_LOGITS_MAX_TOKENS_LARGE = 16
ROUTER_LOGITS_GEMM_MIN_LOGITS = 1 << 20


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, D] @ weight [E, D]^T with both operands upcast to ``acc_dtype(x.dtype)`` (fp32 logits
    for bf16/fp16/fp32 x, fp64 for fp64; spec §3.1). CUDA (bf16/fp16 x, weight fp32 or x's dtype):
    Triton kernels that read both in their own dtypes, fp32 accumulation (error at fp32's level):
    a SIMT kernel for few logits, a tensor-core GEMM for more (exact 16-bit products, or TF32 x3 for
    an fp32 weight); the thresholds above."""
    if (use_fast_path(x) and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype in (torch.float32, x.dtype)
            and x.dim() == 2):
        T, E = x.shape[0], weight.shape[0]
        wide = weight.dtype == torch.float32
        if wide:
            simt = T <= (ROUTER_LOGITS_MAX_TOKENS if weight.numel() <= 1 << 20 else ROUTER_LOGITS_MAX_TOKENS_LARGE)
        else:
            simt = T * E <= ROUTER_LOGITS_SIMT_MAX_LOGITS
        if simt:
            from kimik3.ops.triton.router import router_logits_triton
            return router_logits_triton(x, weight)
        if (not wide or T * E >= ROUTER_LOGITS_GEMM_MIN_LOGITS) and x.stride(1) == 1 and weight.stride(1) == 1:
            from kimik3.ops.triton.router import router_logits_gemm_triton
            return router_logits_gemm_triton(x, weight)
    acc = acc_dtype(x.dtype)
    return x.to(acc) @ weight.to(acc).t()


def splits_logits(num_tokens: int) -> bool:
    """Whether ``route_tokens`` takes split-K logits for a step of this many tokens (on the fast path)."""
    return ROUTER_SPLIT_MIN_TOKENS <= num_tokens <= ROUTER_SPLIT_MAX_TOKENS


def route_tokens(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, activation: str,
                 num_expert_group: int, topk_group: int, renormalize: bool, scaling_factor: float,
                 renorm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``route(router_logits(x, weight), ...)``: the MoE layer's routing of x [T, D] by the gate weight
    [E, D]. CUDA, decode-sized steps (``ROUTER_SPLIT_MIN_TOKENS``..``ROUTER_SPLIT_MAX_TOKENS`` tokens, a weight
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
