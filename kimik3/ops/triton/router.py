"""MoE routing in one kernel: scores (sigmoid or softmax), bias-corrected grouped top-k,
unbiased weights, renormalisation and scaling (spec text-backbone §3.2-3.4). One program per
token; the top-k is k rounds of argmax over the (masked) expert row, so ids come out in
descending order of the biased score, as ``torch.topk`` gives them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, E, stride_t, per_group, scaling, eps,
                  HAS_BIAS: tl.constexpr, SIGMOID: tl.constexpr, RENORM: tl.constexpr,
                  TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr,
                  TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    x = tl.load(logits_ptr + t * stride_t + offs, mask=valid, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = tl.sigmoid(x)
    else:
        e = tl.exp(x - tl.max(x, axis=0))
        scores = e / tl.sum(e, axis=0)
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if GROUPS > 1:
        # group score = sum of its two best biased scores; keep the TOPK_GROUP best groups
        group = offs // per_group
        goffs = tl.arange(0, BLOCK_G)
        gscore = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for g in tl.static_range(GROUPS):
            in_g = group == g
            row = tl.where(in_g, choice, float("-inf"))
            first = tl.argmax(row, axis=0)
            best = tl.max(row, axis=0)
            second = tl.max(tl.where(offs == first, float("-inf"), row), axis=0)
            gscore = tl.where(goffs == g, best + second, gscore)
        keep = offs < 0
        for _ in tl.static_range(TOPK_GROUP):
            gi = tl.argmax(gscore, axis=0)
            keep = keep | (group == gi)
            gscore = tl.where(goffs == gi, float("-inf"), gscore)
        choice = tl.where(keep, choice, float("-inf"))
    koffs = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int64)
    for i in tl.static_range(TOP_K):
        j = tl.argmax(choice, axis=0)
        w = tl.where(koffs == i, tl.sum(tl.where(offs == j, scores, 0.0), axis=0), w)
        ids = tl.where(koffs == i, j.to(tl.int64), ids)
        choice = tl.where(offs == j, float("-inf"), choice)
    if RENORM:
        w = w / (tl.sum(w, axis=0) + eps)
    w = w * scaling
    kmask = koffs < TOP_K
    tl.store(weights_ptr + t * TOP_K + koffs, w, mask=kmask)
    tl.store(ids_ptr + t * TOP_K + koffs, ids, mask=kmask)


def route_triton(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, activation: str,
                 num_expert_group: int, topk_group: int, renormalize: bool, scaling_factor: float,
                 renorm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``kimik3.ops.router.route`` for fp32 logits [T, E]."""
    T, E = logits.shape
    logits = logits.contiguous()
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    grouped = num_expert_group > 1 and num_expert_group > topk_group
    groups = num_expert_group if grouped else 1
    if T:
        _route_kernel[(T,)](
            logits, bias if bias is not None else logits, weights, ids, E, logits.stride(0), E // groups,
            float(scaling_factor), float(renorm_eps),
            HAS_BIAS=bias is not None, SIGMOID=activation == "sigmoid", RENORM=renormalize and top_k > 1,
            TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), GROUPS=groups, TOPK_GROUP=topk_group,
            BLOCK_G=triton.next_power_of_2(groups), BLOCK_E=triton.next_power_of_2(E))
    return weights, ids
