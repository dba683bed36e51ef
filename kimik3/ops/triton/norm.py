"""RMSNorm in one pass per row block (reference: ``kimik3.ops.norm``): the torch forms launch 7-9
elementwise and reduce kernels each (casts, square, mean, rsqrt, products), a third of the kernels
of a decode step. Three forms, chosen at compile time:

- ``KIMI``: statistics in fp32, the normalised row rounded to x's dtype, then times the weight
  rounded to x's dtype, one more rounding (Kimi's RMSNorm);
- ``FP32_WEIGHT``: x * rstd * w in fp32, one rounding to the output dtype;
- ``GATED``: as ``FP32_WEIGHT`` times sigmoid(gate) (KDA's output norm).

The row count is not specialised on, so every batch size runs one compiled kernel per (form, D,
dtypes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KIMI, FP32_WEIGHT, GATED = 0, 1, 2


@triton.jit(do_not_specialize=["R", "sx", "sg"])
def _rms_norm_kernel(x, w, g, y, R, D, sx, sg, eps, FORM: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    mask = (rows[:, None] < R) & (cols[None, :] < D)
    v = tl.load(x + rows[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
    wv = tl.load(w + cols, mask=cols < D, other=0.0)
    if FORM == 0:
        n = (v * rstd[:, None]).to(x.dtype.element_ty).to(tl.float32)
        out = n * wv.to(x.dtype.element_ty).to(tl.float32)
    else:
        out = v * rstd[:, None] * wv.to(tl.float32)
        if FORM == 2:
            gv = tl.load(g + rows[:, None] * sg + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            out = out * tl.sigmoid(gv)
    tl.store(y + rows[:, None] * D + cols[None, :], out.to(y.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., D] as a 2-D [R, D] view with unit feature stride (a copy only where none exists)."""
    flat = t.reshape(-1, t.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, form: int, out_dtype: torch.dtype,
                    gate: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D] (fp32/bf16/fp16), weight [D], gate like x (``GATED`` only) -> [..., D] in ``out_dtype``."""
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"rms_norm_triton: weight shape {tuple(weight.shape)} does not match rows of {D}")
    rows = _rows(x)
    gates = _rows(gate) if form == GATED else rows
    if form == GATED and gates.shape != rows.shape:
        raise ValueError(f"rms_norm_triton: gate shape {tuple(gate.shape)} does not match x {tuple(x.shape)}")
    R = rows.shape[0]
    y = torch.empty(R, D, dtype=out_dtype, device=x.device)
    BD = triton.next_power_of_2(D)
    BR = max(1, min(64, 2048 // BD))
    if R:
        _rms_norm_kernel[(triton.cdiv(R, BR),)](rows, weight.contiguous(), gates, y, R, D, rows.stride(0),
                                               gates.stride(0), float(eps), FORM=form, BR=BR, BD=BD,
                                               num_warps=8 if BD >= 4096 else 4)
    return y.view(x.shape)
