"""Decode-sized projections: y [M, N] = x [M, K] @ w [N, K]^T for a few rows M, as a streaming read of w.

At decode sizes a projection is a read of its weight; the library's tiles for M of 1-8 leave part of
the GPU idle on some shapes or add a split-K reduction launch (a few us on 5-20 MB weights). Here
program p owns BN output columns (BN whole rows of w, read once, K contiguous) and all M rows of x,
and keeps a [BM, BN, BK] fp32 partial product across its K loop, summed over BK once at the end: no
split-K, no second launch, no shuffles inside the loop. Products and sums in fp32, one rounding.
Reference: ``torch.nn.functional.linear`` (``kimik3.ops.linear``).

One token's routed experts (dense weights) are the same read: ``one_token_experts`` runs the gate/up
product of each of its k experts as a GLU program row (program axis 1: the assignment, its expert's
rows located from ``ids``), then one launch in which each program owns BN output columns, reads them
from each of the k down-projections in turn and sums the k rounded outputs with their fp32 routing
weights (the combine: one rounding, the expert order of the combine kernel). Reference:
``kimik3.ops.moe.fused_moe``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kimik3.ops.triton import common
from kimik3.ops.triton.common import glu, pdl, pdl_entry, prefetch_l2


@triton.jit
def _gemv_kernel(x, w, w_up, y, ids, M, N, K, stride_x, stride_w, stride_we, stride_y, beta, linear_beta,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr,
                 GLU: tl.constexpr, SITU: tl.constexpr, CLIP_UP: tl.constexpr, EXPERTS: tl.constexpr,
                 STAGES: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr):
    """GLU: ``w`` holds the gate rows and ``w_up`` the up rows ([N, K] each, row stride ``stride_w``); the
    program's columns n of both give y = act(gate, up) [M, N], each product rounded to y's dtype before
    the activation (as the two-launch form rounds them). EXPERTS: program axis 1 is assignment j of one
    token (x row 0): w and w_up start ``ids[j]`` experts (``stride_we`` elements each) in, y at row j.
    PREFETCH (PDL, not EXPERTS; a power of two): the first PREFETCH 128-byte lines of each of the program's
    weight rows asked of L2 before waiting for the previous kernel."""
    if PREFETCH:
        rows = tl.minimum(tl.program_id(0) * BN + tl.arange(0, BN), N - 1).to(tl.int64) * stride_w
        lines = rows[:, None] + tl.arange(0, PREFETCH)[None, :] * (128 // (w.dtype.element_ty.primitive_bitwidth // 8))
        prefetch_l2(w + lines)
        if GLU:
            prefetch_l2(w_up + lines)
    pdl_entry(PDL)
    if EXPERTS:
        j = tl.program_id(1)
        e = tl.load(ids + j).to(tl.int64)
        w += e * stride_we
        w_up += e * stride_we
        y += j.to(tl.int64) * stride_y
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    mm, mn = m < M, n < N
    kk = tl.arange(0, BK)
    w_rows = w + n[:, None].to(tl.int64) * stride_w + kk[None, :]                     # [BN, BK]
    up_rows = w_up + n[:, None].to(tl.int64) * stride_w + kk[None, :]                 # GLU: the up rows
    x_rows = x + m[:, None].to(tl.int64) * stride_x + kk[None, :]                     # [BM, BK]
    acc = tl.zeros([BM, BN, BK], tl.float32)
    acc_up = tl.zeros([BM, BN, BK] if GLU else [1, 1, 1], tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        if EVEN:       # N % BN == 0 and K % BK == 0
            xt = tl.load(x_rows + k0, mask=mm[:, None], other=0.0).to(tl.float32)[:, None, :]
            acc += xt * tl.load(w_rows + k0).to(tl.float32)[None, :, :]
            if GLU:
                acc_up += xt * tl.load(up_rows + k0).to(tl.float32)[None, :, :]
        else:
            mk = (k0 + kk) < K
            xt = tl.load(x_rows + k0, mask=mm[:, None] & mk[None, :], other=0.0).to(tl.float32)[:, None, :]
            acc += xt * tl.load(w_rows + k0, mask=mn[:, None] & mk[None, :], other=0.0).to(tl.float32)[None, :, :]
            if GLU:
                acc_up += xt * tl.load(up_rows + k0, mask=mn[:, None] & mk[None, :], other=0.0).to(tl.float32)[None, :, :]
    out = tl.sum(acc, 2)                                                                 # [BM, BN]
    if GLU:
        g = out.to(y.dtype.element_ty).to(tl.float32)
        u = tl.sum(acc_up, 2).to(y.dtype.element_ty).to(tl.float32)
        out = glu(g, u, beta, linear_beta, SITU, CLIP_UP)
    # rounded to x's dtype, then stored as y's (a wider y: the rounded product converted, exactly)
    tl.store(y + m[:, None].to(tl.int64) * stride_y + n[None, :], out.to(x.dtype.element_ty).to(y.dtype.element_ty),
             mask=mm[:, None] & mn[None, :])


@triton.jit
def _combine_step(h_row, w_rows, k0, K, kk, mn, acc, EVEN: tl.constexpr):
    """One K step of an expert's down-projection in ``_gemv_combine_kernel``: [BN, BK] partial products."""
    if EVEN:           # N % BN == 0 and K % BK == 0
        acc += tl.load(h_row + k0).to(tl.float32)[None, :] * tl.load(w_rows + k0).to(tl.float32)
    else:
        mk = (k0 + kk) < K
        ht = tl.load(h_row + k0, mask=mk, other=0.0).to(tl.float32)
        acc += ht[None, :] * tl.load(w_rows + k0, mask=mn[:, None] & mk[None, :], other=0.0).to(tl.float32)
    return acc


@triton.jit
def _combine_expert(h, w, ids, weights, j, n, mn, kk, K, stride_h, stride_w, stride_we, total, out_ty,
                    BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr,
                    UNROLL: tl.constexpr, KC: tl.constexpr):
    """total + weights[j] round(h[j] . w[ids[j], n]) for the program's BN columns n."""
    e = tl.load(ids + j).to(tl.int64)
    w_rows = w + e * stride_we + n[:, None].to(tl.int64) * stride_w + kk[None, :]         # [BN, BK]
    h_row = h + j * stride_h + kk
    acc = tl.zeros([BN, BK], tl.float32)
    if UNROLL:
        for k0 in tl.static_range(0, KC, BK):
            acc = _combine_step(h_row, w_rows, k0, K, kk, mn, acc, EVEN)
    else:
        for k0 in tl.range(0, K, BK, num_stages=STAGES):
            acc = _combine_step(h_row, w_rows, k0, K, kk, mn, acc, EVEN)
    out_j = tl.sum(acc, 1).to(out_ty).to(tl.float32)
    return total + tl.load(weights + j).to(tl.float32) * out_j


@triton.jit
def _gemv_combine_kernel(h, w, ids, weights, y, N, K, stride_h, stride_w, stride_we,
                         TOP_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr,
                         STAGES: tl.constexpr, PDL: tl.constexpr, UNROLL: tl.constexpr = False, KC: tl.constexpr = 0):
    """One token's down-projections and combine: y[n] = sum_j weights[j] round(h[j] . w[ids[j], n]) for the
    program's BN columns n, the k products in fp32 (each rounded to y's dtype, as the expert outputs
    are), summed in fp32 in expert order j, one rounding. UNROLL: the expert and K loops unrolled (KC == K),
    so later experts' loads may issue before earlier experts' sums."""
    pdl_entry(PDL)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    mn = n < N
    kk = tl.arange(0, BK)
    total = tl.zeros([BN], tl.float32)
    if UNROLL:
        for j in tl.static_range(TOP_K):
            total = _combine_expert(h, w, ids, weights, j, n, mn, kk, K, stride_h, stride_w, stride_we, total,
                                    y.dtype.element_ty, BN, BK, EVEN, STAGES, UNROLL, KC)
    else:
        for j in range(TOP_K):
            total = _combine_expert(h, w, ids, weights, j, n, mn, kk, K, stride_h, stride_w, stride_we, total,
                                    y.dtype.element_ty, BN, BK, EVEN, STAGES, UNROLL, KC)
    tl.store(y + n, total.to(y.dtype.element_ty), mask=mn)


@dataclass(frozen=True)
class GemvConfig:
    """Columns a program owns, K elements a loop step reads of each row, warps, pipeline stages; ``unroll``
    (the down-and-combine launch only): its expert and K loops unrolled for the call's K (compiled per K;
    ``stages`` then unused). Unrolled projections and gate/up launches measured slower (H200, ``092fe21``:
    the Kimi-Linear slice's batch-1 step 0.695 against 0.582 ms), so they always loop."""
    bn: int = 8
    bk: int = 512
    num_warps: int = 4
    stages: int = 3
    unroll: bool = False

    def loop(self, K: int) -> dict:
        """The down-and-combine kernel's loop parameters for a K of this call: pipeline stages, or unrolled for K."""
        return dict(STAGES=self.stages, UNROLL=self.unroll, KC=K if self.unroll else 0)

    def looped(self, what: str) -> GemvConfig:
        """This config, refused when it asks a launch that always loops to unroll."""
        if self.unroll:
            raise ValueError(f"{what}: unroll applies to the down-and-combine launch only, got {self}")
        return self


def gemv_config(M: int, N: int, K: int, num_sms: int = 132, glu: bool = False) -> GemvConfig:
    """The default launch by the output width N, as measured at M = 1 on the lent GPU (H100, both slices'
    19 projection shapes, ``bench_gemv.py`` at e9088c3, 12cf350 with ``--sweep``, 0304426): from 64
    columns an SM 8 columns a program over K steps of 512 (3-10% faster than 32 x 128 on the 8 such
    shapes), from 32 an SM 16 x 256 (8-14% faster than 8 x 512 on the 5 shapes at N = 6720-7168),
    below that 8 (4 where an SM would get fewer than two programs) x 512. More rows of x shorten the K step so the fp32 partial products
    stay at 32 registers a thread (4 warps) a row; GLU (N counts gate and up rows, each program reads
    both) halves the columns."""
    if N >= 64 * num_sms:
        bn = 8
    elif N >= 32 * num_sms:
        bn = 16
    else:
        bn = 8 if triton.cdiv(N, 8) >= 2 * num_sms else 4
    if glu:
        bn = max(4, bn // 2)
    bk = max(64, min(4096 // bn if bn == 16 else 512, triton.next_power_of_2(K),
                     4096 // (bn * triton.next_power_of_2(M) * (2 if glu else 1))))
    return GemvConfig(bn=bn, bk=bk)


def gemv(x: torch.Tensor, w: torch.Tensor, config: GemvConfig | None = None,
         glu_act: tuple[bool, float, float | None] | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] (bf16 or fp16, unit stride on K); w [N, K] of x's dtype, contiguous.
    Returns [..., N] in x's dtype. ``glu_act`` = (situ, beta, linear_beta): w holds [gate; up] (2I rows)
    and the result is the GLU activation of the two products, [..., I] (``kimik3.ops.activation``).
    ``out_dtype``: the result (rounded to x's dtype) stored in this dtype (fp32 or x's)."""
    K = x.shape[-1]
    N = w.shape[0]
    if glu_act is not None and N % 2:
        raise ValueError(f"gemv: a GLU weight stacks gate and up rows, got an odd {N} rows")
    if w.dim() != 2 or w.shape[1] != K or w.dtype != x.dtype or not w.is_contiguous():
        raise ValueError(f"gemv: weight {w.dtype} {tuple(w.shape)} (contiguous: {w.is_contiguous()}) does not "
                         f"match x {x.dtype} [..., {K}]")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"gemv takes bf16 or fp16 operands, got {x.dtype}")
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"gemv stores x's dtype or float32, got out_dtype {out_dtype}")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    N_out = N // 2 if glu_act is not None else N
    y = torch.empty(M, N_out, dtype=out_dtype or x.dtype, device=x.device)
    if M and N:
        situ, beta, linear_beta = glu_act or (False, 1.0, None)
        cfg = (config or gemv_config(M, N, K, glu=glu_act is not None)).looped("gemv")
        BM = triton.next_power_of_2(M)
        _gemv_kernel[(triton.cdiv(N_out, cfg.bn),)](
            x2, w, w[N_out:] if glu_act is not None else w, y, y, M, N_out, K, x2.stride(0), w.stride(0), 0, y.stride(0),
            float(beta), float(linear_beta or 1.0), BM=BM, BN=cfg.bn, BK=cfg.bk,
            EVEN=N_out % cfg.bn == 0 and K % cfg.bk == 0, GLU=glu_act is not None, SITU=situ,
            CLIP_UP=situ and linear_beta is not None, EXPERTS=False,
            PREFETCH=_prefetch_lines(w, cfg.bk, K) if pdl(x)["PDL"] else 0, num_warps=cfg.num_warps,
            STAGES=cfg.stages, **pdl(x))
    return y.view(*x.shape[:-1], N_out)


def _prefetch_lines(w: torch.Tensor, bk: int, K: int) -> int:
    """128-byte lines of each weight row a program asks of L2 before its PDL wait (the kernel before it
    writes x, never the weight, so the first weight reads overlap that kernel's tail): those of its first K
    step (a power of two, none past the row), 0 for none (``KernelOptions.prefetch`` off)."""
    lines = min(bk, K) * w.element_size() // 128
    return triton.next_power_of_2(lines + 1) // 2 if common.prefetch_on(True) and lines else 0


def expert_up_config(L: int, I: int, k: int, num_sms: int = 132) -> GemvConfig:
    """``one_token_experts``' gate/up launch: ``gemv_config``'s for the k experts' 2 I x L rows, its K step
    the largest power of two (64 .. that config's) that divides L, so the loop has no masked tail step (at
    Kimi-Linear's L = 2304: 9 steps of 256 where 512 gave 4.5; bench_gemv.py --experts, H200, 092fe21)."""
    cfg = gemv_config(1, 2 * I * k, L, num_sms, glu=True)
    return replace(cfg, bk=next((b for b in (cfg.bk >> i for i in range(8)) if b >= 64 and L % b == 0), cfg.bk))


def combine_config(N: int, K: int, num_sms: int = 132) -> GemvConfig:
    """``one_token_experts``' down-and-combine launch: each program reads its columns from all k experts, so
    programs are k times longer than a projection's; 8 columns a program where that gives four programs an
    SM, else 4 (fewer, longer programs leave SMs idle at the tail); 8 warps, the expert and K loops unrolled
    (the later experts' loads issue before the earlier ones' sums). Kimi-Linear's shapes on the H200
    (bench_gemv.py --experts, 092fe21): one token's experts 37.1 us with the gate/up of ``expert_up_config``,
    against 40.8 looped with 4 warps."""
    bn = 8 if triton.cdiv(N, 8) >= 4 * num_sms else 4
    return GemvConfig(bn=bn, bk=max(64, min(512, triton.next_power_of_2(K))), num_warps=8, unroll=True)


def one_token_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, act_situ: bool, beta: float, linear_beta: float | None,
                      configs: tuple[GemvConfig, GemvConfig] | None = None) -> torch.Tensor:
    """One token's routed experts in two launches: x [1, L]; w1, w3 [E, I, L] and w2 [E, L, I] in x's dtype
    (bf16 or fp16, unit stride on the last axis); weights [1, k] fp32; ids [1, k]. Returns [1, L]:
    sum_j weights[j] E_{ids[j]}(x) in fp32, one rounding (``kimik3.ops.moe.fused_moe``'s combine)."""
    T, L = x.shape
    E, I, _ = w1.shape
    k = ids.shape[-1]
    if T != 1 or weights.shape != (1, k) or ids.shape != (1, k):
        raise ValueError(f"one_token_experts: one token's x [1, L], weights and ids [1, k], got x {tuple(x.shape)}, "
                         f"weights {tuple(weights.shape)}, ids {tuple(ids.shape)}")
    if (w3.shape != w1.shape or w3.stride() != w1.stride() or w2.shape != (E, L, I) or w1.shape[2] != L
            or w1.stride(2) != 1 or w2.stride(2) != 1 or not all(w.dtype == x.dtype for w in (w1, w2, w3))):
        raise ValueError(f"one_token_experts: experts w1 {w1.dtype} {tuple(w1.shape)}, w3 {tuple(w3.shape)}, w2 "
                         f"{tuple(w2.shape)} (unit stride on the last axis) do not match x {x.dtype} [1, {L}]")
    x = x.contiguous()
    ids, weights = ids.reshape(k).contiguous(), weights.reshape(k).contiguous()
    up_cfg, down_cfg = configs or (expert_up_config(L, I, k), combine_config(L, I))
    up_cfg = up_cfg.looped("one_token_experts' gate/up")
    h = torch.empty(k, I, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(I, up_cfg.bn), k)](
        x, w1, w3, h, ids, 1, I, L, x.stride(0), w1.stride(1), w1.stride(0), h.stride(0), float(beta),
        float(linear_beta or 1.0), BM=1, BN=up_cfg.bn, BK=up_cfg.bk, EVEN=I % up_cfg.bn == 0 and L % up_cfg.bk == 0,
        GLU=True, SITU=act_situ, CLIP_UP=act_situ and linear_beta is not None, EXPERTS=True, PREFETCH=0,
        num_warps=up_cfg.num_warps, STAGES=up_cfg.stages, **pdl(x))
    out = torch.empty(1, L, dtype=x.dtype, device=x.device)
    _gemv_combine_kernel[(triton.cdiv(L, down_cfg.bn),)](
        h, w2, ids, weights, out, L, I, h.stride(0), w2.stride(1), w2.stride(0), TOP_K=k, BN=down_cfg.bn,
        BK=down_cfg.bk, EVEN=L % down_cfg.bn == 0 and I % down_cfg.bk == 0, num_warps=down_cfg.num_warps,
        **down_cfg.loop(I), **pdl(h))
    return out
