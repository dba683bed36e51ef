"""One KDA decode step in one kernel: every sequence has one new token and a state in the pool.
Reference: ``kimik3.ops.kda.naive_recurrent_kda`` on ``_reference_inputs`` (the gate, beta's sigmoid
and the q/k L2 norm are computed here from the raw operands).

Program (sequence n, head h, value block): the state rows S[v, :] of its BV value channels
(V-first pool, [slot, H, V, K] fp32), so the rows of one head are split over V / BV programs
that each read and write their own slice once:
    S <- S * exp(g)[None, :];  delta = beta (v - S k);  S <- S + delta[:, None] k[None, :];  o = S q
q, k, v, f and b are read through their row strides (slices of the step's merged projection, as
they come), so no operand is copied first.

With the output norm (NORM: one program a head, walking its V rows BV at a time), the program
finishes the layer's KDA output as well: o <- rmsnorm(o) * w * sigmoid(gate), from o rounded to the
layer's dtype as an unfused norm would read it (the same arithmetic as ``triton/norm.py``'s GATED
form). The rounded row waits in o while the walk sums its squares, then is read back (after a barrier:
other threads stored it) and normed in place.

Under PDL a program asks L2 for its state rows before it waits for the kernel before it: a state row is
written only by this layer's step, so the read of the 64 KB of a head starts during that kernel's tail.

Low-rank operands (``ops.kda.LowRank``: F_LR for the gate logits f = f_a f_b^T, G_LR for the output gate
g_a g_b^T): the program computes its head's part from the sequence's low-rank row and the head's rows of
the up-projection (over the rank R in chunks of min(32, R), fp32 sums, rounded to the row's dtype as the
projection's output is), so the step needs no launch for them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimik3.ops.triton import common
from kimik3.ops.triton.common import pdl, pdl_entry, prefetch_l2


@triton.jit
def _up_projected(a_row, w, rows, R: tl.constexpr, RC: tl.constexpr):
    """sum_r a_row[r] w[rows, r] in fp32 over R in chunks of RC, rounded to a_row's dtype: [len(rows)] fp32."""
    acc = tl.zeros(rows.shape, tl.float32)
    for r0 in tl.static_range(0, R, RC):
        cr = r0 + tl.arange(0, RC)
        acc += tl.sum(tl.load(w + rows[:, None].to(tl.int64) * R + cr[None, :]).to(tl.float32)
                      * tl.load(a_row + cr).to(tl.float32)[None, :], 1)
    return acc.to(a_row.dtype.element_ty).to(tl.float32)


@triton.jit
def _kda_decode_kernel(q, k, v, f, b, A_log, dt_bias, pool, slots, o, norm_w, gate, f_w, gate_w, lower_bound, scale,
                       eps, stride_q, stride_k, stride_v, stride_f, stride_b, stride_o, stride_slot, stride_gate,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                       BOUNDED: tl.constexpr, NORM: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
                       F_LR: tl.constexpr = False, G_LR: tl.constexpr = False, R: tl.constexpr = 32,
                       RC: tl.constexpr = 32):
    n, h, iv = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    ROWS: tl.constexpr = V if NORM else BV         # the program's value rows, BV at a time
    ck = tl.arange(0, K)
    slot = tl.load(slots + n).to(tl.int64)        # a step's input, written before its first kernel
    head = pool + slot * stride_slot + h * V * K + iv * ROWS * K
    if PREFETCH and ROWS * K >= 32:                # (under PDL) the rows' 128-byte lines (32 fp32 each), before the wait
        prefetch_l2(head + tl.arange(0, ROWS * K // 32) * 32)
    pdl_entry(PDL)
    qv = tl.load(q + n * stride_q + h * K + ck).to(tl.float32)
    kv = tl.load(k + n * stride_k + h * K + ck).to(tl.float32)
    if F_LR:                                       # f's row holds f_a [R]; f_w = f_b [H K, R]
        fz = _up_projected(f + n * stride_f, f_w, h * K + ck, R, RC)
    else:
        fz = tl.load(f + n * stride_f + h * K + ck).to(tl.float32)
    z = fz + tl.load(dt_bias + h * K + ck).to(tl.float32)
    a = tl.exp(tl.load(A_log + h).to(tl.float32))
    if BOUNDED:
        g = lower_bound * tl.sigmoid(a * z)
    else:
        g = -a * tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(z)))            # softplus, threshold 20
    decay = tl.exp(g)
    beta = tl.sigmoid(tl.load(b + n * stride_b + h).to(tl.float32))
    qv = qv * (1.0 / tl.sqrt(tl.sum(qv * qv, 0) + 1e-6)) * scale
    kv = kv * (1.0 / tl.sqrt(tl.sum(kv * kv, 0) + 1e-6))
    o_row = o + n * stride_o + h * V
    squares = 0.0
    for r0 in tl.range(0, ROWS, BV):
        cv = iv * ROWS + r0 + tl.arange(0, BV)
        rows = head + (r0 + tl.arange(0, BV))[:, None] * K + ck[None, :]
        S = tl.load(rows) * decay[None, :]                                 # [BV, K] fp32
        vv = tl.load(v + n * stride_v + h * V + cv).to(tl.float32)
        delta = beta * (vv - tl.sum(S * kv[None, :], 1))
        S = S + delta[:, None] * kv[None, :]
        tl.store(rows, S)
        out = tl.sum(S * qv[None, :], 1)                                   # [BV] fp32
        if NORM:                                   # o as the unfused norm reads it, kept in o until the row is done
            out = out.to(v.dtype.element_ty)
            squares += tl.sum(out.to(tl.float32) * out.to(tl.float32), 0)
        tl.store(o_row + cv, out.to(o.dtype.element_ty))
    if NORM:                                       # the head's whole row: o <- rmsnorm(o) * w * sigmoid(gate)
        tl.debug_barrier()                         # (the row's values were stored by other threads of the program)
        cv = tl.arange(0, V)
        out = tl.load(o_row + cv).to(tl.float32)
        out = out * (1.0 / tl.sqrt(squares / V + eps)) * tl.load(norm_w + cv).to(tl.float32)
        if G_LR:                                   # gate's row holds g_a [R]; gate_w = g_b [H V, R]
            gt = _up_projected(gate + n * stride_gate, gate_w, h * V + cv, R, RC)
        else:
            gt = tl.load(gate + n * stride_gate + h * V + cv).to(tl.float32)
        tl.store(o_row + cv, (out * tl.sigmoid(gt)).to(o.dtype.element_ty))


def default_block_v(V: int, norm: bool) -> int:
    """Value rows a program updates at a time (block x K x 4 bytes of state). With the output norm a program
    walks its head's V rows in such blocks. H100, 96 heads x 128, batch 1/8/32/128 (bench_decode_ops.py,
    fc693bd, us): the walk in blocks of 64 on 8 warps 9.6 / 44.6 / 156.4 / 598.4, the whole row at once (8
    warps, ~140 registers a thread: one program a multiprocessor, whose loads stop while it computes and
    stores) 10.6 / 53.8 / 194.9 / 745.4, blocks of 32 on 4 warps 11.8 / 44.6 / 188.5 / 781.6; the step in
    blocks of 32 without the norm, then the norm's own launch, 10.2 / 43.6 / 160.4 / 619.6."""
    return min(64 if norm else 32, V)


def default_warps(BV: int, K: int) -> int:
    """Warps of a program updating BV x K of state: 32 of its values a thread up to 4096 values, then 8 warps."""
    return 4 if BV * K <= 4096 else 8


MAX_RANK = 512          # the widest low-rank row the kernel reads (chunks of 32 unrolled: Kimi's is 128)


def low_rank_fits(R: int) -> bool:
    """Whether the decode kernel computes an up-projection of rank R itself: a power of two up to MAX_RANK."""
    return 0 < R <= MAX_RANK and not R & (R - 1)


def _low_rank(name: str, t, N: int, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(row operand, up-projection or None, its rank) of a per-head operand given as a tensor or a low-rank
    pair (a, w)."""
    if not isinstance(t, tuple):
        return t, None, 0
    a, w = t
    R = a.shape[-1]
    if (a.dim() != 2 or a.shape[0] != N or a.stride(-1) != 1 or tuple(w.shape) != (rows, R) or not w.is_contiguous()
            or a.dtype != dtype or w.dtype != dtype or not low_rank_fits(R)):
        raise ValueError(f"kda_decode_triton: low-rank {name} needs a [{N}, R] (unit inner stride) and a contiguous "
                         f"w [{rows}, R] of {dtype}, R a power of two up to {MAX_RANK}; got a {a.dtype} "
                         f"{tuple(a.shape)} (strides {tuple(a.stride())}), w {w.dtype} {tuple(w.shape)}")
    return a, w, R


def kda_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f, b: torch.Tensor,
                      A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None,
                      state_pool: torch.Tensor, slots: torch.Tensor, block_v: int | None = None,
                      num_warps: int | None = None, norm: tuple | None = None) -> torch.Tensor:
    """q, k [N, H, K]; v [N, H, V]; f [N, H, K] or a low-rank pair (a [N, R], w [H K, R]: f = a w^T rounded to
    a's dtype, ``ops.kda.LowRank``); b [N, H] (each
    with unit stride inside a row, any row stride); A_log [H], dt_bias [H*K]; state_pool [slots, H, V, K] fp32,
    rows ``slots`` [N] updated in place. Returns o [N, H, V] in v's dtype; with ``norm`` = (weight [V],
    gate [N, H, V] or a low-rank pair (a [N, R], w [H V, R]), eps, dtype) the normed output
    rmsnorm(o) * weight * sigmoid(gate) in that dtype (one program a head, walking its rows block_v at a time)."""
    N, H, K = q.shape
    V = v.shape[-1]
    BV = block_v or default_block_v(V, norm is not None)
    f, f_w, f_rank = _low_rank("f", f, N, H * K, q.dtype)
    _check_step_operands(q, k, v, f if f_w is None else None, b, state_pool, BV)
    if norm is not None:
        weight, gate, gate_w, g_rank, eps, dtype = _output_norm_operands(norm, N, H, V, q.dtype, v.dtype)
    else:
        weight, gate, gate_w, g_rank, eps, dtype = A_log, A_log, None, 0, 0.0, v.dtype    # unused placeholders
    if f_rank and g_rank and f_rank != g_rank:
        raise ValueError(f"kda_decode_triton: low-rank f and gate of ranks {f_rank} and {g_rank} (one rank a step)")
    rank = max(f_rank, g_rank) or 32                                          # (unused without a low-rank operand)
    o = torch.empty(N, H, V, dtype=dtype, device=v.device)
    if N:
        _kda_decode_kernel[(N, H, 1 if norm is not None else V // BV)](
            q, k, v, f, b, A_log, dt_bias, state_pool, slots, o, weight, gate, A_log if f_w is None else f_w,
            A_log if gate_w is None else gate_w, float(lower_bound or 0.0), K ** -0.5,
            float(eps), q.stride(0), k.stride(0), v.stride(0), f.stride(0), b.stride(0), o.stride(0),
            state_pool.stride(0), gate.stride(0) if norm is not None else 0,
            H=H, K=K, V=V, BV=BV, BOUNDED=lower_bound is not None, NORM=norm is not None,
            PREFETCH=common.prefetch_on(pdl(q)["PDL"]), num_warps=num_warps or default_warps(BV, K),
            F_LR=f_w is not None, G_LR=gate_w is not None, R=rank, RC=min(32, rank), **pdl(q))
    return o


def _check_step_operands(q, k, v, f, b, state_pool, BV: int) -> None:
    """The layouts the decode kernel reads: an fp32 state pool [slots, H, V, K] with contiguous rows, K a
    power of two and V a multiple of the block, each row's heads packed in q, k, v (and f when dense)."""
    N, H, K = q.shape
    V = v.shape[-1]
    if state_pool.dtype != torch.float32 or tuple(state_pool.shape[1:]) != (H, V, K) or not state_pool[0].is_contiguous():
        raise ValueError(f"kda_decode_triton: the state pool must be fp32 [slots, {H}, {V}, {K}] with contiguous "
                         f"rows, got {state_pool.dtype} {tuple(state_pool.shape)}")
    if K & (K - 1) or V % BV or BV & (BV - 1):
        raise ValueError(f"kda_decode_triton: head dims K={K}, V={V} need K a power of two and V a multiple of "
                         f"the power-of-two block {BV}")
    for name, t in (("q", q), ("k", k), ("v", v)) + ((("f", f),) if f is not None else ()):
        if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
            raise ValueError(f"kda_decode_triton: {name} needs each row's heads packed ({tuple(t.stride())})")
    if b.stride(-1) != 1:
        raise ValueError("kda_decode_triton: b needs unit stride over heads")


def _output_norm_operands(norm: tuple, N: int, H: int, V: int, act_dtype: torch.dtype, v_dtype: torch.dtype):
    """(weight, gate, gate up-projection or None, its rank, eps, output dtype) of the fused output norm
    ``norm`` = (weight [V], gate [N, H, V] or a low-rank pair, eps, dtype), checked."""
    weight, gate, eps, dtype = norm
    if dtype not in (v_dtype, torch.float32):           # the raw row waits in o for its norm (the docstring)
        raise ValueError(f"kda_decode_triton: the normed output's dtype must be v's ({v_dtype}) or float32, got "
                         f"{dtype}")
    gate, gate_w, g_rank = _low_rank("gate", gate, N, H * V, act_dtype)
    if tuple(weight.shape) != (V,) or (gate_w is None and (tuple(gate.shape) != (N, H, V) or gate.stride(-1) != 1
                                                          or gate.stride(-2) != V)):
        raise ValueError(f"kda_decode_triton: the output norm needs weight [{V}] and gate [{N}, {H}, {V}] with "
                         f"each row's heads packed, got {tuple(weight.shape)} and {tuple(gate.shape)} "
                         f"(strides {tuple(gate.stride())})")
    return weight, gate, gate_w, g_rank, eps, dtype
