"""Routed experts from MXFP4 weights: grouped W4A16 GEMMs that dequantize in the kernel.

The (token, expert) assignments are sorted by expert and each expert's rows padded to a multiple
of BM, so one program of a GEMM works on BM rows of a single expert.
  1. gate/up: h = act(x W1_e^T, x W3_e^T) (SITU or SiLU fused in the epilogue), rows in sorted order;
  2. down:    y_r = h W2_e^T, written per assignment r = t * top_k + j (bf16, unweighted);
  3. combine: out_t = sum_j weights[t, j] * y_{t*top_k+j} in fp32, one rounding.
Weights stay packed: uint8 [E, N, K/2] (element 2i in the low nibble of byte i) and E8M0 scales
uint8 [E, N, K/32]; each K-step loads its bytes along the contiguous axis, expands them to a bf16
[BN, BK] tile in registers (fp16 bit trick, one fp32 multiply) and feeds the tensor cores.
Reference: ``kimik3.ops.moe.fused_moe_mxfp4``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimik3.ops.triton.common import INTERPRETING, dot


@triton.jit
def _dequant_tile(packed_ptr, scale_ptr, kh, KH, mn, BN: tl.constexpr, BKH: tl.constexpr):
    """Packed bytes kh..kh+BKH of BN rows -> bf16 weights [BN, 2*BKH] in element order.

    A nibble's magnitude bits (e1 e0 m) placed at fp16 bits 11..9 (sign at 15) read as that
    E2M1 value times 2**-14 (code 1 lands on the fp16 subnormal 2**-15, which the fp16 -> fp32
    conversion keeps exact); one fp32 multiply by 2**(scale - 113) per element then applies the
    E8M0 scale and the 2**14 (valid for scale <= 240, i.e. |w| < 2**114)."""
    kk = kh + tl.arange(0, BKH)
    mask = mn[:, None] & (kk < KH)[None, :]
    b = tl.load(packed_ptr + kk[None, :], mask=mask, other=0).to(tl.uint16)
    lo = (((b & 0x07) << 9) | ((b & 0x08) << 12)).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True).to(tl.float32)
    G: tl.constexpr = BKH // 16                      # 16 packed bytes (32 elements) share a scale
    grp = kh // 16 + tl.arange(0, G)
    sc = tl.load(scale_ptr + grp[None, :], mask=mn[:, None] & (grp < KH // 16)[None, :], other=113).to(tl.int32)
    factor = ((sc + 14) << 23).to(tl.float32, bitcast=True)                              # [BN, G]
    factor = tl.reshape(tl.broadcast_to(factor[:, :, None], (BN, G, 16)), (BN, BKH))
    w = tl.join(lo * factor, hi * factor)                                               # [BN, BKH, 2]
    return tl.reshape(w, (BN, 2 * BKH)).to(tl.bfloat16)


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _gate_up_kernel(x, w1p, w1s, w3p, w3s, h, sorted_rows, block_expert, num_rows, I, KH,
                    stride_x, stride_wp_e, stride_wp_n, stride_ws_e, stride_ws_n, stride_h,
                    beta, linear_beta, TOP_K: tl.constexpr, ACT_SITU: tl.constexpr, CLIP_UP: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr, UPCAST: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert + pid_m).to(tl.int64)
    if e < 0:
        return
    offs_m = pid_m * BM + tl.arange(0, BM)
    rows = tl.load(sorted_rows + offs_m)
    valid = rows < num_rows
    tok = (rows // TOP_K).to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)
    mn = n < I
    kcol = tl.arange(0, 2 * BKH)
    col1 = w1p + e * stride_wp_e + n[:, None].to(tl.int64) * stride_wp_n
    col3 = w3p + e * stride_wp_e + n[:, None].to(tl.int64) * stride_wp_n
    scl1 = w1s + e * stride_ws_e + n[:, None].to(tl.int64) * stride_ws_n
    scl3 = w3s + e * stride_ws_e + n[:, None].to(tl.int64) * stride_ws_n
    acc1 = tl.zeros([BM, BN], dtype=tl.float32)
    acc3 = tl.zeros([BM, BN], dtype=tl.float32)
    for kh in range(0, KH, BKH):
        kx = 2 * kh + kcol
        a = tl.load(x + tok[:, None] * stride_x + kx[None, :], mask=valid[:, None] & (kx < 2 * KH)[None, :],
                    other=0.0)
        acc1 = dot(a, tl.trans(_dequant_tile(col1, scl1, kh, KH, mn, BN, BKH)), acc1, UPCAST)
        acc3 = dot(a, tl.trans(_dequant_tile(col3, scl3, kh, KH, mn, BN, BKH)), acc3, UPCAST)
    # the reference rounds both projections to the activation dtype before the activation
    g = acc1.to(h.dtype.element_ty).to(tl.float32)
    u = acc3.to(h.dtype.element_ty).to(tl.float32)
    if ACT_SITU:
        gated = beta * _tanh(g / beta) * tl.sigmoid(g)
    else:
        gated = g * tl.sigmoid(g)
    if CLIP_UP:
        u = linear_beta * _tanh(u / linear_beta)
    out = (gated * u).to(h.dtype.element_ty)
    tl.store(h + offs_m[:, None].to(tl.int64) * stride_h + n[None, :], out, mask=mn[None, :])


@triton.jit
def _down_kernel(h, w2p, w2s, y, sorted_rows, block_expert, num_rows, L, KH,
                 stride_h, stride_wp_e, stride_wp_n, stride_ws_e, stride_ws_n, stride_y,
                 BM: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr, UPCAST: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert + pid_m).to(tl.int64)
    if e < 0:
        return
    offs_m = pid_m * BM + tl.arange(0, BM)
    rows = tl.load(sorted_rows + offs_m)
    valid = rows < num_rows
    n = pid_n * BN + tl.arange(0, BN)
    mn = n < L
    kcol = tl.arange(0, 2 * BKH)
    col = w2p + e * stride_wp_e + n[:, None].to(tl.int64) * stride_wp_n
    scl = w2s + e * stride_ws_e + n[:, None].to(tl.int64) * stride_ws_n
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kh in range(0, KH, BKH):
        kx = 2 * kh + kcol
        a = tl.load(h + offs_m[:, None].to(tl.int64) * stride_h + kx[None, :], mask=(kx < 2 * KH)[None, :], other=0.0)
        acc = dot(a, tl.trans(_dequant_tile(col, scl, kh, KH, mn, BN, BKH)), acc, UPCAST)
    tl.store(y + rows[:, None].to(tl.int64) * stride_y + n[None, :], acc.to(y.dtype.element_ty),
             mask=valid[:, None] & mn[None, :])


@triton.jit
def _combine_kernel(y, weights, out, L, TOP_K: tl.constexpr, BL: tl.constexpr):
    t, pid = tl.program_id(0).to(tl.int64), tl.program_id(1)
    c = pid * BL + tl.arange(0, BL)
    mc = c < L
    acc = tl.zeros([BL], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        w = tl.load(weights + t * TOP_K + j).to(tl.float32)
        acc += w * tl.load(y + (t * TOP_K + j) * L + c, mask=mc, other=0.0).to(tl.float32)
    tl.store(out + t * L + c, acc.to(out.dtype.element_ty), mask=mc)


def _sort_by_expert(ids: torch.Tensor, num_experts: int, BM: int):
    """Assignment rows grouped by expert, each group padded to a multiple of BM (no host sync).
    Returns sorted_rows [cap] (pad entries hold R = number of assignments) and block_expert
    [cap / BM] (-1 for blocks past the end)."""
    flat = ids.reshape(-1)
    R = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + BM - 1) // BM * BM
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(R, device=dev) - (counts.cumsum(0) - counts)[experts]
    cap = R + min(num_experts, R) * (BM - 1)
    cap = (cap + BM - 1) // BM * BM
    sorted_rows = torch.full((cap,), R, dtype=torch.int64, device=dev)
    sorted_rows[pad_start[experts] + rank] = order
    block_expert = torch.searchsorted(pad_end, torch.arange(0, cap, BM, device=dev), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_rows, block_expert


def _tiles(rows_per_expert: float) -> dict:
    if rows_per_expert <= 16:
        return dict(BM=16, BN1=64, BN2=64, BKH=64, warps=4, stages=3)
    if rows_per_expert <= 64:
        return dict(BM=32, BN1=64, BN2=64, BKH=64, warps=4, stages=3)
    if rows_per_expert <= 256:
        return dict(BM=64, BN1=64, BN2=128, BKH=32, warps=4, stages=3)
    return dict(BM=128, BN1=64, BN2=128, BKH=32, warps=8, stages=3)


def fused_moe_mxfp4_triton(x: torch.Tensor, w1: tuple, w2: tuple, w3: tuple, weights: torch.Tensor,
                           ids: torch.Tensor, act_situ: bool, beta: float, linear_beta: float | None) -> torch.Tensor:
    """x [T, L] bf16; w1, w3 = (packed [E, I, L/2], scale [E, I, L/32]); w2 = (packed [E, L, I/2],
    scale [E, L, I/32]); weights [T, k] fp32; ids [T, k]. Returns [T, L] in x's dtype."""
    T, L = x.shape
    E, I = w1[0].shape[0], w1[0].shape[1]
    top_k = ids.shape[1]
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the MXFP4 expert kernels take bf16 activations, got {x.dtype}")
    x = x.contiguous()
    cfg = _tiles(T * top_k / E)
    BM = cfg["BM"]
    sorted_rows, block_expert = _sort_by_expert(ids, E, BM)
    nb = block_expert.shape[0]
    R = T * top_k
    h = torch.empty(sorted_rows.shape[0], I, dtype=x.dtype, device=x.device)
    w1p, w1s = w1
    w3p, w3s = w3
    _gate_up_kernel[(nb, triton.cdiv(I, cfg["BN1"]))](
        x, w1p, w1s, w3p, w3s, h, sorted_rows, block_expert, R, I, L // 2,
        x.stride(0), w1p.stride(0), w1p.stride(1), w1s.stride(0), w1s.stride(1), h.stride(0),
        float(beta), float(linear_beta or 1.0), TOP_K=top_k, ACT_SITU=act_situ, CLIP_UP=linear_beta is not None,
        BM=BM, BN=cfg["BN1"], BKH=cfg["BKH"], UPCAST=INTERPRETING, num_warps=cfg["warps"], num_stages=cfg["stages"])
    y = torch.empty(R, L, dtype=x.dtype, device=x.device)
    w2p, w2s = w2
    _down_kernel[(nb, triton.cdiv(L, cfg["BN2"]))](
        h, w2p, w2s, y, sorted_rows, block_expert, R, L, I // 2,
        h.stride(0), w2p.stride(0), w2p.stride(1), w2s.stride(0), w2s.stride(1), y.stride(0),
        BM=BM, BN=cfg["BN2"], BKH=cfg["BKH"], UPCAST=INTERPRETING, num_warps=cfg["warps"], num_stages=cfg["stages"])
    out = torch.empty(T, L, dtype=x.dtype, device=x.device)
    BL = min(1024, triton.next_power_of_2(L))
    _combine_kernel[(T, triton.cdiv(L, BL))](y, weights.contiguous(), out, L, TOP_K=top_k, BL=BL)
    return out
