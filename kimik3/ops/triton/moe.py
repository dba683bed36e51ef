"""Routed experts as grouped GEMMs: bf16/fp16 weights, or MXFP4 weights dequantized in the kernel.

The (token, expert) assignments are sorted by expert and each expert's rows padded to a multiple
of BM, so one program of a GEMM works on BM rows of a single expert (each touched expert's
weights are read once per column tile).
  1. gate/up: h = act(x W1_e^T, x W3_e^T) (SITU or SiLU fused in the epilogue), rows in sorted order;
  2. down:    y_r = h W2_e^T, written per assignment r = t * top_k + j (activation dtype, unweighted);
  3. combine: out_t = sum_j weights[t, j] * y_{t*top_k+j} in fp32, one rounding.
The weight format is a compile-time parameter (MXFP4): dense weights [E, N, K] are loaded as
tiles; MXFP4 weights stay packed: uint8 [E, N, K/2] (element 2i in the low nibble of byte i) and
E8M0 scales uint8 [E, N, K/32]; each K-step loads its bytes along the contiguous axis, expands
them to a bf16 [BN, BK] tile in registers and feeds the tensor cores.
The alignment, the GEMMs and the combine are device work only (no host synchronisation), so
decode steps capture into CUDA graphs.
Reference: ``kimik3.ops.moe.fused_moe`` / ``fused_moe_mxfp4``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimik3.ops.options import tuning
from kimik3.ops.triton.common import INTERPRETING, dot, glu, pdl, pdl_entry
from kimik3.ops.triton.e2m1 import e2m1_asm
from kimik3.ops.triton.gemv import one_token_experts
from kimik3.ops.triton.moe_fp8 import act_tile, e2m1_e4m3_tile, e8m0_factor, fp8_weight_tile


# E2M1 -> bf16 (``kimik3.ops.triton.e2m1``): operand $4 = four packed bytes, $5, $6 = the bf16x2 factors f of
# bytes (0, 1) and (2, 3), $7, $8 the same for g (HIGH_SCALES)
ASM_LOW = tl.constexpr(e2m1_asm("$4", "$5", "$6"))
ASM_HIGH = tl.constexpr(e2m1_asm("$4", "$5", "$6", "$7", "$8"))


@triton.jit
def _scales(scale_ptr, kh, KH, mn, G: tl.constexpr):
    """E8M0 scale codes (int32 [BN, G]) of packed bytes kh..kh + 16 G (16 bytes share a scale);
    the K loops load them one step ahead, which hides their latency (Triton does not pipeline them)."""
    grp = kh // 16 + tl.arange(0, G)
    return tl.load(scale_ptr + grp[None, :], mask=mn[:, None] & (grp < KH // 16)[None, :], other=113).to(tl.int32)


@triton.jit
def _dequant_tile(packed_ptr, sc, kh, KH, mn, BN: tl.constexpr, BKH: tl.constexpr,
                  ASM: tl.constexpr, HIGH_SCALES: tl.constexpr):
    """Packed bytes kh..kh+BKH of BN rows, scale codes sc [BN, BKH / 16] -> bf16 weights
    [BN, 2*BKH] in element order.

    ASM (CUDA): the integer bit placement above. Otherwise (Triton's CPU interpreter, which runs
    no PTX): a nibble's magnitude bits placed at fp16 bits 11..9 (sign at 15) read as that E2M1
    value times 2**-14 (code 1 lands on the fp16 subnormal 2**-15, which the fp16 -> fp32
    conversion keeps exact); one fp32 multiply by 2**(scale - 113) per element then applies the
    E8M0 scale and the 2**14 (valid for scale <= 240)."""
    kk = kh + tl.arange(0, BKH)
    mask = mn[:, None] & (kk < KH)[None, :]
    b = tl.load(packed_ptr + kk[None, :], mask=mask, other=0)
    G: tl.constexpr = BKH // 16
    if ASM:
        if HIGH_SCALES:
            f = _bf16_bits((tl.minimum(sc, 128) + 126) << 7, BN, G)
            g = _bf16_bits((tl.maximum(sc, 128) - 1) << 7, BN, G)
            lo, hi = tl.inline_asm_elementwise(ASM_HIGH, "=r,=r,=r,=r,r,r,r,r,r", [b, f, g],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        else:
            f = _bf16_bits((sc + 126) << 7, BN, G)
            lo, hi = tl.inline_asm_elementwise(ASM_LOW, "=r,=r,=r,=r,r,r,r", [b, f],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        return tl.reshape(tl.join(lo, hi), (BN, 2 * BKH))
    b = b.to(tl.uint16)
    lo = (((b & 0x07) << 9) | ((b & 0x08) << 12)).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True).to(tl.float32)
    factor = ((sc + 14) << 23).to(tl.float32, bitcast=True)                              # [BN, G]
    factor = tl.reshape(tl.broadcast_to(factor[:, :, None], (BN, G, 16)), (BN, BKH))
    w = tl.join(lo * factor, hi * factor)                                               # [BN, BKH, 2]
    return tl.reshape(w, (BN, 2 * BKH)).to(tl.bfloat16)


@triton.jit
def _weight_tile(wp, sc, kh, KH, mn, BN: tl.constexpr, BKH: tl.constexpr, MXFP4: tl.constexpr,
                 ASM: tl.constexpr, HIGH_SCALES: tl.constexpr):
    """Weights [BN, 2*BKH] of K positions 2*kh.. for BN rows starting at ``wp`` (row pointers):
    a dense tile (MXFP4 false: KH is half the row length) or the dequantized packed bytes."""
    if MXFP4:       # (if/else, not an early return: Triton types every return of a function)
        w = _dequant_tile(wp, sc, kh, KH, mn, BN, BKH, ASM, HIGH_SCALES)
    else:
        kk = 2 * kh + tl.arange(0, 2 * BKH)
        w = tl.load(wp + kk[None, :], mask=mn[:, None] & (kk < 2 * KH)[None, :], other=0.0)
    return w


@triton.jit
def _next_scales(scale_ptr, kh, KH, mn, G: tl.constexpr, MXFP4: tl.constexpr, sc):
    """The scale codes of the next K-step (MXFP4), or the unused placeholder ``sc`` (dense)."""
    if MXFP4:
        sc = _scales(scale_ptr, kh, KH, mn, G)
    return sc


@triton.jit
def _bf16_bits(bits, BN: tl.constexpr, G: tl.constexpr):
    """int32 bf16 bit patterns [BN, G] -> bf16 [BN, 16 G], each repeated over its group's 16 bytes."""
    v = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.reshape(tl.broadcast_to(v[:, :, None], (BN, G, 16)), (BN, 16 * G))


@triton.jit(do_not_specialize=["N", "KH"])
def _dequant_kernel(packed, scale, out, N, KH, stride_p_e, stride_p_n, stride_s_e, stride_s_n, stride_o_e, stride_o_n,
                    BN: tl.constexpr, BKH: tl.constexpr, ASM: tl.constexpr, HIGH_SCALES: tl.constexpr,
                    PDL: tl.constexpr):
    """MXFP4 [E, N, 2 KH] (packed bytes [E, N, KH], scales [E, N, KH / 16]) -> bf16 ``out`` [E, N, 2 KH]:
    program (e, row block, byte block) expands BN x BKH bytes with ``_dequant_tile`` (exact)."""
    pdl_entry(PDL)
    e, pid_n, pid_k = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    n = pid_n * BN + tl.arange(0, BN)
    mn = n < N
    kh = pid_k * BKH
    G: tl.constexpr = BKH // 16
    sc = _scales(scale + e * stride_s_e + n[:, None].to(tl.int64) * stride_s_n, kh, KH, mn, G)
    w = _dequant_tile(packed + e * stride_p_e + n[:, None].to(tl.int64) * stride_p_n, sc, kh, KH, mn, BN, BKH, ASM,
                      HIGH_SCALES)
    k = 2 * kh + tl.arange(0, 2 * BKH)
    tl.store(out + e * stride_o_e + n[:, None].to(tl.int64) * stride_o_n + k[None, :], w,
             mask=mn[:, None] & (k < 2 * KH)[None, :])


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, high_scales: bool = True) -> None:
    """MXFP4 experts (packed uint8 [E, N, K/2], E8M0 scales uint8 [E, N, K/32]; any expert and row strides,
    unit inner stride) dequantized into ``out`` bf16 [E, N, K] (unit inner stride), exactly."""
    E, N, KH = packed.shape
    if out.shape != (E, N, 2 * KH) or out.dtype != torch.bfloat16 or scale.shape != (E, N, KH // 16):
        raise ValueError(f"dequantize_mxfp4: packed {tuple(packed.shape)}, scale {tuple(scale.shape)} and out "
                         f"{out.dtype} {tuple(out.shape)} do not match")
    if packed.stride(2) != 1 or scale.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("dequantize_mxfp4 needs unit stride on the inner axis")
    BN, BKH = 32, 64
    if E and N and KH:
        _dequant_kernel[(E, triton.cdiv(N, BN), triton.cdiv(KH, BKH))](
            packed, scale, out, N, KH, packed.stride(0), packed.stride(1), scale.stride(0), scale.stride(1),
            out.stride(0), out.stride(1), BN=BN, BKH=BKH, ASM=not INTERPRETING, HIGH_SCALES=high_scales,
            num_warps=4, **pdl(out))


@triton.jit
def _block(sorted_rows, num_rows, pid_m, pid_n, N, BM: tl.constexpr, BN: tl.constexpr, ONE_TOKEN: tl.constexpr):
    """This program's BM sorted rows (assignment ids; ``valid`` false on padding) and BN output
    columns (``mn`` false past N). ONE_TOKEN (a single token, whose top-k experts are distinct):
    block b holds assignment b alone, with no alignment tables (``block_expert`` is then the ids)."""
    offs_m = pid_m * BM + tl.arange(0, BM)
    if ONE_TOKEN:
        rows = tl.where(tl.arange(0, BM) == 0, pid_m, num_rows).to(tl.int64)
    else:
        rows = tl.load(sorted_rows + offs_m)
    n = pid_n * BN + tl.arange(0, BN)
    return offs_m, rows, rows < num_rows, n, n < N


# The weight formats (FMT, compile time): dense tiles; MXFP4 dequantized to bf16; E4M3 codes with per-output-
# channel scales (FP8 experts: widened to the activations' dtype, or with ACT_Q on the FP8 tensor cores);
# MXFP4 expanded to E4M3 for the FP8 tensor cores (W4A8: ACT_Q, a K step of one 32-value group).
DENSE, MXFP4, FP8, MXFP4_FP8 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)


@triton.jit
def _step(a, fa, wrow, sc, srow, kh, KH, mn, acc, BN: tl.constexpr, BKH: tl.constexpr, FMT: tl.constexpr,
          ACT_Q: tl.constexpr, ASM: tl.constexpr, HIGH_SCALES: tl.constexpr, UPCAST: tl.constexpr,
          EMULATE: tl.constexpr):
    """``acc`` plus one K step's product: activation tile ``a`` [BM, 2 BKH] (``moe_fp8.act_tile``: its rows'
    factors ``fa``) by the weight tile of rows ``wrow`` ([BN, 1] pointers) at packed byte kh (element 2 kh);
    ``sc``: the step's MXFP4 scale codes (FMT MXFP4); ``srow`` [BN]: the weight rows' scale pointers (FP8: the
    channel scales, applied after the loop; MXFP4_FP8: the E8M0 group scales, one a step)."""
    if FMT == MXFP4_FP8:
        w = e2m1_e4m3_tile(wrow, kh, KH, mn, BN, BKH, EMULATE)
        fw = e8m0_factor(tl.load(srow + kh // 16, mask=mn, other=127).to(tl.int32))
        acc += dot(a, tl.trans(w), tl.zeros_like(acc), UPCAST) * (fa[:, None] * fw[None, :])
    elif FMT == FP8:
        w = fp8_weight_tile(wrow, 2 * kh, 2 * KH, mn, 2 * BKH, ACT_Q, EMULATE, a.dtype)
        if ACT_Q:
            acc += dot(a, tl.trans(w), tl.zeros_like(acc), UPCAST) * fa[:, None]
        else:
            acc = dot(a, tl.trans(w), acc, UPCAST)
    else:
        acc = dot(a, tl.trans(_weight_tile(wrow, sc, kh, KH, mn, BN, BKH, FMT == MXFP4, ASM, HIGH_SCALES)), acc,
                  UPCAST)
    return acc


@triton.jit
def _channel_scaled(acc, srow, mn, FMT: tl.constexpr):
    """FP8 weights: the sum times each column's channel scale (other formats: as it is)."""
    if FMT == FP8:
        acc = acc * tl.load(srow, mask=mn, other=0.0)[None, :]
    return acc


@triton.jit
def _gate_up_kernel(x, w1p, w1s, w3p, w3s, h, sorted_rows, block_expert, num_rows, I, KH,
                    stride_x, stride_wp_e, stride_wp_n, stride_ws_e, stride_ws_n, stride_h,
                    beta, linear_beta, TOP_K: tl.constexpr, ACT_SITU: tl.constexpr, CLIP_UP: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr, UPCAST: tl.constexpr,
                    FMT: tl.constexpr, ASM: tl.constexpr, HIGH_SCALES: tl.constexpr, ONE_TOKEN: tl.constexpr,
                    PDL: tl.constexpr, ACT_Q: tl.constexpr = False, EMULATE: tl.constexpr = False):
    pdl_entry(PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert + pid_m).to(tl.int64)
    if e < 0:
        return
    offs_m, rows, valid, n, mn = _block(sorted_rows, num_rows, pid_m, pid_n, I, BM, BN, ONE_TOKEN)
    tok = (rows // TOP_K).to(tl.int64)
    kcol = tl.arange(0, 2 * BKH)
    col1 = w1p + e * stride_wp_e + n[:, None].to(tl.int64) * stride_wp_n
    col3 = w3p + e * stride_wp_e + n[:, None].to(tl.int64) * stride_wp_n
    scl1 = w1s + e * stride_ws_e + n[:, None].to(tl.int64) * stride_ws_n
    scl3 = w3s + e * stride_ws_e + n[:, None].to(tl.int64) * stride_ws_n
    srow1 = w1s + e * stride_ws_e + n.to(tl.int64) * stride_ws_n
    srow3 = w3s + e * stride_ws_e + n.to(tl.int64) * stride_ws_n
    acc1 = tl.zeros([BM, BN], dtype=tl.float32)
    acc3 = tl.zeros([BM, BN], dtype=tl.float32)
    G: tl.constexpr = BKH // 16
    sc1 = _next_scales(scl1, 0, KH, mn, G, FMT == MXFP4, tl.zeros([BN, G], tl.int32))
    sc3 = _next_scales(scl3, 0, KH, mn, G, FMT == MXFP4, tl.zeros([BN, G], tl.int32))
    for kh in range(0, KH, BKH):
        next1 = _next_scales(scl1, kh + BKH, KH, mn, G, FMT == MXFP4, sc1)
        next3 = _next_scales(scl3, kh + BKH, KH, mn, G, FMT == MXFP4, sc3)
        kx = 2 * kh + kcol
        a, fa = act_tile(x + tok[:, None] * stride_x + kx[None, :], valid[:, None] & (kx < 2 * KH)[None, :], ACT_Q,
                         EMULATE)
        acc1 = _step(a, fa, col1, sc1, srow1, kh, KH, mn, acc1, BN, BKH, FMT, ACT_Q, ASM, HIGH_SCALES, UPCAST, EMULATE)
        acc3 = _step(a, fa, col3, sc3, srow3, kh, KH, mn, acc3, BN, BKH, FMT, ACT_Q, ASM, HIGH_SCALES, UPCAST, EMULATE)
        sc1, sc3 = next1, next3
    acc1 = _channel_scaled(acc1, srow1, mn, FMT)
    acc3 = _channel_scaled(acc3, srow3, mn, FMT)
    # the reference rounds both projections to the activation dtype before the activation
    g = acc1.to(h.dtype.element_ty).to(tl.float32)
    u = acc3.to(h.dtype.element_ty).to(tl.float32)
    out = glu(g, u, beta, linear_beta, ACT_SITU, CLIP_UP).to(h.dtype.element_ty)
    tl.store(h + offs_m[:, None].to(tl.int64) * stride_h + n[None, :], out, mask=mn[None, :])


@triton.jit
def _down_kernel(h, w2p, w2s, y, sorted_rows, block_expert, num_rows, L, KH,
                 stride_h, stride_wp_e, stride_wp_n, stride_ws_e, stride_ws_n, stride_y,
                 BM: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr, UPCAST: tl.constexpr,
                 FMT: tl.constexpr, ASM: tl.constexpr, HIGH_SCALES: tl.constexpr, ONE_TOKEN: tl.constexpr,
                 PDL: tl.constexpr, ACT_Q: tl.constexpr = False, EMULATE: tl.constexpr = False):
    pdl_entry(PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert + pid_m).to(tl.int64)
    if e < 0:
        return
    offs_m, rows, valid, n, mn = _block(sorted_rows, num_rows, pid_m, pid_n, L, BM, BN, ONE_TOKEN)
    kcol = tl.arange(0, 2 * BKH)
    col = w2p + e * stride_wp_e + n[:, None].to(tl.int64) * stride_wp_n
    scl = w2s + e * stride_ws_e + n[:, None].to(tl.int64) * stride_ws_n
    srow = w2s + e * stride_ws_e + n.to(tl.int64) * stride_ws_n
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    G: tl.constexpr = BKH // 16
    sc = _next_scales(scl, 0, KH, mn, G, FMT == MXFP4, tl.zeros([BN, G], tl.int32))
    for kh in range(0, KH, BKH):
        following = _next_scales(scl, kh + BKH, KH, mn, G, FMT == MXFP4, sc)
        kx = 2 * kh + kcol
        a, fa = act_tile(h + offs_m[:, None].to(tl.int64) * stride_h + kx[None, :], (kx < 2 * KH)[None, :], ACT_Q,
                         EMULATE)
        acc = _step(a, fa, col, sc, srow, kh, KH, mn, acc, BN, BKH, FMT, ACT_Q, ASM, HIGH_SCALES, UPCAST, EMULATE)
        sc = following
    acc = _channel_scaled(acc, srow, mn, FMT)
    tl.store(y + rows[:, None].to(tl.int64) * stride_y + n[None, :], acc.to(y.dtype.element_ty),
             mask=valid[:, None] & mn[None, :])


@triton.jit
def _combine_kernel(y, weights, pos, out, L, TOP_K: tl.constexpr, BL: tl.constexpr, HAS_POS: tl.constexpr,
                    PDL: tl.constexpr):
    """out[t] = sum_j weights[t, j] y[row of (t, j)] in fp32, one rounding; the row is t k + j, or
    pos[t k + j] (the grouped-GEMM path's rows stay in expert order)."""
    pdl_entry(PDL)
    t, pid = tl.program_id(0).to(tl.int64), tl.program_id(1)
    c = pid * BL + tl.arange(0, BL)
    mc = c < L
    acc = tl.zeros([BL], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        w = tl.load(weights + t * TOP_K + j).to(tl.float32)
        row = tl.load(pos + t * TOP_K + j).to(tl.int64) if HAS_POS else t * TOP_K + j
        acc += w * tl.load(y + row * L + c, mask=mc, other=0.0).to(tl.float32)
    tl.store(out + t * L + c, acc.to(out.dtype.element_ty), mask=mc)


def _sort_by_expert(ids: torch.Tensor, num_experts: int, BM: int):
    """Assignment rows grouped by expert, each group padded to a multiple of BM (no host sync).
    Returns sorted_rows [cap] (pad entries hold R = number of assignments) and block_expert
    [cap / BM] (-1 for blocks past the end); within an expert rows keep their order.
    Up to ``KernelTuning.align_kernel_max_rows`` assignments (decode) one Triton launch does it all; beyond, torch ops."""
    flat = ids.reshape(-1)
    R = flat.numel()
    dev = flat.device
    cap = R + min(num_experts, R) * (BM - 1)
    cap = (cap + BM - 1) // BM * BM
    sorted_rows = torch.empty(cap, dtype=torch.int64, device=dev)
    block_expert = torch.empty(cap // BM, dtype=torch.int64, device=dev)
    if 0 < R <= tuning().align_kernel_max_rows:
        BR = triton.next_power_of_2(R)
        _align_kernel[(min(BR, ALIGN_BLOCKS.value),)](
            flat, sorted_rows, block_expert, R, num_experts, cap, BM=BM, BR=BR,
            BE=triton.next_power_of_2(num_experts), BCAP=triton.next_power_of_2(cap), num_warps=align_warps(R),
            **pdl(flat))
        return sorted_rows, block_expert
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + BM - 1) // BM * BM
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(R, device=dev) - (counts.cumsum(0) - counts)[experts]
    sorted_rows.fill_(R)
    sorted_rows[pad_start[experts] + rank] = order
    block_expert.copy_(torch.searchsorted(pad_end, torch.arange(0, cap, BM, device=dev), right=True))
    block_expert.masked_fill_(block_expert >= num_experts, -1)
    return sorted_rows, block_expert


ALIGN_BLOCKS = tl.constexpr(64)       # the alignment kernel's programs: min(next_power_of_2(R), this)


def align_warps(R: int) -> int:
    """Warps of each ``_align_kernel`` program for R assignments (one value per power-of-two bound on R).
    H200 (benchmarks/gpu/bench_router_align.py --sweep): every warp adds its whole histogram into
    shared memory, so few rows take few warps (896 experts, 16 rows: 4.8 us at 2 warps, 7.0 at 4)."""
    return 2 if R <= 256 else 4 if R <= 2048 else 8


@triton.jit(do_not_specialize=["R", "cap"])       # they only bound masks: one compile per tile shape
def _align_kernel(ids, sorted_rows, block_expert, R, E, cap, BM: tl.constexpr, BR: tl.constexpr,
                  BE: tl.constexpr, BCAP: tl.constexpr, PDL: tl.constexpr):
    """``_sort_by_expert`` without a sort (BR, BE, BCAP: powers of two >= R, E, cap). The rows are
    split into NB = min(BR, ALIGN_BLOCKS) blocks of BT consecutive rows, one program each (grid
    (NB,)); every output element is written by exactly one program, so programs need no order.
    Each program counts every expert's rows (histogram of all ids -> padded starts) and those
    before its block (a second histogram); a row's rank within its expert adds the rows of that
    expert before it inside the block. A row goes to its expert's padded start plus its rank; the
    row of rank 0 mod BM names its block's expert; the expert's last row writes the padding after
    it; the tail past the last padded end is split evenly between the programs."""
    pdl_entry(PDL)
    NB: tl.constexpr = BR if BR < ALIGN_BLOCKS else ALIGN_BLOCKS
    BT: tl.constexpr = BR // NB
    pid = tl.program_id(0)
    row0 = pid * BT
    i = tl.arange(0, BR)
    e = tl.load(ids + i, mask=i < R, other=0).to(tl.int32)          # slots past R count in bin 0: taken off
    bins = tl.arange(0, BE)
    counts = tl.histogram(e, BE) - tl.where(bins == 0, BR - R, 0)
    before = tl.histogram(tl.where(i < row0, e, 0), BE) - tl.where(bins == 0, BR - row0, 0)
    padded = (counts + BM - 1) // BM * BM
    pad_start = tl.cumsum(padded, 0) - padded
    pad_total = tl.sum(padded, 0)

    j = tl.arange(0, BT)
    r = row0 + j
    real = r < R
    er = tl.load(ids + r, mask=real, other=0).to(tl.int32)
    earlier = (er[:, None] == er[None, :]) & (j[None, :] < j[:, None])
    dest = tl.gather(pad_start + before, er, 0) + tl.sum(earlier.to(tl.int32), 1)
    end = tl.gather(pad_start + counts, er, 0)                      # one past the expert's last row
    tl.store(sorted_rows + dest, r.to(tl.int64), mask=real)
    tl.store(block_expert + dest // BM, er.to(tl.int64), mask=real & (dest % BM == 0))
    k = tl.arange(0, BM)                                            # padding: end .. next multiple of BM
    pad = (real & (dest + 1 == end))[:, None] & (k[None, :] < BM - 1 - dest[:, None] % BM)
    tl.store(sorted_rows + dest[:, None] + 1 + k[None, :], tl.full([BT, BM], 0, tl.int64) + R, mask=pad)

    CH: tl.constexpr = BCAP // NB
    c = pid * CH + tl.arange(0, CH)
    tl.store(sorted_rows + c, tl.full([CH], 0, tl.int64) + R, mask=(c >= pad_total) & (c < cap))
    CB: tl.constexpr = BCAP // BM // NB if BCAP // BM >= NB else 1
    b = pid * CB + tl.arange(0, CB)
    tl.store(block_expert + b, tl.full([CB], -1, tl.int64), mask=(b >= pad_total // BM) & (b < cap // BM))


def _tiles(rows_per_expert: float, mxfp4: bool = False) -> dict:
    """Tiles for ``rows_per_expert`` (tokens x top-k / experts) on average. MXFP4 weights are dequantized
    once per BM rows of an expert, so from 17 rows an expert they take 64-row tiles, which hold most
    experts' rows whole: H200 at 32 rows an expert (K3 slice shapes, 128 tokens; bench_moe.py, 2d76027)
    1.011 ms against 1.181 for 32-row and 1.255 for 16-row tiles."""
    if rows_per_expert <= 16:
        return dict(BM=16, BN1=64, BN2=64, BKH=64, warps=4, stages=3)
    if rows_per_expert <= 64:
        return dict(BM=64 if mxfp4 else 32, BN1=64, BN2=64, BKH=64, warps=4, stages=3)
    if rows_per_expert <= 256:
        return dict(BM=64, BN1=64, BN2=128, BKH=32, warps=4, stages=3)
    return dict(BM=128, BN1=128, BN2=128, BKH=32, warps=8, stages=3)


def _wgmma_tiles(rows_per_expert: float) -> dict | None:
    """MXFP4 experts through ``moe_wgmma`` (weights as the register operand; on an sm_90 GPU, widths that
    fit): BT rows a block, 16 x warps weight rows a tile (gate/up: half of each), "two" tiles a program
    (default False), or None for the block kernels here (``KernelTuning.wgmma_experts`` off, or prefill sizes).
    H100, K3 slice shapes (64 experts, 3584 -> 3072, top-16; bench_moe.py --wgmma, ff201cc), against the
    block kernels: 1 token 0.132 against 0.186 ms (BT 8), 8 tokens 0.436 / 0.595 (BT 8), 32 tokens 0.490 /
    0.651 (BT 16), 128 tokens 0.732 / 1.011 (BT 64, two tiles)."""
    if not tuning().wgmma_experts or rows_per_expert > 48:
        return None
    if rows_per_expert <= 3:
        return dict(BT=8, warps=4)
    if rows_per_expert <= 10:
        return dict(BT=16, warps=4)
    return dict(BT=64, warps=4, two=True)




def _halves_of_one(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor | None:
    """[E, 2I, L] when w1 and w3 [E, I, L] (rows contiguous) are the first and second halves of one
    such tensor (``Experts.w13``), else None."""
    E, I, L = w1.shape
    if (w3.shape != w1.shape or w1.stride() != w3.stride() or w1.stride()[1:] != (L, 1) or w1.stride(0) != 2 * I * L
            or w3.data_ptr() != w1.data_ptr() + I * L * w1.element_size()):
        return None
    return torch.as_strided(w1, (E, 2 * I, L), w1.stride())


def pool_rows(block_expert: torch.Tensor, slots: torch.Tensor | None) -> torch.Tensor:
    """Blocks' expert ids -> their weight rows in an expert cache's pool (-1, a block past the end, stays)."""
    if slots is None:
        return block_expert
    return torch.where(block_expert >= 0, slots[block_expert.clamp_min(0)], block_expert)


def _gathered_dense(w1, w2, w3, slots):
    """Dense experts of a pool gathered into id order (prefill's library path reads whole experts); gate and
    up stay the halves of one tensor when they were, so the same gate | up GEMM runs."""
    w13 = _halves_of_one(w1, w3)
    if w13 is None:
        return w1[slots], w2[slots], w3[slots]
    w13 = w13[slots]
    I = w1.shape[1]
    return w13[:, :I], w2[slots], w13[:, I:]


def _grouped_mm_experts(x, w1, w2, w3, weights, ids, act_situ, beta, linear_beta) -> torch.Tensor:
    """Dense bf16 experts through ``torch._grouped_mm``: assignments sorted by expert (stable; group
    ends counted on the device, no host sync), gate and up GEMMs, our gating kernel, the down GEMM,
    then the fp32 combine kernel reading each (token, slot)'s row where the sort put it (no scatter back:
    at 8192 tokens that index_put took 0.7 ms of a 1.9 ms layer, ``results/profile_step_kl_7e8c19d.json``)."""
    from kimik3.ops.triton.activation import glu_triton
    top_k = ids.shape[1]
    order, counts = _expert_order(ids, w1.shape[0])
    offs = counts.cumsum(0, dtype=torch.int32)
    xs = x[order // top_k]
    w13 = _halves_of_one(w1, w3)
    if w13 is not None:             # gate | up as one GEMM: the gathered rows read once, one launch
        gate_up = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)      # [R, 2I]
        gate, up = gate_up[:, :w1.shape[1]], gate_up[:, w1.shape[1]:]
    else:
        gate = torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs)         # [R, I]
        up = torch._grouped_mm(xs, w3.transpose(1, 2), offs=offs)
    h = glu_triton(gate, up, act_situ, beta, linear_beta)
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)                   # [R, L], rows in expert order
    return _combine_expert_order(y, order, weights)


def _expert_order(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped-GEMM paths' sort: (order [R], the assignments sorted by expert, stable; counts [E] int64
    of each expert's assignments), on the device."""
    flat = ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    return torch.argsort(flat, stable=True), counts


def _combine(y: torch.Tensor, weights: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, L] in y's dtype: the fp32 combine (``_combine_kernel``) of expert rows y [R, L] with weights [T, k];
    row t k + j of y holds (token t, slot j), or row pos[t k + j] when ``pos`` is given."""
    L, (T, top_k) = y.shape[1], weights.shape
    out = torch.empty(T, L, dtype=y.dtype, device=y.device)
    BL = min(1024, triton.next_power_of_2(L))
    _combine_kernel[(T, triton.cdiv(L, BL))](y, weights.contiguous(), y if pos is None else pos, out, L, TOP_K=top_k,
                                             BL=BL, HAS_POS=pos is not None, **pdl(y))
    return out


def _combine_expert_order(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The fp32 combine of expert rows y [R, L] held in expert order (``order`` from ``_expert_order``)
    with weights [T, k]: the kernel reads each (token, slot)'s row where the sort put it -> [T, L] in y's dtype."""
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(y.shape[0], device=y.device))
    return _combine(y, weights, pos)




def _grouped_mm_mxfp4_experts(x, w1, w2, w3, weights, ids, act_situ, beta, linear_beta, high_scales,
                              slots: torch.Tensor | None = None) -> torch.Tensor:
    """MXFP4 experts (packed, scale pairs) through ``torch._grouped_mm``: assignments sorted by expert, then
    per chunk of experts (at most ``KernelTuning.mxfp4_dequant_chunk_bytes`` of bf16 gate | up weights) the chunk's
    weights dequantized exactly into scratch, gate | up as one grouped GEMM over the chunk's rows, our
    gating kernel, the down GEMM; then the fp32 combine as in ``_grouped_mm_experts``. The chunks' row
    ranges come to the host once (one synchronisation a call: eager prefill only, never in a graph)."""
    from kimik3.ops.triton.activation import glu_triton
    (w1p, w1s), (w2p, w2s), (w3p, w3s) = w1, w2, w3
    L = x.shape[1]
    E, I = (w1p.shape[0] if slots is None else slots.shape[0]), w1p.shape[1]
    top_k = ids.shape[1]
    order, counts = _expert_order(ids, E)
    ends = [0] + counts.cumsum(0).tolist()
    y = torch.empty(order.shape[0], L, dtype=x.dtype, device=x.device)     # rows in expert order
    per_chunk = max(1, tuning().mxfp4_dequant_chunk_bytes // (2 * I * L * 2))
    w13 = torch.empty(min(per_chunk, E), 2 * I, L, dtype=torch.bfloat16, device=x.device)
    wd = torch.empty(min(per_chunk, E), L, I, dtype=torch.bfloat16, device=x.device)
    for e0 in range(0, E, per_chunk):
        e1 = min(E, e0 + per_chunk)
        r0, r1 = ends[e0], ends[e1]
        if r0 == r1:
            continue
        n = e1 - e0
        rows = slice(e0, e1) if slots is None else slots[e0:e1]        # an expert cache: its pool rows
        dequantize_mxfp4(w1p[rows], w1s[rows], w13[:n, :I], high_scales)
        dequantize_mxfp4(w3p[rows], w3s[rows], w13[:n, I:], high_scales)
        dequantize_mxfp4(w2p[rows], w2s[rows], wd[:n], high_scales)
        offs = (counts[e0:e1].cumsum(0)).to(torch.int32)
        xs = x[order[r0:r1] // top_k]
        gate_up = torch._grouped_mm(xs, w13[:n].transpose(1, 2), offs=offs)                  # [r, 2I]
        h = glu_triton(gate_up[:, :I], gate_up[:, I:], act_situ, beta, linear_beta)
        y[r0:r1] = torch._grouped_mm(h, wd[:n].transpose(1, 2), offs=offs)                   # [r, L]
    return _combine_expert_order(y, order, weights)


def _wgmma_experts(x: torch.Tensor, w1, w2, w3, weights: torch.Tensor, ids: torch.Tensor, act_situ: bool, beta: float,
                  linear_beta: float | None, high_scales: bool, BT: int, warps: int, two: bool = False,
                  slots: torch.Tensor | None = None) -> torch.Tensor:
    """``fused_moe_triton`` for MXFP4 experts through ``moe_wgmma``'s kernels (``wgmma_fits`` holds): the
    assignments sorted by expert in blocks of BT, the products (``moe_wgmma.expert_products``), then the fp32
    combine."""
    from kimik3.ops.triton.moe_wgmma import expert_products
    sorted_rows, block_expert = _sort_by_expert(ids, w1[0].shape[0] if slots is None else slots.shape[0], BT)
    block_expert = pool_rows(block_expert, slots)
    y = expert_products(x, w1, w2, w3, sorted_rows, block_expert, ids.shape[1], act_situ, beta, linear_beta,
                        high_scales, BT, warps, two)
    return _combine(y, weights)


def fused_moe_triton(x: torch.Tensor, w1, w2, w3, weights: torch.Tensor, ids: torch.Tensor, act_situ: bool,
                     beta: float, linear_beta: float | None, high_scales: bool = True,
                     tiles: dict | None = None, slots: torch.Tensor | None = None,
                     act_group: int | None = None) -> torch.Tensor:
    """x [T, L] bf16 or fp16; weights [T, k] fp32; ids [T, k]. Returns [T, L] in x's dtype.
    slots [E] (an expert cache's pool, ``kimik3.model.expert_offload``): expert e's weights are row slots[e]
    of w1/w2/w3, which may hold more rows than E. The assignments are sorted by expert id as without it
    (same blocks, same tiles) and only the blocks' weight rows are looked up, so the result is the stacked
    experts' bit for bit; the library paths (prefill) gather the rows they read.
    Dense experts: w1, w3 [E, I, L], w2 [E, L, I] in x's dtype. MXFP4 experts (bf16 x): each of
    w1, w3 = (packed [E, I, L/2], scale [E, I, L/32]), w2 = (packed [E, L, I/2], scale [E, L, I/32]).
    FP8 experts (bf16 / fp16 x): w1, w3 = (E4M3 codes [E, I, L], float32 channel scales [E, I]), w2 =
    (codes [E, L, I], scales [E, L]).
    act_group: the activations quantised on the fly to E4M3 per row and this many columns with power-of-two
    scales, the products on the FP8 tensor cores (``moe_fp8``): 128 with FP8 experts (None: their weights
    widened to x's dtype), 32 (MXFP8) with MXFP4 experts (W4A8: the weights expanded to E4M3); None with
    MXFP4 experts: bf16 products.
    high_scales: some E8M0 scale may exceed 128 (the dequantization takes two multiplies; False is
    only valid when every scale is <= 128). One token with dense experts (``KernelTuning.one_token_gemv``): two streaming
    launches (``kimik3.ops.triton.gemv.one_token_experts``). tiles: override the tile choice (benchmarks; with
    "asm": False the fp16-placement dequantization runs on CUDA too, for comparison; "one_token": False
    aligns a single token's rows as any batch's, where by default its k distinct experts take a block
    each with no alignment launch); without it, dense
    bf16 experts with ``KernelTuning.grouped_mm_rows_per_expert`` rows per expert or more run as library grouped GEMMs, and
    MXFP4 ones (bf16 products) with ``mxfp4_grouped_mm_rows_per_expert`` or more too, dequantized a chunk at a
    time (outside CUDA-graph capture: the chunks' rows come to the host)."""
    packed = isinstance(w1, tuple)
    (w1p, w1s), (w2p, w2s), (w3p, w3s) = (w if packed else (w, w) for w in (w1, w2, w3))
    fmt = _check_expert_operands(x, w1p, w1s, packed, act_group)
    x = x.contiguous()
    E = w1p.shape[0] if slots is None else slots.shape[0]
    if fmt in (FP8.value, MXFP4_FP8.value):
        return _block_experts(x, (w1p, w1s), (w2p, w2s), (w3p, w3s), weights, ids, act_situ, beta, linear_beta,
                              high_scales, fmt, _fp8_tile_choice(ids.numel() / E, fmt, act_group, tiles), E, slots,
                              act_group is not None)
    library = None if tiles is not None else _library_path(x, w1p, w2p, ids, E, packed)
    if library == "one_token_gemv":
        rows = ids if slots is None else slots[ids]           # one token: its k experts, each on its own
        return one_token_experts(x, w1p, w2p, w3p, weights, rows, act_situ, beta, linear_beta)
    if library == "grouped_mm":
        if slots is not None:
            w1p, w2p, w3p = _gathered_dense(w1p, w2p, w3p, slots)
        return _grouped_mm_experts(x, w1p, w2p, w3p, weights, ids, act_situ, beta, linear_beta)
    if library == "grouped_mm_mxfp4":
        return _grouped_mm_mxfp4_experts(x, w1, w2, w3, weights, ids, act_situ, beta, linear_beta, high_scales,
                                         slots)
    wg = _wgmma_choice(x, w1, w2, w3, ids.numel() / E, tiles) if packed else None
    if wg is not None:
        return _wgmma_experts(x, w1, w2, w3, weights, ids, act_situ, beta, linear_beta, high_scales,
                              wg["BT"], wg["warps"], wg.get("two", False), slots)
    return _block_experts(x, (w1p, w1s), (w2p, w2s), (w3p, w3s), weights, ids, act_situ, beta, linear_beta,
                          high_scales, fmt, tiles or _tiles(ids.numel() / E, packed), E, slots)


def _check_expert_operands(x: torch.Tensor, w1p: torch.Tensor, w1s: torch.Tensor, packed: bool,
                           act_group: int | None) -> int:
    """The dtypes, widths and activation groups the expert kernels take (an error naming what they got);
    returns the weight format (``DENSE`` ... ``MXFP4_FP8``)."""
    L, I = x.shape[1], w1p.shape[1]
    fp8 = packed and w1p.dtype == torch.float8_e4m3fn
    if fp8:
        if x.dtype not in (torch.bfloat16, torch.float16) or w1s.dtype != torch.float32 or w1s.dim() != 2:
            raise ValueError(f"the FP8 expert kernels take bf16/fp16 activations and float32 channel scales [E, N], "
                             f"got {x.dtype} activations and {w1s.dtype} {tuple(w1s.shape)} scales")
        if act_group not in (None, FP8_ACT_GROUP):
            raise ValueError(f"FP8 experts quantise their activations per {FP8_ACT_GROUP} columns (or not), "
                             f"got act_group={act_group}")
    elif packed:
        if x.dtype != torch.bfloat16:
            raise ValueError(f"the MXFP4 expert kernels take bf16 activations, got {x.dtype}")
        if act_group not in (None, MX_ACT_GROUP):
            raise ValueError(f"MXFP4 experts take MXFP8 activations (act_group={MX_ACT_GROUP}) or bf16 ones (None), "
                             f"got act_group={act_group}")
        return MXFP4.value if act_group is None else MXFP4_FP8.value
    elif act_group is not None:
        raise ValueError("dense experts take their activations as they are (act_group must be None)")
    if L % 2 or I % 2:
        raise ValueError(f"the dense and FP8 expert kernels need even widths, got L={L}, I={I}")
    if not packed and (x.dtype not in (torch.bfloat16, torch.float16) or w1p.dtype != x.dtype):
        raise ValueError(f"the dense expert kernels take bf16/fp16 activations and weights of the same dtype, "
                         f"got {x.dtype} activations and {w1p.dtype} weights")
    return FP8.value if fp8 else DENSE.value


FP8_ACT_GROUP = 128       # FP8 experts' activations: one power-of-two scale per row and 128 columns (a K step)
MX_ACT_GROUP = 32         # W4A8: MXFP8 activations, one E8M0 scale per 32 (a K step: one MXFP4 scale group)


def _fp8_tile_choice(rows_per_expert: float, fmt: int, act_group: int | None, tiles: dict | None) -> dict:
    """Tiles of the FP8 kernels (a benchmark's ``tiles`` checked): with quantised activations a K step is one
    activation group (BKH = group / 2) and a tile at least 16 rows (the FP8 tensor cores' M); the FP8 experts'
    decode (weights widened) takes the dense tiles."""
    if act_group is None:
        cfg = tiles or _tiles(rows_per_expert)
    elif tiles is not None:
        cfg = tiles
    elif rows_per_expert <= 64:
        cfg = dict(BM=64, BN1=64, BN2=128, BKH=act_group // 2, warps=4, stages=4)
    else:
        cfg = dict(BM=128, BN1=128, BN2=128, BKH=act_group // 2, warps=8, stages=4 if fmt == MXFP4_FP8.value else 3)
    if act_group is not None and (cfg["BKH"] != act_group // 2 or cfg["BM"] < 16):
        raise ValueError(f"tiles {cfg}: activations quantised per {act_group} columns need BKH = {act_group // 2} "
                         f"(one group a K step) and BM >= 16")
    return cfg


def _library_path(x: torch.Tensor, w1p: torch.Tensor, w2p: torch.Tensor, ids: torch.Tensor, E: int,
                  packed: bool) -> str | None:
    """Which path outside the block kernels takes these E experts by ``KernelTuning``'s measured
    thresholds: "one_token_gemv" (one token, dense), "grouped_mm" (dense bf16, many rows an expert),
    "grouped_mm_mxfp4" (MXFP4, prefill sizes, not while capturing a graph), or None (the kernels here)."""
    tune = tuning()
    T, top_k = ids.shape
    if packed:
        if (T * top_k >= tune.mxfp4_grouped_mm_rows_per_expert * E
                and not (x.is_cuda and torch.cuda.is_current_stream_capturing())):
            return "grouped_mm_mxfp4"
        return None
    if T == 1 and tune.one_token_gemv and w1p.stride(2) == 1 and w2p.stride(2) == 1:
        return "one_token_gemv"
    if x.dtype == torch.bfloat16 and T * top_k >= tune.grouped_mm_rows_per_expert * E:
        return "grouped_mm"
    return None


def _wgmma_choice(x: torch.Tensor, w1, w2, w3, rows_per_expert: float, tiles: dict | None) -> dict | None:
    """The ``moe_wgmma`` tiles MXFP4 experts run with, or None for the block kernels: the tiles
    ``_wgmma_tiles`` picks (or a benchmark's ``tiles`` naming BT) where ``wgmma_fits`` holds."""
    if tiles is None:
        wg = _wgmma_tiles(rows_per_expert)
    else:
        wg = tiles if "BT" in tiles else None
    if wg is None:
        return None
    from kimik3.ops.triton import moe_wgmma
    if moe_wgmma.wgmma_fits(x, w1, w2, w3, wg["warps"], wg.get("two", False)):
        return wg
    if tiles is not None:
        raise ValueError(f"the wgmma expert kernels cannot take these experts (tiles {tiles})")
    return None


def _block_experts(x: torch.Tensor, w1, w2, w3, weights: torch.Tensor, ids: torch.Tensor, act_situ: bool,
                   beta: float, linear_beta: float | None, high_scales: bool, fmt: int, cfg: dict, E: int,
                   slots: torch.Tensor | None, act_q: bool = False) -> torch.Tensor:
    """The block kernels here (gate/up, down, combine) at tiles ``cfg`` for E experts (rows ``slots`` of the
    weights when given); w1, w2, w3 (packed or codes, scale) pairs (a dense weight twice); ``fmt`` the weight
    format; ``act_q``: the activations quantised per K step (``moe_fp8.act_tile``)."""
    (w1p, w1s), (w2p, w2s), (w3p, w3s) = w1, w2, w3
    T, L = x.shape
    I = w1p.shape[1]
    top_k = ids.shape[1]
    BM = cfg["BM"]
    R = T * top_k
    one_token = T == 1 and cfg.get("one_token", True)          # one token: its top-k experts are distinct
    if one_token:               # block b = assignment b: no alignment launch (the kernels derive the rows)
        block_expert, sorted_rows, nb = ids.reshape(-1), ids, R
    else:
        sorted_rows, block_expert = _sort_by_expert(ids, E, BM)
        nb = block_expert.shape[0]
    block_expert = pool_rows(block_expert, slots)
    h = torch.empty(nb * BM, I, dtype=x.dtype, device=x.device)
    common = dict(BM=BM, BKH=cfg["BKH"], UPCAST=INTERPRETING, FMT=fmt, ASM=cfg.get("asm", not INTERPRETING),
                  HIGH_SCALES=high_scales, ONE_TOKEN=one_token, ACT_Q=act_q, EMULATE=INTERPRETING,
                  num_warps=cfg["warps"], num_stages=cfg["stages"])
    _gate_up_kernel[(nb, triton.cdiv(I, cfg["BN1"]))](
        x, w1p, w1s, w3p, w3s, h, sorted_rows, block_expert, R, I, L // 2,
        x.stride(0), w1p.stride(0), w1p.stride(1), w1s.stride(0), w1s.stride(1), h.stride(0),
        float(beta), float(linear_beta or 1.0), TOP_K=top_k, ACT_SITU=act_situ, CLIP_UP=linear_beta is not None,
        BN=cfg["BN1"], **common, **pdl(x))
    y = torch.empty(R, L, dtype=x.dtype, device=x.device)
    _down_kernel[(nb, triton.cdiv(L, cfg["BN2"]))](
        h, w2p, w2s, y, sorted_rows, block_expert, R, L, I // 2,
        h.stride(0), w2p.stride(0), w2p.stride(1), w2s.stride(0), w2s.stride(1), y.stride(0),
        BN=cfg["BN2"], **common, **pdl(h))
    return _combine(y, weights)
