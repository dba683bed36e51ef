"""GLU gating in one pass (reference: ``kimik3.ops.activation``): act(gate) * up over [R, I] in fp32,
one rounding, where torch launches 3 (SiLU) to 10 (SITU) elementwise kernels. gate and up may be
column slices of one merged projection (any row stride, unit column stride). The row count is not
specialised on: one compile per (activation, dtype)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimik3.ops.triton.common import glu, pdl, pdl_entry


@triton.jit(do_not_specialize=["R", "sg", "su"])
def _glu_kernel(g_ptr, u_ptr, y_ptr, R, I, sg, su, beta, linear_beta, SITU: tl.constexpr, CLIP_UP: tl.constexpr,
                BR: tl.constexpr, BI: tl.constexpr, PDL: tl.constexpr):
    pdl_entry(PDL)
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    mask = (rows[:, None] < R) & (cols[None, :] < I)
    g = tl.load(g_ptr + rows[:, None] * sg + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows[:, None] * su + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = glu(g, u, beta, linear_beta, SITU, CLIP_UP)
    tl.store(y_ptr + rows[:, None] * I + cols[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)


def glu_triton(gate: torch.Tensor, up: torch.Tensor, situ: bool, beta: float = 1.0,
               linear_beta: float | None = None) -> torch.Tensor:
    """gate, up [..., I] (bf16/fp16/fp32, unit column stride) -> act(gate) * up, contiguous, gate's dtype."""
    if gate.shape != up.shape:
        raise ValueError(f"glu_triton: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    I = gate.shape[-1]
    g, u = (t.reshape(-1, I) for t in (gate, up))
    g, u = (t if t.stride(-1) == 1 else t.contiguous() for t in (g, u))
    R = g.shape[0]
    y = torch.empty(R, I, dtype=gate.dtype, device=gate.device)
    BI = min(1024, triton.next_power_of_2(I))
    BR = max(1, 2048 // BI)
    if R:
        _glu_kernel[(triton.cdiv(R, BR), triton.cdiv(I, BI))](
            g, u, y, R, I, g.stride(0), u.stride(0), float(beta), float(linear_beta or 1.0),
            SITU=situ, CLIP_UP=situ and linear_beta is not None, BR=BR, BI=BI, num_warps=4, **pdl(g))
    return y.view(gate.shape)
