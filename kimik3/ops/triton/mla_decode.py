"""Absorbed MLA decode over the paged latent cache, flash-decoding style.

Pass 1: program (sequence n, head block, split s) attends BH heads to the tokens of split s
(all heads share the one latent "KV head", so a [BH, D_c] x [D_c, BN] product per cache tile)
with an online softmax, and stores the normalised partial output and its log-sum-exp.
Pass 2: program (n, head) merges the splits by their log-sum-exps, a few at a time.
Two forms of pass 1: "paged" walks one cache block per iteration (a 64-bit block base and the
block's fixed 32-bit row offsets, hoisted out of the loop), for power-of-two block sizes of at
least 16; "gather" loads BN token rows by 64-bit address each (any block size), the next tile's
block ids loaded while a tile computes.
FP8 cache (SCALED): the rows are E4M3 codes with one float32 scale per token; a tile's codes are
widened to the query's dtype (exact) for the products, and the token's scale multiplies its score
(q . (s e) = s (q . e)) and its probability before the value product (sum p s e).
Reference: ``kimik3.ops.mla.mla_decode_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kimik3.ops.triton.common import INTERPRETING, dot, pdl, pdl_entry

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@triton.jit
def _attend_tile(ql, qp, e_lat, e_pe, e_v, sc, pos, limit, m_i, l_i, acc, sm_scale_log2,
                 BH: tl.constexpr, BN: tl.constexpr, UPCAST: tl.constexpr, SCALED: tl.constexpr):
    """One tile of the online softmax: (m_i, l_i, acc) updated by the cached tokens at ``pos``
    [BN] (those at or past ``limit`` masked out); e_lat [BN, BR], e_pe [BN, BP]; e_v [BN, BV] the
    latent columns this program outputs (e_lat itself when it outputs them all); SCALED: sc [BN]
    the tokens' scales (the rows are codes)."""
    scores = dot(qp, tl.trans(e_pe), dot(ql, tl.trans(e_lat), tl.zeros([BH, BN], tl.float32), UPCAST), UPCAST)   # [BH, BN]
    if SCALED:
        scores = scores * sc[None, :]
    scores = tl.where((pos < limit)[None, :], scores * sm_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if SCALED:
        p = p * sc[None, :]
    acc = dot(p.to(e_v.dtype), e_v, acc * alpha[:, None], UPCAST)
    return m_new, l_i, acc


@triton.jit
def _attend_tile_t(ql, qp, e_lat, e_pe, e_v, sc, pos, limit, m_i, l_i, acc, sm_scale_log2,
                   BH: tl.constexpr, BN: tl.constexpr, UPCAST: tl.constexpr, SCALED: tl.constexpr):
    """``_attend_tile`` with the products transposed, token rows as their M side: scores [BN, BH]
    and acc [BV, BH], so a head block of 16-32 heads is the N side of the tensor-core tiles."""
    scores = dot(e_pe, tl.trans(qp), dot(e_lat, tl.trans(ql), tl.zeros([BN, BH], tl.float32), UPCAST), UPCAST)   # [BN, BH]
    if SCALED:
        scores = scores * sc[:, None]
    scores = tl.where((pos < limit)[:, None], scores * sm_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[None, :])
    l_i = l_i * alpha + tl.sum(p, 0)
    if SCALED:
        p = p * sc[:, None]
    acc = dot(tl.trans(e_v), p.to(e_v.dtype), acc * alpha[None, :], UPCAST)
    return m_new, l_i, acc


@triton.jit
def _rows(cache, cache_scale, blk, pos, hi, r, pp, v, R, P, stride_blk, stride_row, stride_scale_blk,
          dtype: tl.constexpr, BLOCK_SIZE: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr, BV: tl.constexpr,
          SCALED: tl.constexpr):
    """The cached rows at ``pos`` [BN] (block ids ``blk``, int64; rows at or past ``hi`` read as
    zeros) in ``dtype``: latent [BN, BR], rope part [BN, BP], the output columns [BN, BV]; and with
    SCALED their scales [BN] (else a placeholder)."""
    mpos = pos < hi
    row = cache + blk * stride_blk + (pos % BLOCK_SIZE).to(tl.int64) * stride_row                   # [BN]
    e_lat = tl.load(row[:, None] + r[None, :], mask=mpos[:, None] & (r < R)[None, :], other=0.0).to(dtype)
    e_pe = tl.load(row[:, None] + R + pp[None, :], mask=mpos[:, None] & (pp < P)[None, :], other=0.0).to(dtype)
    if BV == BR:
        e_v = e_lat
    else:
        e_v = tl.load(row[:, None] + v[None, :], mask=mpos[:, None] & (v < R)[None, :], other=0.0).to(dtype)
    sc = 0.0
    if SCALED:
        sc = tl.load(cache_scale + blk * stride_scale_blk + pos % BLOCK_SIZE, mask=mpos, other=0.0)
    return e_lat, e_pe, e_v, sc


@triton.jit
def _mla_decode_split_kernel(q_lat, q_pe, cache, cache_scale, block_tables, seq_lens, part_o, part_lse,
                             H, R, P, stride_ql_n, stride_ql_h, stride_qp_n, stride_qp_h,
                             stride_cache_blk, stride_cache_row, stride_scale_blk, stride_bt, sm_scale_log2,
                             BLOCK_SIZE: tl.constexpr, BH: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr,
                             NUM_SPLITS, BN: tl.constexpr, BV: tl.constexpr, PAGED: tl.constexpr,
                             TRANS: tl.constexpr, UPCAST: tl.constexpr, SCALED: tl.constexpr, PDL: tl.constexpr):
    """Pass 1. PAGED: tiles are whole cache blocks (BN == BLOCK_SIZE), addressed from the block's
    64-bit base plus fixed 32-bit row offsets; else BN token rows, each addressed by 64 bits.
    Program axis 1 is (head block, column block): each program outputs BV of the R latent columns
    (the scores are computed in full by every column block). TRANS: the products transposed.
    The gather form loads each tile's block ids a tile ahead (the fourth sweep: never slower).
    SCALED: the cache holds FP8 codes, ``cache_scale`` [blocks, BLOCK_SIZE] their per-token scales."""
    pdl_entry(PDL)
    n, hv, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hb, vb = hv // (BR // BV), hv % (BR // BV)
    h = hb * BH + tl.arange(0, BH)
    r = tl.arange(0, BR)
    v = vb * BV + tl.arange(0, BV)
    pp = tl.arange(0, BP)
    mh, mr, mp = h < H, r < R, pp < P
    ql = tl.load(q_lat + n * stride_ql_n + h[:, None] * stride_ql_h + r[None, :],
                 mask=mh[:, None] & mr[None, :], other=0.0)                         # [BH, BR]
    qp = tl.load(q_pe + n * stride_qp_n + h[:, None] * stride_qp_h + pp[None, :],
                 mask=mh[:, None] & mp[None, :], other=0.0)                         # [BH, BP]
    length = tl.load(seq_lens + n)
    # each sequence spreads its own length over the splits (whole tiles), so a short sequence in
    # a launch sized for a long one still uses every split
    tokens_per_split = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BN) * BN
    lo = s * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, length)
    m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BV, BH] if TRANS else [BH, BV], dtype=tl.float32)
    table = block_tables + n * stride_bt
    rows = tl.arange(0, BN)[:, None] * stride_cache_row                           # int32 offsets in a block
    off_lat, off_pe, off_v = rows + r[None, :], rows + R + pp[None, :], rows + v[None, :]
    if not PAGED:                         # the first tile's block ids (later tiles: one tile ahead)
        blk_next = tl.load(table + (lo + tl.arange(0, BN)) // BLOCK_SIZE, mask=lo + tl.arange(0, BN) < hi, other=0)
    dt = q_lat.dtype.element_ty
    for start in range(lo, hi, BN):
        pos = start + tl.arange(0, BN)
        if PAGED:
            blk = tl.load(table + start // BLOCK_SIZE).to(tl.int64)
            base = cache + blk * stride_cache_blk
            e_lat = tl.load(base + off_lat, mask=mr[None, :], other=0.0).to(dt)                       # [BN, BR]
            e_pe = tl.load(base + off_pe, mask=mp[None, :], other=0.0).to(dt)                         # [BN, BP]
            if BV == BR:
                e_v = e_lat
            else:
                e_v = tl.load(base + off_v, mask=(v < R)[None, :], other=0.0).to(dt)                  # [BN, BV]
            sc = 0.0
            if SCALED:
                sc = tl.load(cache_scale + blk * stride_scale_blk + tl.arange(0, BN))
        else:                             # the next tile's block ids load while this tile computes
            e_lat, e_pe, e_v, sc = _rows(cache, cache_scale, blk_next.to(tl.int64), pos, hi, r, pp, v, R, P,
                                         stride_cache_blk, stride_cache_row, stride_scale_blk, dt, BLOCK_SIZE,
                                         BR, BP, BV, SCALED)
            blk_next = tl.load(table + (pos + BN) // BLOCK_SIZE, mask=pos + BN < hi, other=0)
        if TRANS:
            m_i, l_i, acc = _attend_tile_t(ql, qp, e_lat, e_pe, e_v, sc, pos, hi, m_i, l_i, acc, sm_scale_log2, BH,
                                           BN, UPCAST, SCALED)
        else:
            m_i, l_i, acc = _attend_tile(ql, qp, e_lat, e_pe, e_v, sc, pos, hi, m_i, l_i, acc, sm_scale_log2, BH,
                                         BN, UPCAST, SCALED)
    base_o = (n * H + h) * NUM_SPLITS + s
    empty = l_i == 0.0
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))                   # log2 units
    live = mh & ~empty                    # an empty split's output is never read (the merge skips lse -inf)
    if TRANS:
        out = acc / tl.where(empty, 1.0, l_i)[None, :]                                                # [BV, BH]
        tl.store(part_o + base_o[None, :].to(tl.int64) * BR + v[:, None], out, mask=live[None, :])
    else:
        out = acc / tl.where(empty, 1.0, l_i)[:, None]                                                # [BH, BV]
        tl.store(part_o + base_o[:, None].to(tl.int64) * BR + v[None, :], out, mask=live[:, None])
    tl.store(part_lse + base_o, lse, mask=mh & (h * 0 + vb == 0))          # one column block stores it


@triton.jit
def _mla_decode_merge_kernel(part_o, part_lse, out, out_lse, H, R, stride_on, stride_oh, NUM_SPLITS,
                             BR: tl.constexpr, BS: tl.constexpr, LSE: tl.constexpr, PDL: tl.constexpr):
    """Pass 2. Program (n, head) combines the splits BS at a time with a running log-sum-exp (a
    [BS, BR] fp32 tile stays in registers; all splits of a long launch at once spilled from 65
    splits on: 1,900 local loads and stores at 128, Triton 3.6); empty splits (lse -inf) are
    neither read nor counted. ``LSE``: also store the row's natural-log log-sum-exp at out_lse[n, h]
    (-inf, and output 0, for a sequence without keys)."""
    pdl_entry(PDL)
    n, h = tl.program_id(0), tl.program_id(1)
    r = tl.arange(0, BR)
    base = (n * H + h) * NUM_SPLITS
    m = tl.full([], float("-inf"), tl.float32)
    den = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BR], dtype=tl.float32)
    for s0 in range(0, NUM_SPLITS, BS):
        s = s0 + tl.arange(0, BS)
        lse = tl.load(part_lse + base + s, mask=s < NUM_SPLITS, other=float("-inf"))
        live = lse != float("-inf")
        m_new = tl.maximum(m, tl.max(lse, 0))
        alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp2(m - m_new))
        w = tl.where(live, tl.exp2(lse - m_new), 0.0)
        o = tl.load(part_o + (base + s)[:, None].to(tl.int64) * BR + r[None, :], mask=live[:, None], other=0.0)
        acc = acc * alpha + tl.sum(o * w[:, None], 0)
        den = den * alpha + tl.sum(w, 0)
        m = m_new
    res = acc / tl.where(den > 0, den, 1.0)
    tl.store(out + n * stride_on + h * stride_oh + r, res.to(out.dtype.element_ty), mask=r < R)
    if LSE:
        tl.store(out_lse + n * H + h, (m + tl.log2(den)) * _LN2)


# Splits the merge combines at a time: its [MERGE_SPLITS, BR] fp32 tile stays in registers (the compile test checks)
MERGE_SPLITS = 32


@dataclass(frozen=True)
class DecodeConfig:
    """Pass-1 launch of the decode kernel: form ("paged" or "gather"), heads per program, token
    rows per tile (gather form; the paged form takes one cache block), latent columns each program
    outputs (0: all R), products transposed (token rows as M), warps, pipeline stages, programs per
    SM to aim for, and the most splits of one sequence. (Measured on the H200 and
    dropped: rescaling the running output only when a running max moves, and prefetching the
    next block's rows by hand; neither was faster: results/mla_decode_sweep2_3ddadd8.json.)"""
    form: str = "paged"
    bh: int = 32
    bn: int = 32
    bv: int = 0
    trans: bool = False
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 2
    max_splits: int = 64


def config_for(H: int, block_size: int, max_seq_len: int = 0, batch: int = 1) -> DecodeConfig:
    """The default launch, from the fourth sweep of ``bench_mla_prefill.py --decode-sweep`` (H200,
    block size 16, ``results/mla_decode_sweep4_935d67f.json``; the third chose the tile shapes:
    ``results/mla_decode_sweep3_1e66f41.json``): gathered tiles of any block size with the next
    tile's block ids loaded ahead, up to 256 splits of a sequence. By heads and batch:
    64 heads a program over 64 rows at 64+ heads for 32+ sequences, or for fewer than 8 over
    contexts from 512k; 32 heads over 64 rows, two programs an SM, for 8-31 sequences (and at 32
    or fewer heads from 8 sequences); 16 heads over 64 rows at 16 or fewer heads (two programs an
    SM from 512k); else the products transposed over 128 rows, 32 heads as the N side. At 32 or
    fewer heads (Kimi-Linear) for 32+ sequences, 32 rows a tile, three stages, four programs an SM
    (the sweep at 7e8c19d, ``results/mla_decode_sweep5_7e8c19d.json``: 0.96x the time of two programs
    over 64 rows at 4k contexts, 0.79x at 32k, 0.98x for 128 sequences)."""
    common = dict(form="gather", num_warps=8, max_splits=256)
    if H > 32 and (batch >= 32 or (batch < 8 and max_seq_len >= 1 << 19)):
        return DecodeConfig(**common, bh=64, bn=64, num_stages=2, programs_per_sm=1)
    if batch >= 32:
        return DecodeConfig(form="gather", max_splits=256, bh=32, bn=32, num_warps=4, num_stages=3, programs_per_sm=4)
    if batch >= 8:
        return DecodeConfig(**common, bh=32, bn=64, num_stages=2, programs_per_sm=2)
    if H <= 16:
        return DecodeConfig(**common, bh=16, bn=64, num_stages=2, programs_per_sm=2 if max_seq_len >= 1 << 19 else 1)
    return DecodeConfig(**common, bh=32, bn=128, trans=True, num_stages=1, programs_per_sm=1)


def mla_decode_triton(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, max_seq_len: int, scale: float, num_sms: int = 132,
                      config: DecodeConfig | None = None, return_lse: bool = False,
                      cache_scale: torch.Tensor | None = None):
    """q_latent [N, H, R]; q_pe [N, H, P]; cache [num_blocks, block_size, R + P]; block_tables
    [N, max_blocks]; seq_lens [N] (device); max_seq_len bounds seq_lens (sizes the splits);
    cache_scale [num_blocks, block_size] float32: an FP8 cache's per-token scales (the cache in
    float8_e4m3fn), else None (the cache in q_latent's dtype).
    Returns the latent output [N, H, R] in q_latent's dtype; ``return_lse``: and the natural-log
    log-sum-exp [N, H] float32 (-inf for a sequence of length 0, whose output is 0)."""
    N, H, R = q_latent.shape
    P = q_pe.shape[-1]
    block_size = cache.shape[1]
    if cache.stride(-1) != 1 or q_latent.stride(-1) != 1 or q_pe.stride(-1) != 1:
        raise ValueError("mla_decode_triton needs unit stride on the feature axis")
    scaled = cache_scale is not None
    if scaled and (cache.dtype != torch.float8_e4m3fn or cache_scale.dtype != torch.float32
                   or cache_scale.shape != cache.shape[:2] or cache_scale.stride(1) != 1):
        raise ValueError(f"mla_decode_triton: an FP8 cache is float8_e4m3fn [blocks, block_size, R + P] with float32 "
                         f"scales [blocks, block_size] (unit stride within a block); got {cache.dtype} "
                         f"{tuple(cache.shape)} and {cache_scale.dtype} {tuple(cache_scale.shape)}")
    cfg = config or config_for(H, block_size, max_seq_len, N)
    if cfg.form == "paged" and (block_size < 16 or block_size & (block_size - 1)):
        raise ValueError(f"the paged decode form needs a power-of-two block size >= 16, got {block_size}")
    BR, BP = triton.next_power_of_2(max(R, 16)), triton.next_power_of_2(max(P, 16))
    BH = min(cfg.bh, max(16, triton.next_power_of_2(H)))
    tile = block_size if cfg.form == "paged" else cfg.bn
    BV = min(cfg.bv or BR, BR)
    head_blocks = triton.cdiv(H, BH) * (BR // BV)
    # enough programs to fill the chip, never more splits than tiles of the longest sequence;
    # each sequence divides its own length among them (in the kernel)
    splits = max(1, min(triton.cdiv(max_seq_len, tile), triton.cdiv(cfg.programs_per_sm * num_sms, N * head_blocks),
                        cfg.max_splits))
    part_o = torch.empty(N * H * splits, BR, dtype=torch.float32, device=q_latent.device)
    part_lse = torch.empty(N * H * splits, dtype=torch.float32, device=q_latent.device)
    args = (q_latent, q_pe, cache, cache_scale if scaled else part_lse, block_tables, seq_lens, part_o, part_lse,
            H, R, P, q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
            cache.stride(0), cache.stride(1), cache_scale.stride(0) if scaled else 0, block_tables.stride(0),
            scale * _LOG2E)
    _mla_decode_split_kernel[(N, head_blocks, splits)](
        *args, BLOCK_SIZE=block_size, BH=BH, BR=BR, BP=BP, BN=tile, BV=BV, NUM_SPLITS=splits, PAGED=cfg.form == "paged", TRANS=cfg.trans,
        UPCAST=INTERPRETING, SCALED=scaled, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl(q_latent))
    out = torch.empty(N, H, R, dtype=q_latent.dtype, device=q_latent.device)
    lse = torch.empty(N, H, dtype=torch.float32, device=q_latent.device) if return_lse else part_lse
    _mla_decode_merge_kernel[(N, H)](part_o, part_lse, out, lse, H, R, out.stride(0), out.stride(1), splits,
                                     BR=BR, BS=min(MERGE_SPLITS, triton.next_power_of_2(splits)), LSE=return_lse,
                                     **pdl(part_o))
    return (out, lse) if return_lse else out
