"""Attention residuals (spec text-backbone §2.3): a softmax mix over block sources.

For sources v_i [T, D] (i < n), score s_i = w . RMSNorm(v_i; gamma) (weightless norm with eps,
then gamma * w folded), alpha = softmax_i(s), mix = sum_i alpha_i v_i of the raw sources, all in
fp32 (or wider). One source gives that source exactly.
"""

from __future__ import annotations

import torch

from kimik3.ops.backend import use_fast_path
from kimik3.ops.norm import acc_dtype, rms_norm, rms_norm_fp32_weight


def attn_res_mix(sources: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """sources: n tensors [T, D]; norm_weight [D]; proj_weight [1, D] or [D]. Returns fp32 [T, D].
    CUDA: one Triton pass (online softmax over the sources)."""
    acc = acc_dtype(sources[0].dtype)
    if len(sources) == 1:
        return sources[0].to(acc)
    if use_fast_path(sources[0]) and acc == torch.float32:
        from kimik3.ops.triton.attn_res import MAX_SOURCES, attn_res_mix_triton
        if len(sources) <= MAX_SOURCES:        # one pass over the sources, no stacking copy
            return attn_res_mix_triton([s.contiguous() for s in sources], norm_weight, proj_weight, eps)
    v = torch.stack([s.to(acc) for s in sources])                           # [n, T, D]
    w = norm_weight.to(acc) * proj_weight.reshape(-1).to(acc)               # [D]
    r = torch.rsqrt(v.pow(2).mean(-1) + eps)                                 # [n, T]
    alpha = torch.softmax(r * (v @ w), dim=0)                                # [n, T]
    return (alpha.unsqueeze(-1) * v).sum(0)


def attn_res_mix_norm(sources: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor,
                      eps: float, consumer_weight: torch.Tensor, fp32_weight: bool, dtype: torch.dtype) -> torch.Tensor:
    """The sub-layer input: ``attn_res_mix`` normed by its consumer's RMSNorm (same eps) in ``dtype``,
    ``rms_norm_fp32_weight`` (fp32_weight: vLLM's fused form, one rounding) or ``rms_norm`` with the mix
    rounded to ``dtype`` first (official). One source: its norm (the fp32 mix of one bf16 source is that
    source exactly). CUDA: one Triton pass (the mix's epilogue holds the norm)."""
    if (len(sources) > 1 and use_fast_path(sources[0]) and acc_dtype(sources[0].dtype) == torch.float32
            and dtype != torch.float64):
        from kimik3.ops.triton.attn_res import FP32_WEIGHT_NORM, KIMI_NORM, MAX_SOURCES, attn_res_mix_triton
        if len(sources) <= MAX_SOURCES:        # (the kernel folds gamma * proj: no cast or product launches)
            return attn_res_mix_triton([s.contiguous() for s in sources], norm_weight, proj_weight, eps,
                                       FP32_WEIGHT_NORM if fp32_weight else KIMI_NORM, consumer_weight, eps, dtype)
    mix = sources[0] if len(sources) == 1 else attn_res_mix(sources, norm_weight, proj_weight, eps)
    norm = rms_norm_fp32_weight if fp32_weight else rms_norm
    return norm(mix, consumer_weight, eps, dtype)
