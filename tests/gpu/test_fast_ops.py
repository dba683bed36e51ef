"""Every CUDA fast op against its torch reference (run on upcast copies, fp32/fp64), on random
shapes with ragged varlen batches and scattered state slots. Before each fast run the caching
allocator is filled with NaN, so an unwritten output element shows up as non-finite.

Bounds follow METHOD.md: bf16 operands land between 1e-3 and 1e-2 relative error (||out - ref|| /
||ref||); fp32 arithmetic far under 1e-3. Each bound holds for every piece on its own, not for one
global norm: per sequence of a varlen batch, per token (decode rows, MoE, AttnRes, routing), per
state slot, so a 10% error in a one-token sequence fails. ``CHECKS`` is reused by
benchmarks/gpu/bench_slice.py.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from kimik3.ops import mxfp4
from kimik3.ops.activation import situ_and_mul, silu_and_mul
from kimik3.ops.attn_res import attn_res_mix, attn_res_mix_norm
from kimik3.ops.backend import reference_ops
from kimik3.ops.conv import causal_conv1d_in_pool
from kimik3.ops.cuda import flash_kda, flash_mla
from kimik3.ops.kda import LowRank, OutputNorm, kda_attention_in_pool, kda_recurrent_in_pool
from kimik3.ops.mla import cache_latent, mla_decode_attention, mla_prefill_attention
from kimik3.ops.moe import fused_moe, fused_moe_mxfp4
from kimik3.ops.norm import add_rms_norm, gated_rms_norm, rms_norm, rms_norm_fp32_weight
from kimik3.ops.router import route
from kimik3.model.cuda_graphs import capture_graph
from tests.helpers import worst_rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
BF16_BOUND = 1e-2


def poison_allocator(nbytes: int = 1 << 30) -> None:
    """Fill free cached memory with NaN so fresh torch.empty outputs start poisoned."""
    junk = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del junk


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _batch(lens, ctx, num_slots, g):
    N = len(lens)
    slots = torch.randperm(num_slots - 1, generator=g, device="cuda")[:N] + 1     # scattered, never slot 0
    cu = torch.tensor([0, *lens], device="cuda").cumsum(0)
    has = torch.tensor(ctx, device="cuda") > 0
    return slots, cu, has


def check_conv(lens=(37, 1, 130, 5), ctx=(0, 9, 4, 0), C=3 * 12288 // 8, seed=0, given=True) -> dict:
    """given=False: has_state None (every sequence has history; one token each: the decode kernel)."""
    g = _gen(seed)
    W, S = 4, 17
    x = torch.randn(sum(lens), C + 512, generator=g, device="cuda").to(BF16)[:, :C]   # a merged projection's slice
    w = torch.randn(C, W, generator=g, device="cuda")
    pool = torch.randn(S, C, W - 1, generator=g, device="cuda").to(BF16)
    slots, cu, has = _batch(list(lens), list(ctx), S, g)
    ref_pool = pool.clone()
    with reference_ops():
        ref = torch.cat(causal_conv1d_in_pool(x, w, ref_pool, slots, has, list(lens), cu, 3), dim=-1)
    poison_allocator()
    y = torch.cat(causal_conv1d_in_pool(x, w, pool, slots, has if given else None, list(lens), cu, 3), dim=-1)
    return {"conv.y": worst_rel_err(y, ref, lens), "conv.pool_exact": float(not torch.equal(pool, ref_pool))}


def _kda_inputs(T, H, K, g):
    q, k, v = (torch.randn(T, H, K, generator=g, device="cuda").to(BF16) for _ in range(3))
    f = torch.randn(T, H, K, generator=g, device="cuda").to(BF16)
    b = torch.randn(T, H, generator=g, device="cuda").to(BF16)
    A_log = torch.log(torch.empty(H, device="cuda").uniform_(1, 16, generator=g))
    dt_bias = 0.5 * torch.randn(H * K, generator=g, device="cuda")
    return q, k, v, f, b, A_log, dt_bias


def check_kda(lens=(200, 1, 67, 130), ctx=(0, 12, 5, 0), H=96, K=128, lower_bound=-5.0, seed=1,
              normed=False) -> dict:
    """Prefill (fla chunk_kda, ragged varlen, states from scattered slots) and decode (our one-kernel
    step updating the pool in place; b a strided slice, as the model passes it); reference in fp32
    on the same inputs. ``normed``: with the layer's output norm (fused into the decode step)."""
    g = _gen(seed)
    S = 11
    out = {}
    for name, ls, cs in (("prefill", list(lens), list(ctx)), ("decode", [1] * len(lens), [c + 1 for c in ctx])):
        q, k, v, f, b, A_log, dt_bias = _kda_inputs(sum(ls), H, K, g)
        if name == "decode":
            b = torch.cat([b, b[:, :3]], dim=1)[:, :H]                   # row stride H + 3
        pool = 0.1 * torch.randn(S, H, K, K, generator=g, device="cuda")
        slots, cu, has = _batch(ls, cs, S, g)
        ref_pool = pool.clone()
        norm = ref_norm = None
        if normed:
            gate = torch.randn(sum(ls), H * K + 3, generator=g, device="cuda").to(BF16)[:, 3:].view(-1, H, K)
            weight = 1 + 0.2 * torch.randn(K, generator=g, device="cuda")
            norm = OutputNorm(weight, gate, 1e-5, BF16)
            ref_norm = OutputNorm(weight, gate.float(), 1e-5, torch.float32)
        with reference_ops():
            ref = kda_attention_in_pool(q.float(), k.float(), v.float(), f.float(), b.float(), A_log, dt_bias,
                                        lower_bound, ref_pool, slots, has, ls, cu, decode=name == "decode",
                                        out_norm=ref_norm)
        poison_allocator()
        o = kda_attention_in_pool(q, k, v, f, b, A_log, dt_bias, lower_bound, pool, slots, has, ls, cu,
                                  decode=name == "decode", out_norm=norm)
        others = torch.ones(S, dtype=torch.bool, device="cuda")
        others[slots] = False
        out[f"kda.{name}.o"] = worst_rel_err(o, ref, ls)
        out[f"kda.{name}.state"] = worst_rel_err(pool[slots], ref_pool[slots])      # per slot
        out[f"kda.{name}.others_exact"] = float(not torch.equal(pool[others], ref_pool[others]))
    return out


def check_kda_decode_conv(N=5, H=32, K=128, W=4, lower_bound=None, seed=26, low_rank=False) -> dict:
    """A KDA layer's decode step as the model runs it (the conv's decode kernel on raw q|k|v, a slice of the
    merged projection, then the step with the output norm; both pools at scattered slots) against the
    reference ops in fp32 on the same inputs; the conv windows bit for bit. ``low_rank``: f and the output gate
    as Kimi-Linear's ``LowRank`` (f_a | g_a a slice of a wider row, f_b and g_b [H K, K]), computed in the step."""
    g = _gen(seed)
    S, P = max(11, N + 2), H * K          # slot 0 and at least one more stay untouched
    raw = torch.randn(N, 3 * P + 200, generator=g, device="cuda").to(BF16)[:, 100:100 + 3 * P]
    conv_w = 0.5 * torch.randn(3 * P, W, generator=g, device="cuda")
    windows = torch.randn(S, 3 * P, W - 1, generator=g, device="cuda").to(BF16)
    _, _, _, f, b, A_log, dt_bias = _kda_inputs(N, H, K, g)
    pool = 0.1 * torch.randn(S, H, K, K, generator=g, device="cuda")
    slots = torch.randperm(S - 1, generator=g, device="cuda")[:N] + 1
    cu = torch.arange(N + 1, device="cuda")
    gate = torch.randn(N, H, K, generator=g, device="cuda").to(BF16)
    weight = 1 + 0.2 * torch.randn(K, generator=g, device="cuda")
    ref_windows, ref_pool = windows.float(), pool.clone()
    ref_f, ref_gate = f.float(), gate.float()
    if low_rank:
        fg_a = torch.randn(N, 2 * K + 40, generator=g, device="cuda").to(BF16)[:, 40:]
        f_b, g_b = ((torch.randn(P, K, generator=g, device="cuda") * K ** -0.5 * s).to(BF16) for s in (3, 1))
        f, gate = LowRank(fg_a[:, :K], f_b), LowRank(fg_a[:, K:], g_b)
        ref_f, ref_gate = LowRank(fg_a[:, :K].float(), f_b.float()), LowRank(fg_a[:, K:].float(), g_b.float())

    def step(raw, windows, f, b, pool, norm):
        q, k, v = (t.view(N, H, K) for t in causal_conv1d_in_pool(raw, conv_w, windows, slots, None, [1] * N, cu, 3))
        return kda_attention_in_pool(q, k, v, f, b, A_log, dt_bias, lower_bound, pool, slots, None, [1] * N, cu,
                                     decode=True, out_norm=norm)
    with reference_ops():
        ref = step(raw.float(), ref_windows, ref_f, b.float(), ref_pool, OutputNorm(weight, ref_gate, 1e-5, torch.float32))
    poison_allocator()
    o = step(raw, windows, f, b, pool, OutputNorm(weight, gate, 1e-5, BF16))
    others = torch.ones(S, dtype=torch.bool, device="cuda")
    others[slots] = False
    return {"kda_conv.decode.o": worst_rel_err(o, ref, [1] * N),
            "kda_conv.decode.state": worst_rel_err(pool[slots], ref_pool[slots]),
            "kda_conv.windows_exact": float(not torch.equal(windows.float(), ref_windows)),
            "kda_conv.others_exact": float(not torch.equal(pool[others], ref_pool[others]))}


def check_kda_snapshots(lens=(4, 1, 3, 4), H=96, K=128, lower_bound=-5.0, seed=15) -> dict:
    """Speculative verify steps: fla's recurrent kernel over short chunks with history, the state
    after each listed row written to its slot (2-D state indices), the live slot read first and
    written last; reference in fp32. Slot 0 is scratch; the slots the table does not name stay exact."""
    g = _gen(seed)
    S = 24
    q, k, v, f, b, A_log, dt_bias = _kda_inputs(sum(lens), H, K, g)
    pool = 0.1 * torch.randn(S, H, K, K, generator=g, device="cuda")
    perm = (torch.randperm(S - 1, generator=g, device="cuda") + 1).tolist()
    table = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    for n, ql in enumerate(lens):
        table[n, ql - 1] = perm.pop()
        for t in range(ql - 1):
            if (n + t) % 3 != 2:                 # some rows keep no state (scratch)
                table[n, t] = perm.pop()
    table = table.cuda()
    cu = torch.tensor([0, *lens], device="cuda").cumsum(0)
    ref_pool = pool.clone()
    with reference_ops():
        ref = kda_recurrent_in_pool(q.float(), k.float(), v.float(), f.float(), b.float(), A_log, dt_bias,
                                    lower_bound, ref_pool, table, list(lens), cu)
    poison_allocator()
    o = kda_recurrent_in_pool(q, k, v, f, b, A_log, dt_bias, lower_bound, pool, table, list(lens), cu)
    named = table[table > 0]
    others = torch.ones(S, dtype=torch.bool, device="cuda")
    others[named] = False
    others[0] = False
    return {"kda_snap.o": worst_rel_err(o, ref, list(lens)), "kda_snap.state": worst_rel_err(pool[named], ref_pool[named]),
            "kda_snap.others_exact": float(not torch.equal(pool[others], ref_pool[others]))}


def _paged(lens, bs, D, g, num_blocks=None):
    need = sum(-(-L // bs) for L in lens)
    num_blocks = num_blocks or need + 3
    cache = torch.randn(num_blocks, bs, D, generator=g, device="cuda").to(BF16)
    perm = torch.randperm(num_blocks - 1, generator=g, device="cuda") + 1
    width = max(-(-L // bs) for L in lens)
    tables = torch.full((len(lens), width), -1, dtype=torch.int32, device="cuda")
    used = 0
    for n, L in enumerate(lens):
        nb = -(-L // bs)
        tables[n, :nb] = perm[used:used + nb].int()
        used += nb
    return cache, tables


def check_mla_decode(lens=(4096, 1, 333, 2050, 17), H=96, R=512, P=64, bs=64, seed=2) -> dict:
    g = _gen(seed)
    cache, tables = _paged(list(lens), bs, R + P, g)
    q_lat = torch.randn(len(lens), H, R, generator=g, device="cuda").to(BF16)
    q_pe = torch.randn(len(lens), H, P, generator=g, device="cuda").to(BF16)
    scale = 192 ** -0.5
    with reference_ops():
        ref = mla_decode_attention(q_lat.double(), q_pe.double(), cache.double(), tables, list(lens), R, scale)
    poison_allocator()
    out = mla_decode_attention(q_lat, q_pe, cache, tables, torch.tensor(lens, device="cuda"), R, scale,
                               max_seq_len=max(lens))
    return {"mla.decode": worst_rel_err(out, ref)}                     # per sequence (one row each)


def check_mla_prefill(lens=(300, 1, 77), ctx=(0, 40, 129), H=16, R=512, P=64, dn=128, dv=128, bs=64, seed=3) -> dict:
    g = _gen(seed)
    total = [c + q for c, q in zip(ctx, lens)]
    cache, tables = _paged(total, bs, R + P, g)
    q = torch.randn(sum(lens), H, dn + P, generator=g, device="cuda").to(BF16)
    kv_b = (torch.randn(H * (dn + dv), R, generator=g, device="cuda") / math.sqrt(R)).to(BF16)
    scale = 192 ** -0.5
    with reference_ops():
        ref = mla_prefill_attention(q.float(), cache.float(), tables, kv_b.float(), list(lens), list(ctx), R, dv, scale)
    poison_allocator()
    out = mla_prefill_attention(q, cache, tables, kv_b, list(lens), list(ctx), R, dv, scale)
    return {"mla.prefill": worst_rel_err(out, ref, list(lens))}


def _packed(E, N, K, g, shift=0):
    """Random codes (all 16 E2M1 values) and scales around 1/(2 sqrt(K)) times 2**shift."""
    codes = torch.randint(0, 16, (E * N, K), generator=g, device="cuda", dtype=torch.uint8)
    base = 127 - round(math.log2(2 * math.sqrt(K))) + shift
    scale = (base + torch.randint(-1, 2, (E * N, K // 32), generator=g, device="cuda")).to(torch.uint8)
    packed = mxfp4.pack_codes(codes)
    dense = mxfp4.dequantize(packed, scale, F32).view(E, N, K)
    return (packed.view(E, N, K // 2), scale.view(E, N, K // 32)), dense


def check_moe(T=37, E=16, L=512, I=384, k=4, seed=4, shift=0, tell_scale_max=False, tiles=None) -> dict:
    """shift: scales 2**shift larger (shift 20 puts them above 128: the two-multiply dequantization);
    tell_scale_max: pass the largest scale code (<= 128 takes the one-multiply dequantization);
    tiles: ``fused_moe_triton``'s tiles (e.g. the wgmma kernels' {"BT", "warps"}) instead of the dispatch."""
    g = _gen(seed)
    w1, d1 = _packed(E, I, L, g, shift)
    w3, d3 = _packed(E, I, L, g, shift)
    w2, d2 = _packed(E, L, I, g, shift)
    scale_max = max(int(w[1].max()) for w in (w1, w2, w3)) if tell_scale_max else None
    x = (torch.randn(T, L, generator=g, device="cuda") * 2.0 ** -shift).to(BF16)
    ids = torch.stack([torch.randperm(E, generator=g, device="cuda")[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g, device="cuda")
    with reference_ops():   # the same bf16 roundings (projections, activation output) on the dense weights
        ref = fused_moe(x, d1.to(BF16), d2.to(BF16), d3.to(BF16), weights, ids, "situ", 4.0, 25.0, True)
    poison_allocator()
    if tiles is None:
        out = fused_moe_mxfp4(x, w1, w2, w3, weights, ids, "situ", 4.0, 25.0, True, scale_max)
    else:
        from kimik3.ops.triton.moe import fused_moe_triton
        out = fused_moe_triton(x, w1, w2, w3, weights, ids, True, 4.0, 25.0, high_scales=shift > 0, tiles=tiles)
    return {f"moe.T{T}.shift{shift}.scale_max_{scale_max}.{tiles}": worst_rel_err(out, ref)}   # per token


def _grouped_tokens(E: int, k: int) -> int:
    """Tokens that give E experts (top-k) the rows per expert of the MXFP4 grouped-GEMM path, and some."""
    from kimik3.ops.options import tuning
    return tuning().mxfp4_grouped_mm_rows_per_expert * E // k + 37


def check_dequantize_mxfp4(shift=0, seed=30) -> dict:
    """The prefill path's dequantization kernel (the integer bit placement in PTX) against
    ``mxfp4.dequantize`` bit for bit, into the second half of a poisoned [E, 2N, K] scratch."""
    from kimik3.ops.triton.moe import dequantize_mxfp4
    g = _gen(seed)
    E, N, K = 5, 300, 1088
    (packed, scale), dense = _packed(E, N, K, g, shift)
    out = torch.full((E, 2 * N, K), float("nan"), dtype=BF16, device="cuda")
    dequantize_mxfp4(packed, scale, out[:, N:], high_scales=shift > 0)
    return {f"dequantize_mxfp4.shift{shift}_exact": float((out[:, N:].float() != dense).sum() + out[:, :N].isfinite().sum())}


def check_moe_dense(T=37, E=256, L=2304, I=1024, k=8, dtype=BF16, act="silu", seed=12, w13=False) -> dict:
    """Dense (bf16/fp16) experts on a ragged routing: expert 0 takes every token, expert 1 one
    token, the last experts none, the rest at random. Worst per-token error against the reference
    on fp32 copies of the same weights (a bad row cannot hide in a global norm). ``w13``: w1 and w3 as
    the halves of one tensor (the model's ``Experts.w13``; the grouped path's one gate | up GEMM)."""
    g = _gen(seed)
    if w13:
        both = torch.randn(E, 2 * I, L, generator=g, device="cuda").div_(L ** 0.5).to(dtype)
        w1, w3 = both[:, :I], both[:, I:]
    else:
        w1, w3 = (torch.randn(E, I, L, generator=g, device="cuda").div_(L ** 0.5).to(dtype) for _ in range(2))
    w2 = torch.randn(E, L, I, generator=g, device="cuda").div_(I ** 0.5).to(dtype)
    x = torch.randn(T, L, generator=g, device="cuda").to(dtype)
    ids = torch.empty(T, k, dtype=torch.long, device="cuda")
    for t in range(T):
        first = [0, 1] if (t == T // 2 and k > 1) else [0]
        rest = (torch.randperm(E - 6, generator=g, device="cuda") + 2)[:k - len(first)]
        ids[t] = torch.cat([torch.tensor(first, device="cuda"), rest])
    weights = torch.rand(T, k, generator=g, device="cuda") * 2.446 / k
    beta, linear_beta = (4.0, 25.0) if act == "situ" else (1.0, None)
    with reference_ops():
        ref = fused_moe(x.float(), w1.float(), w2.float(), w3.float(), weights, ids, act, beta, linear_beta, True)
    poison_allocator()
    out = fused_moe(x, w1, w2, w3, weights, ids, act, beta, linear_beta, True)
    return {f"moe_dense.{dtype}.{act}.T{T}.k{k}.worst_token": worst_rel_err(out, ref)}


def check_cache_latent(T=37, R=512, P=64, seed=25) -> dict:
    """MLA's new cache rows (the latent's norm, the rope part, at scattered slots) against the reference on
    fp64 copies, per token; the rope part bit for bit; every other row of the cache left as it was."""
    g = _gen(seed)
    c = torch.randn(T, 2048, generator=g, device="cuda").to(BF16)[:, 1000:1000 + R + P]    # a merged projection's slice
    w = (1 + 0.1 * torch.randn(R, generator=g, device="cuda")).to(BF16)
    cache = torch.randn(64, 16, R + P, generator=g, device="cuda").to(BF16)
    before = cache.clone()
    slots = torch.randperm(64 * 16, generator=g, device="cuda")[:T]
    ref = cache.double()
    with reference_ops():
        cache_latent(c.double(), w.double(), 1e-6, ref, slots)
    poison_allocator()
    cache_latent(c, w, 1e-6, cache, slots)
    rows, untouched = cache.view(-1, R + P), torch.ones(64 * 16, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    return {"cache_latent.worst_token": worst_rel_err(rows[slots], ref.view(-1, R + P)[slots]),
            "cache_latent.rope_exact": float(not torch.equal(rows[slots, R:], c[:, R:])),
            "cache_latent.others_exact": float(not torch.equal(rows[untouched], before.view(-1, R + P)[untouched]))}


def check_attn_res(n=9, T=77, D=7168, seed=5) -> dict:
    g = _gen(seed)
    big = torch.randn(n + 2, T, D, generator=g, device="cuda").to(BF16)
    sources = [big[i] for i in torch.randperm(n + 2, generator=g, device="cuda")[:n].tolist()]   # scattered
    gamma = 1 + 0.1 * torch.randn(D, generator=g, device="cuda")
    proj = torch.randn(1, D, generator=g, device="cuda") / math.sqrt(D)
    with reference_ops():
        ref = attn_res_mix([s.double() for s in sources], gamma.double(), proj.double(), 1e-5)
    poison_allocator()
    out = attn_res_mix(sources, gamma, proj, 1e-5)
    return {f"attn_res.n{n}": worst_rel_err(out, ref)}                 # per token


def check_attn_res_norm(n=5, T=77, D=7168, seed=21) -> dict:
    """The mix with its consumer's norm in the epilogue (both forms), bf16 out, against the float64 reference."""
    g = _gen(seed)
    sources = [torch.randn(T, D, generator=g, device="cuda").to(BF16) for _ in range(n)]
    gamma = 1 + 0.1 * torch.randn(D, generator=g, device="cuda")
    proj = torch.randn(1, D, generator=g, device="cuda") / math.sqrt(D)
    consumer = 1 + 0.2 * torch.randn(D, generator=g, device="cuda")
    out = {}
    for fp32_weight in (True, False):
        with reference_ops():
            ref = attn_res_mix_norm([s.double() for s in sources], gamma.double(), proj.double(), 1e-5,
                                    consumer.double(), fp32_weight, torch.float64)
        poison_allocator()
        got = attn_res_mix_norm(sources, gamma, proj, 1e-5, consumer, fp32_weight, BF16)
        out[f"mix_norm.{'fp32_weight' if fp32_weight else 'official'}"] = worst_rel_err(got, ref)
    return out


def check_route(T=300, E=896, k=16, seed=6) -> dict:
    g = _gen(seed)
    logits = torch.randn(T, E, generator=g, device="cuda") * 3
    bias = torch.randn(E, generator=g, device="cuda") * 0.3
    with reference_ops():
        w_ref, i_ref = route(logits, bias, k, "sigmoid", 1, 1, True, 1.0, 1e-20)
    poison_allocator()
    w, i = route(logits, bias, k, "sigmoid", 1, 1, True, 1.0, 1e-20)
    return {"route.ids_exact": float((i != i_ref).sum().item()), "route.weights": worst_rel_err(w, w_ref)}


def check_rms_norm(T=77, seed=17) -> dict:
    """The three RMSNorm forms at the models' widths (K3 7168, Kimi-Linear 2304, MLA's latent 512 read
    with the 576-wide row stride, KDA's per-head 128 over T x 32 rows), per row against float64."""
    g = _gen(seed)
    out = {}
    for D, stride in ((7168, 7168), (2304, 2304), (512, 576), (128, 128)):
        rows = T * 32 if D == 128 else T
        x = (torch.randn(rows, stride, generator=g, device="cuda") * 3).to(BF16)[:, :D]
        w = 1 + 0.3 * torch.randn(D, generator=g, device="cuda")
        gate = torch.randn(rows, D, generator=g, device="cuda").to(BF16)
        with reference_ops():
            refs = [rms_norm(x.double(), w.double(), 1e-5), rms_norm_fp32_weight(x.double(), w.double(), 1e-5, F64),
                    gated_rms_norm(x.float().double(), w.double(), gate.double(), 1e-5, F64)]
        poison_allocator()
        gots = [rms_norm(x, w, 1e-5), rms_norm_fp32_weight(x, w, 1e-5, BF16), gated_rms_norm(x.float(), w, gate, 1e-5, BF16)]
        for name, got, ref in zip(("kimi", "fp32_weight", "gated"), gots, refs):
            out[f"rms_norm.{name}.D{D}"] = worst_rel_err(got, ref)
        # the residual add fused into Kimi's norm (the sum bit-equal to torch's bf16 add), and an fp32
        # row normed as its bf16 rounding (AttnRes: bf16 mix, then norm) bit-equal to rounding first
        s, y = add_rms_norm(x, gate, w, 1e-5)
        out[f"rms_norm.add_sum_exact.D{D}"] = float(not torch.equal(s, x + gate))
        out[f"rms_norm.add_norm_exact.D{D}"] = float(not torch.equal(y, rms_norm(x + gate, w, 1e-5)))
        # a MoE layer's two parts added in the same pass: x + (r1 + r2), the bits of torch's two bf16 adds
        s2, y2 = add_rms_norm(x, gate, w, 1e-5, residual2=x.flip(0))
        out[f"rms_norm.add_two_parts_exact.D{D}"] = float(not torch.equal(s2, x + (gate + x.flip(0))))
        out[f"rms_norm.add_two_parts_norm_exact.D{D}"] = float(not torch.equal(y2, rms_norm(s2, w, 1e-5)))
        mix = x.float() + 0.01 * gate.float()
        out[f"rms_norm.rounded_input_exact.D{D}"] = float(not torch.equal(rms_norm(mix, w, 1e-5, BF16),
                                                                          rms_norm(mix.to(BF16), w, 1e-5)))
    return out


def check_glu(seed=18) -> dict:
    """SiLU and SITU gating on merged gate|up rows (the dense MLP's and shared experts' widths)."""
    g = _gen(seed)
    out = {}
    for T, I in ((1, 1024), (77, 9216), (300, 3072)):
        merged = (torch.randn(T, 2 * I, generator=g, device="cuda") * 3).to(BF16)
        gate, up = merged.chunk(2, dim=-1)
        with reference_ops():
            refs = [silu_and_mul(gate.double(), up.double()), situ_and_mul(gate.double(), up.double(), 8.0, 32.0)]
        poison_allocator()
        gots = [silu_and_mul(gate, up), situ_and_mul(gate, up, 8.0, 32.0)]
        for name, got, ref in zip(("silu", "situ"), gots, refs):
            out[f"glu.{name}.T{T}"] = worst_rel_err(got, ref)
    return out


def check_linear(seed=30) -> dict:
    """ops.linear and linear_glu on the streaming kernel (gemv_max_rows 8) at 1-8 rows against torch's
    linear (and the activation op), on a projection shape of each slice and ragged ones."""
    from kimik3.ops import linear as ops_linear
    from kimik3.ops.options import kernel_options, use_kernel_options
    g = _gen(seed)
    out = {}
    cublas, streaming = kernel_options().tuned(gemv_max_rows=0), kernel_options().tuned(gemv_max_rows=8)
    for N, K in ((2304, 4096), (6720, 2304), (1000, 333)):
        w = (torch.randn(N, K, generator=g, device="cuda") * K ** -0.5).to(BF16)
        for M in (1, 3, 8):
            x = torch.randn(M, K, generator=g, device="cuda").to(BF16)
            with use_kernel_options(cublas):
                ref, ref_glu = ops_linear.linear(x, w), ops_linear.linear_glu(x, w, "situ", 4.0, 25.0)
            with use_kernel_options(streaming):
                poison_allocator()
                out[f"linear.{N}x{K}.M{M}"] = worst_rel_err(ops_linear.linear(x, w), ref)
                out[f"linear_glu.{N}x{K}.M{M}"] = worst_rel_err(ops_linear.linear_glu(x, w, "situ", 4.0, 25.0), ref_glu)
    return out


CHECKS = {
    "linear": check_linear,
    "rms_norm": check_rms_norm, "glu": check_glu,
    "conv": check_conv, "kda": check_kda, "kda_snapshots": check_kda_snapshots,
    "kda_normed": lambda: check_kda(lens=(9, 1, 30), ctx=(0, 3, 7), seed=27, normed=True),
    "kda_normed_softplus": lambda: check_kda(lens=(5, 2), ctx=(2, 0), H=32, lower_bound=None, seed=28, normed=True),
    "kda_snapshots_softplus": lambda: check_kda_snapshots(lens=(2, 4, 1), H=4, lower_bound=None, seed=16), "mla_decode": check_mla_decode, "mla_prefill": check_mla_prefill,
    "moe_small": lambda: check_moe(T=3), "moe_mid": lambda: check_moe(T=37),
    "moe_one_token": lambda: check_moe(T=1, seed=29),     # k distinct experts, a block each, no alignment
    "moe_one_multiply": lambda: check_moe(T=5, tell_scale_max=True, seed=9),
    "moe_high_scales": lambda: check_moe(T=5, shift=20, seed=10),
    "moe_high_scales_told": lambda: check_moe(T=5, shift=20, tell_scale_max=True, seed=11),
    "moe_large": lambda: check_moe(T=700, E=8, L=1024, I=512, k=4), "attn_res": check_attn_res,
    # the register-operand kernels (moe_wgmma, sm_90; widths of whole 256-position macro steps): each block size
    # and warp count; 37 tokens top-4 of 16 give 2-17 rows an expert (ragged blocks), 128 tokens 32 (several
    # blocks an expert below BT 32); an odd number of macro steps (L 768)
    **{f"moe_wgmma_bt{bt}_w{w}": (lambda bt=bt, w=w: check_moe(T=37, I=512, seed=40 + bt + w, tiles=dict(BT=bt, warps=w)))
       for bt in (8, 16, 32, 64) for w in (4, 8)},
    "moe_wgmma_many_blocks": lambda: check_moe(T=128, E=16, L=1024, I=512, k=4, seed=41, tiles=dict(BT=16, warps=8)),
    "moe_wgmma_odd_macro_steps": lambda: check_moe(T=20, L=768, I=768, seed=45, tiles=dict(BT=16, warps=4)),
    "moe_wgmma_high_scales": lambda: check_moe(T=37, I=512, shift=20, seed=42, tiles=dict(BT=16, warps=4)),
    "moe_wgmma_one_token": lambda: check_moe(T=1, I=512, seed=43, tiles=dict(BT=8, warps=8)),
    # two tiles a program (the activations staged once for both)
    **{f"moe_wgmma_two_bt{bt}_w{w}": (lambda bt=bt, w=w: check_moe(
        T=70, L=512, I=512, seed=44 + bt + w, tiles=dict(BT=bt, warps=w, two=True)))
       for bt, w in ((16, 4), (32, 8), (64, 4))},
    "moe_64_row_tiles": lambda: check_moe(T=128, E=16, L=1024, I=512, k=4, seed=26),   # 32 rows an expert: BM 64
    # past MXFP4_GROUPED_MM_ROWS_PER_EXPERT rows per expert: dequantized chunks through torch._grouped_mm
    "moe_grouped": lambda: check_moe(T=_grouped_tokens(16, 4), E=16, L=1024, I=512, k=4, seed=24),
    "moe_grouped_high_scales": lambda: check_moe(T=_grouped_tokens(8, 4), E=8, L=512, I=384, k=4, shift=20, seed=25),
    "dequantize_mxfp4": check_dequantize_mxfp4, "dequantize_mxfp4_high": lambda: check_dequantize_mxfp4(20, 31),
    "attn_res_norm": check_attn_res_norm, "route": check_route,
    "moe_dense_decode": lambda: check_moe_dense(T=1), "moe_dense_b8": lambda: check_moe_dense(T=8),
    "moe_dense_mid": lambda: check_moe_dense(T=37), "moe_dense_prefill": lambda: check_moe_dense(T=1500),
    "moe_dense_fp16_top16": lambda: check_moe_dense(T=21, E=64, k=16, dtype=torch.float16, seed=13),
    "moe_dense_situ": lambda: check_moe_dense(T=9, E=32, L=512, I=384, k=4, act="situ", seed=14),
    # past GROUPED_MM_ROWS_PER_EXPERT rows per expert: torch._grouped_mm between our sort, gating and combine
    "moe_dense_grouped": lambda: check_moe_dense(T=2100, seed=19),
    "moe_dense_grouped_w13": lambda: check_moe_dense(T=2100, seed=22, w13=True),
    "moe_dense_decode_w13": lambda: check_moe_dense(T=1, seed=23, w13=True),
    "moe_dense_decode_fp16_situ_top16": lambda: check_moe_dense(T=1, E=64, L=3584, I=768, k=16, dtype=torch.float16,
                                                                act="situ", seed=24),
    "moe_dense_grouped_situ": lambda: check_moe_dense(T=300, E=32, L=512, I=384, k=8, act="situ", seed=20),
    "cache_latent": check_cache_latent,
    "kda_decode_conv": check_kda_decode_conv,
    "kda_decode_conv_bounded_w2": lambda: check_kda_decode_conv(N=3, H=8, W=2, lower_bound=-5.0, seed=27),
    "kda_decode_conv_low_rank": lambda: check_kda_decode_conv(low_rank=True, seed=28),
    "kda_decode_conv_low_rank_bounded": lambda: check_kda_decode_conv(N=2, H=8, lower_bound=-5.0, seed=29, low_rank=True),
    # the tiny test checkpoints' 16-wide heads: a rank below the kernel's 32-wide chunks
    "kda_decode_conv_low_rank_narrow": lambda: check_kda_decode_conv(N=3, H=4, K=16, seed=30, low_rank=True),
    # more sequences than ops.kda.DECODE_LOW_RANK_MAX_SEQS: the op computes the low-rank operands first
    "kda_decode_conv_low_rank_large_batch": lambda: check_kda_decode_conv(N=20, H=8, seed=31, low_rank=True),
}


def bound(name: str) -> float:
    """Exactness flags must be 0; fp32-arithmetic results far under 1e-3; bf16 ones under 1e-2."""
    if name.endswith("_exact"):
        return 0.0
    if name.startswith(("attn_res", "route")):
        return 1e-4          # fp32 arithmetic
    return BF16_BOUND


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_fast_op_matches_reference(check):
    results = CHECKS[check]()
    bad = {k: v for k, v in results.items() if not v <= bound(k)}
    assert not bad, f"{check}: {bad} (all: {results})"


@pytest.mark.skipif(not os.environ.get(flash_kda.ENV), reason="KIMIK3_FLASH_KDA names no FlashKDA library")
def test_flash_kda_prefill_matches_reference():
    """The opt-in FlashKDA prefill (K3's bounded gate, 96 heads): ragged varlen with sequences of 1 and
    1000+ tokens, states from scattered slots, against the fp32 reference, under the same bounds as fla."""
    probe = torch.empty(1, 1, 128, dtype=BF16, device="cuda")
    assert flash_kda.flash_kda_applies(probe, probe, -5.0)
    assert not flash_kda.flash_kda_applies(probe, probe, None)        # the softplus gate stays on fla
    results = check_kda(lens=(700, 1, 67, 1300), ctx=(0, 12, 5, 0), seed=31)
    bad = {k: v for k, v in results.items() if not v <= bound(k)}
    assert not bad, f"FlashKDA: {bad} (all: {results})"


@pytest.mark.skipif(not os.environ.get(flash_mla.ENV), reason="KIMIK3_FLASH_MLA names no FlashMLA library")
def test_flash_mla_decode_matches_reference():
    """The opt-in FlashMLA decode (64-token blocks) at K3's 96 heads, Kimi-Linear's 32 and 12 (K3 at TP 8):
    ragged lengths from 1 to 4,096 over scattered blocks, against float64, per sequence."""
    q_lat, q_pe = torch.empty(1, 4, 512, dtype=BF16, device="cuda"), torch.empty(1, 4, 64, dtype=BF16, device="cuda")
    assert flash_mla.flash_mla_applies(q_lat, q_pe, torch.empty(2, 64, 576, dtype=BF16, device="cuda"))
    assert not flash_mla.flash_mla_applies(q_lat, q_pe, torch.empty(2, 16, 576, dtype=BF16, device="cuda"))
    for H, seed in ((96, 40), (32, 41), (12, 42)):
        results = check_mla_decode(H=H, seed=seed)
        assert results["mla.decode"] <= BF16_BOUND, (H, results)


@pytest.mark.skipif(not os.environ.get(flash_mla.ENV), reason="KIMIK3_FLASH_MLA names no FlashMLA library")
def test_flash_mla_decode_replays_in_a_graph():
    """Captured once, replayed on new queries, lengths and block tables: the same bits as an eager call
    on those inputs (the scheduler's metadata is recomputed inside the graph)."""
    g = _gen(43)
    cache, tables = _paged([300, 5000, 1], 64, 576, g, num_blocks=200)
    q_lat = torch.randn(3, 96, 512, generator=g, device="cuda").to(BF16)
    q_pe = torch.randn(3, 96, 64, generator=g, device="cuda").to(BF16)
    lens = torch.tensor([300, 5000, 1], dtype=torch.int32, device="cuda")
    graph, out = capture_graph(lambda: mla_decode_attention(q_lat, q_pe, cache, tables, lens, 512, 0.07,
                                                            max_seq_len=8192))
    q_lat.copy_(torch.randn(3, 96, 512, generator=g, device="cuda"))
    lens.copy_(torch.tensor([64, 4001, 129], dtype=torch.int32, device="cuda"))
    tables[2, :3] = torch.tensor([190, 7, 150], dtype=torch.int32, device="cuda")
    graph.replay()
    eager = mla_decode_attention(q_lat, q_pe, cache, tables, lens, 512, 0.07, max_seq_len=8192)
    assert torch.equal(out, eager)
    with reference_ops():
        ref = mla_decode_attention(q_lat.double(), q_pe.double(), cache.double(), tables, [64, 4001, 129], 512, 0.07)
    assert worst_rel_err(out, ref) <= BF16_BOUND


@pytest.mark.skipif(not os.environ.get(flash_mla.ENV), reason="KIMIK3_FLASH_MLA names no FlashMLA library")
def test_flash_mla_layers_share_one_schedule():
    """Two MLA layers of one step (their own caches and queries, the step's lengths) with one ``plans`` dict:
    one schedule, computed by the first inside the capture, and both outputs the bits of separate eager calls
    after a replay on new lengths and tables."""
    g = _gen(44)
    caches = [_paged([300, 5000, 1], 64, 576, g, num_blocks=200) for _ in range(2)]
    tables = caches[0][1]
    qs = [(torch.randn(3, 32, 512, generator=g, device="cuda").to(BF16),
           torch.randn(3, 32, 64, generator=g, device="cuda").to(BF16)) for _ in range(2)]
    lens = torch.tensor([300, 5000, 1], dtype=torch.int32, device="cuda")
    plans_seen = []

    def step():
        plans = {}
        outs = [mla_decode_attention(ql, qp, c, tables, lens, 512, 0.07, max_seq_len=8192, plans=plans)
                for (ql, qp), (c, _) in zip(qs, caches)]
        plans_seen.append(len(plans))
        return outs
    graph, outs = capture_graph(step)
    assert plans_seen[-1] == 1
    lens.copy_(torch.tensor([64, 4001, 129], dtype=torch.int32, device="cuda"))
    tables[2, :3] = torch.tensor([190, 7, 150], dtype=torch.int32, device="cuda")
    for ql, qp in qs:
        ql.copy_(torch.randn(3, 32, 512, generator=g, device="cuda"))
    graph.replay()
    for out, (ql, qp), (c, _) in zip(outs, qs, caches):
        assert torch.equal(out, mla_decode_attention(ql, qp, c, tables, lens, 512, 0.07, max_seq_len=8192))


def test_softplus_gate_kda_prefill_and_decode():
    results = check_kda(lens=(70, 3), ctx=(0, 4), H=4, lower_bound=None, seed=7)
    bad = {k: v for k, v in results.items() if not v <= bound(k)}
    assert not bad, results


@pytest.mark.parametrize("given", [True, False], ids=["has_state", "decode_kernel"])
def test_conv_decode_batch(given):
    results = check_conv(lens=(1,) * 9, ctx=(3, 1, 5, 8, 2, 2, 9, 4, 1), seed=8, given=given)
    assert results["conv.y"] < BF16_BOUND and results["conv.pool_exact"] == 0, results


def compiled_variants(kernel) -> int:
    """Compiled specialisations of a Triton kernel so far (all devices)."""
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


def test_mla_decode_compiles_few_variants_as_contexts_grow():
    """A sequence that grows block by block changes the decode's split count at almost every block
    (1 .. 64 here); the split count is a runtime argument, so the kernels compile a handful of
    specialisations (Triton's ==1 / %16 ones), not one per count; every launch stays exact."""
    from kimik3.ops.triton import mla_decode as m
    H, R, P, bs = 32, 512, 64, 16
    g = _gen(5)
    cache, tables = _paged([64 * bs], bs, R + P, g)
    q_lat = torch.randn(1, H, R, generator=g, device="cuda").to(BF16)
    q_pe = torch.randn(1, H, P, generator=g, device="cuda").to(BF16)
    before = compiled_variants(m._mla_decode_split_kernel), compiled_variants(m._mla_decode_merge_kernel)
    for blocks in range(1, 65):
        n = blocks * bs - 3
        with reference_ops():
            ref = mla_decode_attention(q_lat.double(), q_pe.double(), cache.double(), tables, [n], R, 0.07)
        out = mla_decode_attention(q_lat, q_pe, cache, tables, torch.tensor([n], device="cuda"), R, 0.07, max_seq_len=n)
        assert worst_rel_err(out, ref) < BF16_BOUND, n
    split = compiled_variants(m._mla_decode_split_kernel) - before[0]
    merge = compiled_variants(m._mla_decode_merge_kernel) - before[1]
    assert split <= 3 and merge <= 10, (split, merge)      # merge: one per power-of-two bound on the count


def test_kernels_behind_served_compile_stalls_compile_once_per_tile_shape():
    """A served step can have any size, and the kernels whose compiles stalled served passes
    (benchmarks/history/07-2026-12-01.md, sixth session) now compile once per tile shape, exact each time: the
    KDA q/k L2 norm for every row count; the expert alignment for every row count whose tile
    bounds (next powers of two of the rows and the padded capacity) agree; the split-K merge of
    MLA prefill for every split count."""
    from kimik3.ops.triton import l2norm, mla_prefill
    from kimik3.ops.triton import moe as moe_kernels
    g = _gen(11)
    before = compiled_variants(l2norm._l2norm_kernel)
    for T in (1, 7, 16, 33, 683, 684, 4097):              # 683 / 684 tokens at 96 heads: fla's NB buckets
        x = (torch.randn(T, 96, 128, generator=g, device="cuda") * 3).to(BF16)
        x64 = x.double()
        ref = x64 / torch.sqrt(x64.pow(2).sum(-1, keepdim=True) + 1e-6)
        assert (l2norm.l2norm_triton(x).double() - ref).abs().max().item() <= 2 ** -8, T
    assert compiled_variants(l2norm._l2norm_kernel) - before <= 1          # (0: an earlier test compiled it)

    E, k, BM = 256, 8, 16                                   # Kimi-Linear's routing: odd T gives R % 16 = 8
    before = compiled_variants(moe_kernels._align_kernel)
    for T in (257, 258, 301, 333, 400, 511):               # R = 8 T in (2048, 4096]; capacity in (4096, 8192]
        ids = torch.stack([torch.randperm(E, generator=g, device="cuda")[:k] for _ in range(T)])
        rows, block_expert = moe_kernels._sort_by_expert(ids, E, BM)
        R = T * k
        placed = rows[rows != R]
        assert torch.equal(placed.sort().values, torch.arange(R, device="cuda")), T
        assert torch.equal(block_expert[torch.nonzero(rows != R)[:, 0] // BM], ids.reshape(-1)[placed]), T
    assert compiled_variants(moe_kernels._align_kernel) - before <= 1

    cfg = mla_prefill.PrefillConfig(16, 16, 4, 2)
    T, S, Hq, DA, DB, DV = 4, 512, 2, 32, 16, 16
    qa, qb = (torch.randn(T, Hq, d, generator=g, device="cuda").to(BF16) for d in (DA, DB))
    ka, kb = torch.randn(S, Hq, DA, generator=g, device="cuda").to(BF16), torch.randn(S, 1, DB, generator=g, device="cuda").to(BF16)
    v = torch.randn(S, Hq, DV, generator=g, device="cuda").to(BF16)
    cu = lambda xs: torch.tensor([0, *xs], device="cuda").cumsum(0).int()      # noqa: E731
    pos = lambda xs: torch.tensor(xs, device="cuda", dtype=torch.int32)         # noqa: E731
    args = (qa, qb, ka, kb, v, cu([T]), cu([S]), pos([S]), pos([0]), T, 0.1, torch.float32, cfg)
    one, one_lse = mla_prefill.mla_prefill_triton(*args, max_key_len=S, num_splits=1)
    before = compiled_variants(mla_prefill._merge_splits_kernel)
    for splits in (2, 3, 5, 8, 11, 16):
        o, lse = mla_prefill.mla_prefill_triton(*args, max_key_len=S, num_splits=splits)
        # each split rounds its own probabilities to bf16 for the PV product: 2^-9 of |o| <= ~1
        assert (o - one).abs().max().item() < 4e-3 and (lse - one_lse).abs().max().item() < 1e-4, splits
    assert compiled_variants(mla_prefill._merge_splits_kernel) - before <= 1

    # MLA prefill over batch sizes 1..8: the position arrays start 16-byte aligned whatever the
    # size (3dd9428 compiled a second variant whenever N + 1 was not a multiple of 4)
    H, R, dn, dr, dv, bs = 2, 64, 16, 16, 16, 16           # head dims no other test compiles
    cache = torch.randn(64, bs, R + dr, generator=g, device="cuda").to(BF16)
    kv_b = (torch.randn(H * (dn + dv), R, generator=g, device="cuda") / 8).to(BF16)
    before = compiled_variants(mla_prefill._mla_prefill_kernel)
    for N in range(1, 9):
        qlens, ctx = [1 + n % 3 for n in range(N)], [5 + 7 * n for n in range(N)]
        tables = torch.stack([torch.randperm(63, generator=g, device="cuda")[:8] + 1 for _ in range(N)]).int()
        q = torch.randn(sum(qlens), H, dn + dr, generator=g, device="cuda").to(BF16)
        o = mla_prefill_attention(q, cache, tables, kv_b, qlens, ctx, R, dv, 0.25, form="absorbed")
        with reference_ops():
            ref = mla_prefill_attention(q.float(), cache.float(), tables, kv_b.float(), qlens, ctx, R, dv, 0.25,
                                        form="absorbed")
        assert worst_rel_err(o, ref, qlens) < BF16_BOUND, N
    assert compiled_variants(mla_prefill._mla_prefill_kernel) - before <= 2    # unsplit and split-K
