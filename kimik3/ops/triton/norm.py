"""RMSNorm in one pass per row block (reference: ``kimik3.ops.norm``): the torch forms launch 7-9
elementwise and reduce kernels each (casts, square, mean, rsqrt, products), a third of the kernels
of a decode step. Three forms, chosen at compile time:

- ``KIMI``: statistics in fp32, the normalised row rounded to the output dtype, then times the weight
  rounded to it, one more rounding (Kimi's RMSNorm; a wider x is rounded to the output dtype first);
- ``FP32_WEIGHT``: x * rstd * w in fp32, one rounding to the output dtype;
- ``GATED``: as ``FP32_WEIGHT`` times sigmoid(gate) (KDA's output norm).

Optionally the row is first the sum of x and a residual (rounded to x's dtype, and stored: the
residual stream's add fused into the norm that follows it), or of x and two residuals r1 + r2 (their sum
rounded first: a MoE layer's routed and shared outputs, added here rather than by a launch of their own). The row count is not specialised on, so every batch size runs one compiled kernel per (form, D,
dtypes).

``cache_latent_triton``: MLA's new cache rows in one launch: the ``KIMI`` norm of each token's latent
part, its rope part as it is, both stored at the token's cache slot (``kimik3.ops.mla.cache_latent``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimik3.ops.triton.common import pdl, pdl_entry

KIMI, FP32_WEIGHT, GATED = 0, 1, 2


@triton.jit
def _kimi_norm(v, wv, D, eps, dtype: tl.constexpr):
    """``KIMI`` of rows v [BR, BD] (fp32, zeros past D) with the weight wv [BD]: the row rounded to dtype
    (a no-op when it came in dtype), statistics in fp32, the normalised row rounded, times the weight
    rounded; fp32, rounded to dtype by the caller."""
    v = v.to(dtype).to(tl.float32)
    rstd = 1 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
    n = (v * rstd[:, None]).to(dtype).to(tl.float32)
    return n * wv.to(dtype).to(tl.float32)


@triton.jit(do_not_specialize=["R", "sx", "sg", "sr", "sr2"])
def _rms_norm_kernel(x, w, g, r, r2, s, y, R, D, sx, sg, sr, sr2, eps, FORM: tl.constexpr, HAS_RES: tl.constexpr,
                     HAS_RES2: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr):
    pdl_entry(PDL)
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    mask = (rows[:, None] < R) & (cols[None, :] < D)
    v = tl.load(x + rows[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:                         # the residual sum x + r, rounded to its dtype, is stored and normed
        res = tl.load(r + rows[:, None] * sr + cols[None, :], mask=mask, other=0.0)
        if HAS_RES2:                    # x + (r + r2), the inner sum rounded first
            r2v = tl.load(r2 + rows[:, None] * sr2 + cols[None, :], mask=mask, other=0.0)
            res = (res.to(tl.float32) + r2v.to(tl.float32)).to(s.dtype.element_ty)
        v = (v + res.to(tl.float32))
        v = v.to(s.dtype.element_ty)
        tl.store(s + rows[:, None] * D + cols[None, :], v, mask=mask)
        v = v.to(tl.float32)
    wv = tl.load(w + cols, mask=cols < D, other=0.0)
    if FORM == 0:
        out = _kimi_norm(v, wv, D, eps, y.dtype.element_ty)
    else:
        rstd = 1 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
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
                    gate: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                    residual2: torch.Tensor | None = None):
    """x [..., D] (fp32/bf16/fp16), weight [D], gate like x (``GATED`` only) -> [..., D] in ``out_dtype``
    (``KIMI`` with a wider x: the norm of x rounded to ``out_dtype``). With ``residual`` (like x, same
    dtype): the norm of s = x + residual rounded to x's dtype, returned as (s, y); with ``residual2`` too
    (like x): s = x + (residual + residual2), each sum rounded to x's dtype."""
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"rms_norm_triton: weight shape {tuple(weight.shape)} does not match rows of {D}")
    rows = _rows(x)
    gates = _rows(gate) if form == GATED else rows
    if form == GATED and gates.shape != rows.shape:
        raise ValueError(f"rms_norm_triton: gate shape {tuple(gate.shape)} does not match x {tuple(x.shape)}")
    if residual2 is not None and residual is None:
        raise ValueError("rms_norm_triton: residual2 needs residual")
    res = rows if residual is None else _rows(residual)
    res2 = res if residual2 is None else _rows(residual2)
    for name, t, flat in (("residual", residual, res), ("residual2", residual2, res2)):
        if t is not None and (flat.shape != rows.shape or t.dtype != x.dtype):
            raise ValueError(f"rms_norm_triton: {name} {t.dtype} {tuple(t.shape)} does not match "
                             f"x {x.dtype} {tuple(x.shape)}")
    R = rows.shape[0]
    y = torch.empty(R, D, dtype=out_dtype, device=x.device)
    s = torch.empty(R, D, dtype=x.dtype, device=x.device) if residual is not None else y
    BD = triton.next_power_of_2(D)
    BR = max(1, min(64, 2048 // BD))
    if R:
        _rms_norm_kernel[(triton.cdiv(R, BR),)](rows, weight.contiguous(), gates, res, res2, s, y, R, D, rows.stride(0),
                                               gates.stride(0), res.stride(0), res2.stride(0), float(eps), FORM=form,
                                               HAS_RES=residual is not None, HAS_RES2=residual2 is not None, BR=BR, BD=BD,
                                               num_warps=8 if BD >= 4096 else 4, **pdl(rows))
    if residual is not None:
        return s.view(x.shape), y.view(x.shape)
    return y.view(x.shape)


@triton.jit(do_not_specialize=["sx"])
def _cache_latent_kernel(x, w, slots, cache, cache_scale, D, P, sx, stride_row, eps, BD: tl.constexpr,
                         BP: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):
    """Token t: cache row slots[t] = [KIMI norm of x[t, :D] with w | x[t, D:D + P]]; FP8: that row in
    x's dtype divided by its scale amax / 448 (1 for a zero row), stored at cache_scale[slots[t]]."""
    pdl_entry(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    m = cols < D
    v = tl.load(x + t * sx + cols, mask=m, other=0.0).to(tl.float32)[None, :]
    out = _kimi_norm(v, tl.load(w + cols, mask=m, other=0.0), D, eps, x.dtype.element_ty)            # [1, BD]
    slot = tl.load(slots + t).to(tl.int64)
    row = cache + slot * stride_row
    pc = tl.arange(0, BP)
    pe = tl.load(x + t * sx + D + pc, mask=pc < P, other=0.0)
    if FP8:
        out = out.to(x.dtype.element_ty).to(tl.float32)
        pe = pe.to(tl.float32)
        amax = tl.maximum(tl.max(tl.max(tl.abs(out), 1), 0), tl.max(tl.abs(pe), 0))
        scale = tl.where(amax > 0, amax / 448.0, 1.0)
        tl.store(cache_scale + slot, scale)
        out = out / scale
        pe = pe / scale
    tl.store(row + cols[None, :], out.to(cache.dtype.element_ty), mask=m[None, :])
    tl.store(row + D + pc, pe.to(cache.dtype.element_ty), mask=pc < P)


def cache_latent_triton(c: torch.Tensor, weight: torch.Tensor, eps: float, cache: torch.Tensor,
                        slots: torch.Tensor, cache_scale: torch.Tensor | None = None) -> None:
    """c [T, D + P] (c's dtype = the cache's; unit feature stride), weight [D], cache [..., D + P] with
    contiguous rows, slots [T] (row indices of the flattened cache). ``cache_scale`` (contiguous float32, one
    per cache row): the cache is float8_e4m3fn, each row stored as codes with its scale."""
    T, C = c.shape
    D = weight.shape[0]
    fp8 = cache_scale is not None
    same = (cache.dtype == torch.float8_e4m3fn and cache_scale.dtype == torch.float32 and cache_scale.is_contiguous()
            and cache_scale.numel() * C == cache.numel()) if fp8 else c.dtype == cache.dtype
    if C <= D or cache.shape[-1] != C or not same or c.stride(-1) != 1 or slots.shape != (T,):
        raise ValueError(f"cache_latent_triton: c {c.dtype} {tuple(c.shape)}, weight {tuple(weight.shape)}, cache "
                         f"{cache.dtype} {tuple(cache.shape)} and slots {tuple(slots.shape)} do not match")
    rows = cache.view(-1, C)
    if T:
        _cache_latent_kernel[(T,)](c, weight.contiguous(), slots, rows, cache_scale if fp8 else rows, D, C - D,
                                   c.stride(0), rows.stride(0), float(eps), BD=triton.next_power_of_2(D),
                                   BP=triton.next_power_of_2(C - D), FP8=fp8, num_warps=4, **pdl(c))
