"""FP8 weights times bf16/fp16 activations: y [M, N] = x [M, K] @ W^T with W = codes [N, K] (E4M3) times
its scale, per output channel ([N]) or per 128 x 128 block ([ceil(N / 128), ceil(K / 128)]).

One kernel, two modes. Decode (few rows, ``QUANT_A`` off): the activations stay as they are; each
weight tile's codes are widened to the activations' dtype (exact: every E4M3 value is a bf16 / fp16
value), multiplied on the tensor cores in fp32, and the weight's scale applied per 128-column block
of K (or once, per channel, at the end): a streaming read of one byte per weight. Prefill (``QUANT_A``):
the activations come as E4M3 codes with a float32 scale per token and 128 columns
(``kimik3.ops.fp8.quantize_activations``), both operands go to the FP8 tensor cores, and each K
block's product is scaled by its two scales before it joins the fp32 sum (the block-FP8 GEMM).
Reference: ``kimik3.ops.linear.fp8_linear`` on the CPU (the same numbers by e4m3 round trips).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kimik3.ops.fp8 import WEIGHT_BLOCK
from kimik3.ops.triton.common import INTERPRETING, dot, pdl, pdl_entry


@triton.jit
def _fp8_matmul_kernel(a, sa, b, sb, c, M, N, K, stride_am, stride_sam, stride_sak, stride_bn, stride_sbn, stride_cm,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, QUANT_A: tl.constexpr,
                       BLOCKED: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr):
    """Program (m block, n block): c[BM, BN] = sum over K blocks of a b^T, scaled. BLOCKED: sb [N / 128,
    K / 128] (BK = 128: one scale a K block); else sb [N], applied at the end. QUANT_A: a is E4M3 with sa
    [M, K / 128] (BK = 128), or [M, 1] per token (stride_sak 0)."""
    pdl_entry(PDL)
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mm, mn = rm < M, rn < N
    a_rows = a + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
    b_rows = b + rn[:, None].to(tl.int64) * stride_bn + rk[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        mk = (k0 + rk) < K
        at = tl.load(a_rows + k0, mask=mm[:, None] & mk[None, :], other=0.0)
        bt = tl.load(b_rows + k0, mask=mn[:, None] & mk[None, :], other=0.0)
        if not QUANT_A:
            bt = bt.to(at.dtype)                       # E4M3 -> the activations' dtype, exactly
        part = dot(at, tl.trans(bt), tl.zeros([BM, BN], tl.float32), UPCAST)
        if QUANT_A:
            part = part * tl.load(sa + rm * stride_sam + (k0 // BK) * stride_sak, mask=mm, other=0.0)[:, None]
        if BLOCKED:
            part = part * tl.load(sb + (rn // 128) * stride_sbn + k0 // 128, mask=mn, other=0.0)[None, :]
        acc += part
    if not BLOCKED:
        acc = acc * tl.load(sb + rn, mask=mn, other=0.0)[None, :]
    tl.store(c + rm[:, None].to(tl.int64) * stride_cm + rn[None, :], acc.to(c.dtype.element_ty),
             mask=mm[:, None] & mn[None, :])


@dataclass(frozen=True)
class Fp8Tiles:
    """One launch's tiles: rows, columns, K step (128 when a scale changes every 128 columns), warps, stages."""
    bm: int
    bn: int
    bk: int
    num_warps: int
    num_stages: int


def tiles_for(M: int, quant_a: bool) -> Fp8Tiles:
    """Decode rows: 16-row tiles over 64 columns (many programs stream the weight); prefill: 128 x 128."""
    if quant_a:
        return Fp8Tiles(128, 128, WEIGHT_BLOCK, 8, 3)
    return Fp8Tiles(16, 64, WEIGHT_BLOCK, 4, 4)


def fp8_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
               x_scale: torch.Tensor | None = None, tiles: Fp8Tiles | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16; or E4M3 codes with ``x_scale`` [M, ceil(K / 128)]) @ (codes [N, K] E4M3 times
    ``scale``: [N] per channel or [ceil(N / 128), ceil(K / 128)] per block)^T -> [M, N] in ``out_dtype``;
    ``x_scale`` may also be [M, 1] (one scale a token)."""
    M, K = x.shape
    N = codes.shape[0]
    blocked = scale.dim() == 2
    quant_a = x_scale is not None
    if codes.shape[1] != K or codes.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32 or \
            (blocked and scale.shape != (-(-N // 128), -(-K // 128))) or (not blocked and scale.shape != (N,)) or \
            (quant_a and (x.dtype != torch.float8_e4m3fn or x_scale.shape not in ((M, -(-K // 128)), (M, 1)))) or \
            x.stride(-1) != 1 or codes.stride(-1) != 1:
        raise ValueError(f"fp8_matmul: x {x.dtype} {tuple(x.shape)}, weight {codes.dtype} {tuple(codes.shape)}, scale "
                         f"{scale.dtype} {tuple(scale.shape)}, x_scale {None if x_scale is None else tuple(x_scale.shape)}"
                         f" do not match (E4M3 weight [N, K], float32 scale [N] or [N/128, K/128], unit K stride)")
    t = tiles or tiles_for(M, quant_a)
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    sa = x_scale if quant_a else scale
    _fp8_matmul_kernel[(triton.cdiv(M, t.bm), triton.cdiv(N, t.bn))](
        x, sa, codes, scale, y, M, N, K, x.stride(0), sa.stride(0) if quant_a else 0,
        sa.stride(1) if quant_a and sa.shape[1] > 1 else 0, codes.stride(0),
        scale.stride(0) if blocked else 1, y.stride(0), BM=t.bm, BN=t.bn, BK=t.bk, QUANT_A=quant_a, BLOCKED=blocked,
        UPCAST=INTERPRETING, num_warps=t.num_warps, num_stages=t.num_stages, **pdl(x))
    return y
