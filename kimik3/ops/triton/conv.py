"""Causal depthwise conv + SiLU over packed varlen tokens, history read from (and the new window
written to) the conv-state pool by slot. Reference: ``kimik3.ops.conv.causal_conv1d``.

Pool row layout [C, W-1], oldest first: the column for position tau < start of a sequence is
(W-1) + (tau - start).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimik3.ops.triton.common import pdl, pdl_entry


@triton.jit
def _history(x, pool, tau, start, slot, has, c, mc, stride_x, stride_pool_slot, stride_pool_c, W: tl.constexpr):
    """The raw input the conv sees at position tau of the sequence starting at ``start``: x's row when
    tau >= start, else the pool window's column (zero for a fresh sequence: has == 0), as fp32 [BC]."""
    tv = tl.zeros_like(c) + tau                 # vector masks (the interpreter takes no scalar-vector mixes)
    col = (W - 1) + (tv - start)
    xv = tl.load(x + tv.to(tl.int64) * stride_x + c, mask=mc & (tv >= start), other=0.0)
    hv = tl.load(pool + slot * stride_pool_slot + c.to(tl.int64) * stride_pool_c + col,
                 mask=mc & (tv < start) & (col >= 0) & (tl.zeros_like(c) + has != 0), other=0.0)
    return xv.to(tl.float32) + hv.to(tl.float32)


@triton.jit
def _conv_fwd_kernel(x, weight, pool, slots, has_state, cu_seqlens, tok_seq, y,
                     T, C, G, stride_x, stride_pool_slot, stride_pool_c,
                     W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr):
    """A run of BT tokens x BC channels, token by token: each input row is loaded once (one coalesced
    vector, the next one already in flight) and the W-1 previous inputs ride along in registers, so a
    token costs one load, W FMAs, the SiLU and one store per channel. At a sequence's first token the
    registers are refilled from its pool window (zeros when fresh). W <= 4: taps past the kernel size are left out."""
    pdl_entry(PDL)
    pid_t, pid_c = tl.program_id(0), tl.program_id(1)
    c = pid_c * BC + tl.arange(0, BC)
    mc = c < C
    t0 = pid_t * BT
    n = tl.minimum(BT, T - t0)
    # taps, oldest first: w0 * x[t-3] + w1 * x[t-2] + w2 * x[t-1] + w3 * x[t]
    w3 = tl.load(weight + c * W + (W - 1), mask=mc, other=0.0).to(tl.float32)
    w2 = tl.zeros([BC], dtype=tl.float32)
    w1 = tl.zeros([BC], dtype=tl.float32)
    w0 = tl.zeros([BC], dtype=tl.float32)
    if W >= 2:
        w2 = tl.load(weight + c * W + (W - 2), mask=mc, other=0.0).to(tl.float32)
    if W >= 3:
        w1 = tl.load(weight + c * W + (W - 3), mask=mc, other=0.0).to(tl.float32)
    if W >= 4:
        w0 = tl.load(weight + c * W + (W - 4), mask=mc, other=0.0).to(tl.float32)
    seq = tl.load(tok_seq + t0)
    start = tl.load(cu_seqlens + seq)
    end = tl.load(cu_seqlens + seq + 1)
    slot = tl.load(slots + seq).to(tl.int64)
    has = tl.load(has_state + seq)
    h1 = _history(x, pool, t0 - 1, start, slot, has, c, mc, stride_x, stride_pool_slot, stride_pool_c, W)
    h2 = _history(x, pool, t0 - 2, start, slot, has, c, mc, stride_x, stride_pool_slot, stride_pool_c, W)
    h3 = _history(x, pool, t0 - 3, start, slot, has, c, mc, stride_x, stride_pool_slot, stride_pool_c, W)
    # channel c of token t at [c // G, t, c % G]: G = C is the plain [T, C] layout
    dst = y + (c // G).to(tl.int64) * T * G + (c % G) + t0.to(tl.int64) * G
    src = x + t0.to(tl.int64) * stride_x + c
    nxt = tl.load(src, mask=mc, other=0.0)
    for i in range(n):
        t = t0 + i
        cur = nxt.to(tl.float32)
        nxt = tl.load(src + stride_x, mask=mc & (tl.zeros_like(c) + i + 1 < n), other=0.0)   # the next row
        if t == end:                                                        # a sequence starts here
            seq = tl.load(tok_seq + t)
            end = tl.load(cu_seqlens + seq + 1)
            slot = tl.load(slots + seq).to(tl.int64)
            has = tl.load(has_state + seq)
            h1 = _history(x, pool, t - 1, t, slot, has, c, mc, stride_x, stride_pool_slot, stride_pool_c, W)
            h2 = _history(x, pool, t - 2, t, slot, has, c, mc, stride_x, stride_pool_slot, stride_pool_c, W)
            h3 = _history(x, pool, t - 3, t, slot, has, c, mc, stride_x, stride_pool_slot, stride_pool_c, W)
        acc = w3 * cur                                  # taps past the kernel size never enter (0 * inf)
        if W >= 2:
            acc += w2 * h1
        if W >= 3:
            acc += w1 * h2
        if W >= 4:
            acc += w0 * h3
        tl.store(dst, (acc * tl.sigmoid(acc)).to(y.dtype.element_ty), mask=mc)
        h3, h2, h1 = h2, h1, cur
        src += stride_x
        dst += G


@triton.jit
def _conv_state_kernel(x, pool, slots, has_state, cu_seqlens, C, stride_x, stride_pool_slot, stride_pool_c,
                       W: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr):
    """pool[slot] <- last W-1 entries of [old window | this sequence's raw inputs]."""
    pdl_entry(PDL)
    n, pid_c = tl.program_id(0), tl.program_id(1)
    c = pid_c * BC + tl.arange(0, BC)
    mc = c < C
    start = tl.load(cu_seqlens + n)
    q = tl.load(cu_seqlens + n + 1) - start
    slot = tl.load(slots + n).to(tl.int64)
    has = tl.load(has_state + n) != 0
    cols = tl.arange(0, WP)
    i = q + cols                                  # index in [old window (W-1) | new inputs (q)]
    from_x = i >= W - 1
    mcol = cols < W - 1
    row = pool + slot * stride_pool_slot + c[:, None].to(tl.int64) * stride_pool_c
    xv = tl.load(x + (start + i[None, :] - (W - 1)).to(tl.int64) * stride_x + c[:, None],
                 mask=mc[:, None] & (mcol & from_x)[None, :], other=0.0)
    hv = tl.load(row + i[None, :], mask=mc[:, None] & (mcol & ~from_x)[None, :], other=0.0).to(tl.float32)
    vals = tl.where(from_x[None, :], xv.to(tl.float32), tl.where(has, hv, 0.0))
    tl.debug_barrier()                            # every old column is read before any is overwritten
    tl.store(row + cols[None, :], vals.to(pool.dtype.element_ty), mask=mc[:, None] & mcol[None, :])


@triton.jit
def _conv_decode_kernel(x, weight, pool, slots, y, N, C, G, stride_x, stride_pool_slot, stride_pool_c,
                        W: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr):
    """One token per sequence, every one with history: y = silu(window . w[:, :W-1] + x w[:, W-1])
    and the window shifted by one (x appended), its row read once and written once."""
    pdl_entry(PDL)
    n, pid_c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    c = pid_c * BC + tl.arange(0, BC)
    cols = tl.arange(0, WP)
    mc = c < C
    m = mc[:, None] & (cols < W - 1)[None, :]
    row = pool + tl.load(slots + n).to(tl.int64) * stride_pool_slot + c[:, None].to(tl.int64) * stride_pool_c
    win = tl.load(row + cols[None, :], mask=m, other=0.0)                      # [BC, WP], oldest first
    xv = tl.load(x + n * stride_x + c, mask=mc, other=0.0)
    taps = tl.load(weight + c[:, None] * W + cols[None, :], mask=m, other=0.0).to(tl.float32)
    acc = tl.sum(win.to(tl.float32) * taps, 1) + xv.to(tl.float32) * tl.load(weight + c * W + W - 1, mask=mc,
                                                                              other=0.0).to(tl.float32)
    out = acc * tl.sigmoid(acc)
    tl.store(y + (c // G).to(tl.int64) * N * G + n * G + (c % G), out.to(y.dtype.element_ty), mask=mc)
    later = tl.load(row + cols[None, :] + 1, mask=mc[:, None] & (cols < W - 2)[None, :], other=0.0)
    shifted = tl.where((cols == W - 2)[None, :], xv.to(pool.dtype.element_ty)[:, None], later)
    tl.debug_barrier()                            # every old column is read before any is overwritten
    tl.store(row + cols[None, :], shifted, mask=m)


# (tokens, channels, warps) of a prefill program; benchmarks/gpu/bench_decode_ops.py sweeps others
PREFILL_TILE = (64, 128, 1)
MAX_WIDTH = 4           # the prefill kernel's taps ride in registers: kernel sizes up to 4 (Kimi's is 4)


def causal_conv1d_pool_triton(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                              has_state: torch.Tensor | None, cu_seqlens: torch.Tensor, groups: int = 1,
                              tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [T, C] raw inputs (any row stride), weight [C, W], pool [slots, C, W-1] (updated in place at
    ``slots``), slots [N], has_state [N] (0: fresh sequence, zero history; None: every sequence has
    history), cu_seqlens [N+1]. Returns y [groups, T, C / groups] in x's dtype: channel group g of
    every token side by side. A decode step (one token per sequence, has_state None) runs as one
    kernel that reads and writes each window once; other steps as a conv kernel over tiles of
    ``tile`` = (tokens, channels, warps) (default ``PREFILL_TILE``) and a window kernel."""
    T, C = x.shape
    if C % groups:
        raise ValueError(f"causal_conv1d_pool_triton: {C} channels do not split into {groups} groups")
    W = weight.shape[1]
    if W > MAX_WIDTH:
        raise ValueError(f"causal_conv1d_pool_triton: conv kernel size {W} > {MAX_WIDTH}, the largest the CUDA "
                         f"kernels take (short_conv_kernel_size); run on the CPU reference path")
    if x.stride(1) != 1 or pool.stride(2) != 1:
        raise ValueError("causal_conv1d_pool_triton needs unit stride on the channel/column axes")
    weight = weight.contiguous()
    N = slots.shape[0]
    if has_state is None and T == N:
        y = torch.empty(groups, T, C // groups, dtype=x.dtype, device=x.device)
        if T:
            BC = 256
            _conv_decode_kernel[(N, triton.cdiv(C, BC))](
                x, weight, pool, slots, y, N, C, C // groups, x.stride(0), pool.stride(0), pool.stride(1),
                W=W, WP=triton.next_power_of_2(max(W - 1, 1)), BC=BC, **pdl(x))
        return y
    if has_state is None:
        has_state = torch.ones(N, dtype=torch.bool, device=x.device)
    tok_seq = torch.searchsorted(cu_seqlens[1:].contiguous(), torch.arange(T, device=x.device), right=True)
    has = has_state.to(torch.int32)
    y = torch.empty(groups, T, C // groups, dtype=x.dtype, device=x.device)
    BT, BC, warps = tile or PREFILL_TILE
    _conv_fwd_kernel[(triton.cdiv(T, BT), triton.cdiv(C, BC))](
        x, weight, pool, slots, has, cu_seqlens, tok_seq, y, T, C, C // groups, x.stride(0), pool.stride(0), pool.stride(1),
        W=W, BT=BT, BC=BC, num_warps=warps, **pdl(x))
    _conv_state_kernel[(N, triton.cdiv(C, 256))](
        x, pool, slots, has, cu_seqlens, C, x.stride(0), pool.stride(0), pool.stride(1), W=W,
        WP=triton.next_power_of_2(max(W - 1, 1)), BC=256, **pdl(x))
    return y
