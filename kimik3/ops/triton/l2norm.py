"""Row L2 normalisation for KDA's q and k before fla's chunk kernels: y = x / sqrt(sum(x^2) + eps),
computed in fp32 and stored in x's dtype (as fla's ``l2norm_fwd``). One fixed config, and the row
count is not specialised on, so every prefill size runs the one compiled kernel: fla's own
``l2norm_fwd`` autotunes 25 configs per bucket of 65,536 rows (each 683 tokens at 96 heads), which
put a 10 s autotune into served requests whenever a step's size reached a new bucket."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimik3.ops.triton.common import pdl, pdl_entry


@triton.jit(do_not_specialize=["R"])
def _l2norm_kernel(x, y, R, eps, D: tl.constexpr, BR: tl.constexpr, PDL: tl.constexpr):
    pdl_entry(PDL)
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    offs = rows[:, None] * D + tl.arange(0, D)[None, :]
    mask = rows[:, None] < R
    v = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
    r = 1 / tl.sqrt(tl.sum(v * v, axis=1) + eps)           # as fla computes it
    tl.store(y + offs, (v * r[:, None]).to(y.dtype.element_ty), mask=mask)


def l2norm_triton(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x [..., D] (D a power of two, at most 1024) -> the rows L2-normalised, x's shape and dtype."""
    D = x.shape[-1]
    if D & (D - 1) or not 1 <= D <= 1024:
        raise ValueError(f"l2norm_triton: the row size must be a power of two up to 1024, got {D}")
    rows = x.contiguous().view(-1, D)
    y = torch.empty_like(rows)
    BR = max(1, 4096 // D)
    if rows.shape[0]:
        _l2norm_kernel[(triton.cdiv(rows.shape[0], BR),)](rows, y, rows.shape[0], eps, D=D, BR=BR, num_warps=4,
                                                          **pdl(rows))
    return y.view(x.shape)
