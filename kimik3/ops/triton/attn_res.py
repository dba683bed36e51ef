"""Attention-residual mix in one pass over the sources: per token row, each source is read once,
scored (w . RMSNorm(v)) and folded into an online softmax-weighted sum. Reference:
``kimik3.ops.attn_res.attn_res_mix``. Optionally the consumer's RMSNorm of the mix in the epilogue
(``attn_res_mix_norm``): the fp32 mix never goes to memory.

The sources are separate tensors; the kernel gets the first one's pointer and each source's
element offset from it (same dtype, same row stride), so the list needs no stacking copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimik3.ops.triton.common import pdl, pdl_entry

MAX_SOURCES = 12


NO_NORM, KIMI_NORM, FP32_WEIGHT_NORM = 0, 1, 2


@triton.jit(do_not_specialize=["o1", "o2", "o3", "o4", "o5", "o6", "o7", "o8", "o9", "o10", "o11"])
def _attn_res_kernel(src, o1, o2, o3, o4, o5, o6, o7, o8, o9, o10, o11, g, p, cw, out, D, stride_row, eps, norm_eps,
                     N_SRC: tl.constexpr, BD: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    pdl_entry(PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    md = d < D
    # the score weight w = gamma * proj in fp32 (exact for 16-bit factors), folded here: no per-step casts
    wv = tl.load(g + d, mask=md, other=0.0).to(tl.float32) * tl.load(p + d, mask=md, other=0.0).to(tl.float32)
    m = float("-inf")
    denom = 0.0
    acc = tl.zeros([BD], dtype=tl.float32)
    for i in tl.static_range(N_SRC):
        off = 0
        if i == 1:
            off = o1
        elif i == 2:
            off = o2
        elif i == 3:
            off = o3
        elif i == 4:
            off = o4
        elif i == 5:
            off = o5
        elif i == 6:
            off = o6
        elif i == 7:
            off = o7
        elif i == 8:
            off = o8
        elif i == 9:
            off = o9
        elif i == 10:
            off = o10
        elif i == 11:
            off = o11
        v = tl.load(src + off + t * stride_row + d, mask=md, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(v * v, 0) / D + eps)
        s = r * tl.sum(v * wv, 0)
        m_new = tl.maximum(m, s)
        scale_old = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        acc = acc * scale_old + p * v
        denom = denom * scale_old + p
        m = m_new
    mix = acc / denom
    if NORM == 0:
        tl.store(out + t * D + d, mix, mask=md)
    else:   # the consumer's RMSNorm of the fp32 mix (``kimik3.ops.norm``'s forms), in the output dtype
        cv = tl.load(cw + d, mask=md, other=0.0)
        if NORM == 1:                       # rms_norm(mix, w, eps, dtype): the mix rounded first, two roundings
            v = mix.to(out.dtype.element_ty).to(tl.float32)
            rstd = 1 / tl.sqrt(tl.sum(v * v, 0) / D + norm_eps)
            y = (v * rstd).to(out.dtype.element_ty).to(tl.float32) * cv.to(out.dtype.element_ty).to(tl.float32)
        else:                               # rms_norm_fp32_weight(mix, w, eps, dtype): one rounding
            rstd = 1 / tl.sqrt(tl.sum(mix * mix, 0) / D + norm_eps)
            y = mix * rstd * cv.to(tl.float32)
        tl.store(out + t * D + d, y.to(out.dtype.element_ty), mask=md)


def attn_res_mix_triton(sources: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor, eps: float,
                        norm: int = NO_NORM, consumer_weight: torch.Tensor | None = None, norm_eps: float = 0.0,
                        out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """sources: 2..MAX_SOURCES tensors [T, D] of one dtype with unit feature stride and one row
    stride; norm_weight [D] and proj_weight [1, D] or [D] (fp32 or 16-bit; the kernel folds
    w = norm_weight * proj_weight in fp32). Returns the fp32 mix [T, D], or with ``norm``
    (KIMI_NORM / FP32_WEIGHT_NORM) its RMSNorm by ``consumer_weight`` [D] (eps ``norm_eps``) in ``out_dtype``."""
    first = sources[0]
    T, D = first.shape
    size = first.element_size()
    offsets = []
    for s in sources:
        if s.dtype != first.dtype or s.shape != first.shape or s.stride() != first.stride() or s.stride(1) != 1:
            raise ValueError("attn_res_mix_triton: sources must share dtype, shape and strides (unit feature stride)")
        delta = s.data_ptr() - first.data_ptr()
        if delta % size:
            raise ValueError("attn_res_mix_triton: sources are not element-aligned with each other")
        offsets.append(delta // size)
    offsets = offsets[1:] + [0] * (MAX_SOURCES - len(offsets))
    if norm != NO_NORM and (consumer_weight is None or consumer_weight.shape != (D,)):
        raise ValueError(f"attn_res_mix_triton: a fused norm needs a consumer weight of [{D}]")
    gamma, proj = norm_weight.contiguous(), proj_weight.reshape(-1).contiguous()
    if gamma.shape != (D,) or proj.shape != (D,):
        raise ValueError(f"attn_res_mix_triton: norm weight {tuple(norm_weight.shape)} and proj weight "
                         f"{tuple(proj_weight.shape)} do not hold {D} values each")
    out = torch.empty(T, D, dtype=torch.float32 if norm == NO_NORM else out_dtype, device=first.device)
    BD = triton.next_power_of_2(D)
    cw = gamma if consumer_weight is None else consumer_weight.contiguous()
    _attn_res_kernel[(T,)](first, *offsets, gamma, proj, cw, out, D, first.stride(0), float(eps), float(norm_eps),
                           N_SRC=len(sources), BD=BD, NORM=norm, num_warps=8 if BD >= 4096 else 4, **pdl(first))
    return out
