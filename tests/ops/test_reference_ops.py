"""CPU reference ops against independent float64 computations written from the spec, and the
spec README §6 checklist items that concern single ops."""

import math

import pytest
import torch

from kimik3.ops import mxfp4
from kimik3.ops.activation import situ_and_mul
from kimik3.ops.attn_res import attn_res_mix
from kimik3.ops.conv import causal_conv1d, causal_conv1d_rows_in_pool, conv_windows_at
from kimik3.ops.kda import chunk_kda_ref, kda_attention, kda_gate, kda_recurrent_in_pool, l2_normalize, \
    naive_recurrent_kda
from kimik3.ops.mla import mla_decode_attention, mla_prefill_attention
from kimik3.ops.norm import gated_rms_norm, rms_norm
from kimik3.ops.router import route

F64 = torch.float64


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ---- SITU ---------------------------------------------------------------------------------
@pytest.mark.parametrize("g,u,expected", [(1, 1, 0.715818), (-2, 3, -0.657874), (10, 50, 95.108022),
                                          (0, 5, 0.0), (3, -30, -50.438309)])
def test_situ_spot_values(g, u, expected):
    out = situ_and_mul(torch.tensor([float(g)], dtype=F64), torch.tensor([float(u)], dtype=F64), 4.0, 25.0)
    assert out.item() == pytest.approx(expected, abs=1e-6)


def test_situ_bounds_and_silu_limit():
    g = torch.randn(1000, dtype=F64, generator=gen(0)) * 50
    u = torch.randn(1000, dtype=F64, generator=gen(1)) * 200
    assert (situ_and_mul(g, u, 4.0, 25.0).abs() <= 100).all()
    silu = g * torch.sigmoid(g) * u
    assert torch.allclose(situ_and_mul(g, u, 1e9, None), silu, rtol=1e-9, atol=1e-9)


# ---- router -------------------------------------------------------------------------------
def test_router_bias_changes_choice_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]], dtype=F64)
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0], dtype=F64)
    w0, i0 = route(logits, None, 2, "sigmoid", 1, 1, True, 1.0, 1e-20)
    w1, i1 = route(logits, bias, 2, "sigmoid", 1, 1, True, 1.0, 1e-20)
    assert sorted(i0[0].tolist()) == [0, 1] and sorted(i1[0].tolist()) == [0, 3]
    s = torch.sigmoid(logits[0])
    expected = {e: (s[e] / (s[0] + s[3])).item() for e in (0, 3)}
    got = dict(zip(i1[0].tolist(), w1[0].tolist()))
    assert got == pytest.approx(expected, rel=1e-12)


def test_router_weights_sum_to_scaling_factor_and_groups_restrict_choice():
    logits = torch.randn(50, 16, dtype=F64, generator=gen(2))
    w, ids = route(logits, torch.randn(16, dtype=F64, generator=gen(3)), 4, "sigmoid", 4, 2, True, 2.5, 1e-20)
    assert torch.allclose(w.sum(-1), torch.full((50,), 2.5, dtype=F64), rtol=1e-12)
    # independent grouped selection: group score = sum of its top-2 biased scores
    c = torch.sigmoid(logits) + torch.randn(16, dtype=F64, generator=gen(3))
    for t in range(50):
        gs = [sorted(c[t, 4 * g:4 * g + 4].tolist())[-2:] for g in range(4)]
        keep = sorted(range(4), key=lambda g: -sum(gs[g]))[:2]
        allowed = [e for e in range(16) if e // 4 in keep]
        best = sorted(allowed, key=lambda e: -c[t, e].item())[:4]
        assert sorted(ids[t].tolist()) == sorted(best)


def test_router_softmax_without_renorm():
    logits = torch.randn(3, 6, dtype=F64, generator=gen(4))
    w, ids = route(logits, None, 2, "softmax", 1, 1, False, 1.0, 1e-20)
    assert torch.allclose(w, torch.softmax(logits, -1).gather(1, ids))


# ---- MXFP4 --------------------------------------------------------------------------------
def test_mxfp4_all_byte_values_round_trip_and_code_table():
    packed = torch.arange(256, dtype=torch.uint8).view(8, 32)
    codes = mxfp4.unpack_codes(packed)
    assert torch.equal(mxfp4.pack_codes(codes), packed)
    assert codes[0, :4].tolist() == [0, 0, 1, 0]                   # byte 0 -> (0,0); byte 1 -> low 1, high 0
    values = mxfp4.dequantize(torch.tensor([[0x10 * (c + 1 & 15) | c for c in range(16)]], dtype=torch.uint8),
                              torch.full((1, 1), 127, dtype=torch.uint8))
    assert values[0, 0::2].tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]


def test_mxfp4_scale_and_errors():
    packed = torch.full((2, 16), 0x22, dtype=torch.uint8)          # code 2 = 1.0 everywhere
    scale = torch.tensor([[130], [120]], dtype=torch.uint8)
    w = mxfp4.dequantize(packed, scale, F64)
    assert (w[0] == 2.0 ** 3).all() and (w[1] == 2.0 ** -7).all()
    with pytest.raises(ValueError, match="E8M0 NaN"):
        mxfp4.dequantize(packed, torch.full((2, 1), 255, dtype=torch.uint8))
    with pytest.raises(ValueError, match="does not match"):
        mxfp4.dequantize(packed, torch.zeros(2, 2, dtype=torch.uint8))


def test_mxfp4_k3_expert_shapes_and_quantize_exact_on_grid():
    from kimik3.inspect import stored_bytes
    stored = predicted = 0
    for w, (n, k) in (("w1", (3072, 3584)), ("w3", (3072, 3584)), ("w2", (3584, 3072))):   # one K3 expert
        dense = mxfp4.dequantize(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen(5)),
                                 torch.randint(110, 130, (n, k // 32), dtype=torch.uint8, generator=gen(6)))
        p, s = mxfp4.quantize(dense)
        assert (tuple(p.shape), tuple(s.shape)) == ((n, k // 2), (n, k // 32))
        assert torch.equal(mxfp4.dequantize(p, s), dense)
        stored += p.numel() * p.element_size() + s.numel() * s.element_size()
        predicted += stored_bytes(f"model.layers.1.block_sparse_moe.experts.0.{w}.weight", n * k, True)[1]
    assert stored == predicted == 17_547_264          # bytes per expert in the release (spec README)


# ---- RMSNorm ------------------------------------------------------------------------------
def test_rms_norm_formula_and_bf16_two_roundings():
    x = torch.randn(4, 32, dtype=F64, generator=gen(7))
    w = torch.randn(32, dtype=F64, generator=gen(8))
    ref = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-5) * w
    assert torch.allclose(rms_norm(x, w, 1e-5), ref, rtol=1e-13)
    xb, wb = x.bfloat16(), w.bfloat16()
    two = (xb.double() / torch.sqrt((xb.double() ** 2).mean(-1, keepdim=True) + 1e-5)).bfloat16() * wb
    assert torch.equal(rms_norm(xb, wb, 1e-5), two)


def test_gated_rms_norm_matches_formula():
    x, z = torch.randn(3, 2, 16, dtype=F64, generator=gen(9)), torch.randn(3, 2, 16, dtype=F64, generator=gen(10))
    w = torch.rand(16, dtype=F64, generator=gen(11))
    ref = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-5) * w / (1 + torch.exp(-z))
    assert torch.allclose(gated_rms_norm(x, w, z, 1e-5, F64), ref, rtol=1e-13)


# ---- attention residuals --------------------------------------------------------------------
def test_attn_res_identities_and_formula():
    g = gen(12)
    gamma, proj = torch.randn(8, dtype=F64, generator=g), torch.randn(1, 8, dtype=F64, generator=g)
    v = [torch.randn(5, 8, dtype=F64, generator=g) for _ in range(4)]
    assert torch.equal(attn_res_mix([v[0]], gamma, proj, 1e-5), v[0])
    assert torch.allclose(attn_res_mix([v[1]] * 3, gamma, proj, 1e-5), v[1], rtol=1e-14)
    out = attn_res_mix(v, gamma, proj, 1e-5)
    for t in range(5):
        s = [(x[t] / math.sqrt((x[t] ** 2).mean() + 1e-5) * gamma * proj[0]).sum() for x in v]
        a = torch.softmax(torch.stack(s), 0)
        assert torch.allclose(out[t], sum(a[i] * v[i][t] for i in range(4)), rtol=1e-13)


# ---- short conv ------------------------------------------------------------------------------
def test_causal_conv_matches_loop_and_carries_state():
    g = gen(13)
    x = torch.randn(9, 6, dtype=F64, generator=g)
    w = torch.randn(6, 4, dtype=F64, generator=g)
    state = torch.randn(2, 6, 3, dtype=F64, generator=g)
    y, new = causal_conv1d(x, w, state, [5, 4])
    for n, (s, q) in enumerate(((0, 5), (5, 4))):
        hist = torch.cat([state[n].t(), x[s:s + q]])                 # oldest first
        for t in range(q):
            z = (hist[t:t + 4] * w.t()).sum(0)
            assert torch.allclose(y[s + t], z * torch.sigmoid(z), rtol=1e-13)
        assert torch.equal(new[n], hist[-3:].t())


def test_conv_windows_at_are_the_histories_after_m_rows():
    g = gen(21)
    x = torch.randn(7, 5, dtype=F64, generator=g)             # two chunks: rows 0..3 and 4..6
    windows = torch.randn(2, 5, 3, dtype=F64, generator=g)
    cuts = [(0, 1), (0, 4), (1, 2), (1, 3), (0, 2)]
    seq, rows = (torch.tensor(v) for v in zip(*cuts))
    got = conv_windows_at(x, windows, torch.tensor([0, 4, 7]), seq, rows)
    for i, (n, m) in enumerate(cuts):
        hist = [windows[n][:, j] for j in range(3)] + [x[[0, 4][n] + t] for t in range(m)]   # oldest first
        assert torch.equal(got[i], torch.stack(hist[-3:], dim=1)), (n, m)


# ---- KDA ------------------------------------------------------------------------------------
def _kda_inputs(T, H=3, K=8, seed=14):
    g = gen(seed)
    return (torch.randn(T, H, K, dtype=F64, generator=g), torch.randn(T, H, K, dtype=F64, generator=g),
            torch.randn(T, H, K, dtype=F64, generator=g), torch.randn(T, H, K, dtype=F64, generator=g),
            torch.randn(T, H, dtype=F64, generator=g), torch.randn(H, dtype=F64, generator=g),
            torch.randn(H * K, dtype=F64, generator=g), torch.randn(1, H, K, K, dtype=F64, generator=g))


def test_kda_gate_bounded_and_softplus():
    f = torch.randn(7, 3, 8, dtype=F64, generator=gen(15)) * 3
    A, dt = torch.randn(3, dtype=F64, generator=gen(16)), torch.randn(24, dtype=F64, generator=gen(17))
    g = kda_gate(f, A, dt, -5.0)
    assert ((g > -5) & (g < 0)).all()
    z = f + dt.view(1, 3, 8)
    assert torch.allclose(g, -5 / (1 + torch.exp(-torch.exp(A).view(1, 3, 1) * z)), rtol=1e-13)
    sp = torch.where(z > 20, z, torch.log1p(torch.exp(z)))
    assert torch.allclose(kda_gate(f, A, dt, None), -torch.exp(A).view(1, 3, 1) * sp, rtol=1e-13)


@pytest.mark.parametrize("chunk", [1, 3, 16, 64])
def test_chunked_kda_equals_recurrence_with_ragged_tail(chunk):
    q, k, v, f, b, A, dt, s0 = _kda_inputs(37)
    qn, kn = l2_normalize(q) * 8 ** -0.5, l2_normalize(k)
    g, beta = kda_gate(f, A, dt, -5.0), torch.sigmoid(b)
    o1, s1 = naive_recurrent_kda(qn, kn, v, g, beta, s0[0])
    o2, s2 = chunk_kda_ref(qn, kn, v, g, beta, s0[0], chunk)
    assert torch.allclose(o1, o2, rtol=0, atol=1e-10) and torch.allclose(s1, s2, rtol=0, atol=1e-10)


def test_kda_attention_matches_independent_key_major_loop_and_state_layout():
    q, k, v, f, b, A, dt, s0 = _kda_inputs(11)
    o, s = kda_attention(q, k, v, f, b, A, dt, -5.0, s0, [11])
    S = s0[0].transpose(-1, -2).clone()                               # key-major [H, K, V]
    for t in range(11):
        for h in range(3):
            qh = q[t, h] / torch.sqrt((q[t, h] ** 2).sum() + 1e-6) / math.sqrt(8)
            kh = k[t, h] / torch.sqrt((k[t, h] ** 2).sum() + 1e-6)
            alpha = torch.exp(-5 * torch.sigmoid(torch.exp(A[h]) * (f[t, h] + dt[8 * h:8 * h + 8])))
            Sd = alpha.unsqueeze(1) * S[h]
            delta = torch.sigmoid(b[t, h]) * (v[t, h] - Sd.T @ kh)
            S[h] = Sd + torch.outer(kh, delta)
            assert torch.allclose(o[t, h], S[h].T @ qh, rtol=0, atol=1e-12)
    assert torch.allclose(s[0], S.transpose(-1, -2), rtol=0, atol=1e-12)   # stored V-first [H, V, K]


def test_kda_split_sequence_equals_whole_and_varlen_equals_alone():
    q, k, v, f, b, A, dt, s0 = _kda_inputs(20)
    whole, sw = kda_attention(q, k, v, f, b, A, dt, -5.0, s0, [20])
    first, s1 = kda_attention(q[:9], k[:9], v[:9], f[:9], b[:9], A, dt, -5.0, s0, [9])
    second, s2 = kda_attention(q[9:], k[9:], v[9:], f[9:], b[9:], A, dt, -5.0, s1, [11])
    assert torch.allclose(torch.cat([first, second]), whole, atol=1e-12) and torch.allclose(s2, sw, atol=1e-12)
    both, sb = kda_attention(q, k, v, f, b, A, dt, -5.0, torch.cat([s0, torch.zeros_like(s0)]), [9, 11])
    alone, _ = kda_attention(q[9:], k[9:], v[9:], f[9:], b[9:], A, dt, -5.0, torch.zeros_like(s0), [11])
    assert torch.allclose(both[:9], first, atol=1e-12) and torch.allclose(both[9:], alone, atol=1e-12)


def test_kda_decode_step_of_many_sequences_is_each_alone():
    """A decode step (one token per sequence) runs every sequence at once on the CPU: each output and final
    state is the sequence's own recurrence, and the caller's initial states are left as they were."""
    q, k, v, f, b, A, dt, _ = _kda_inputs(4, seed=30)
    s0 = torch.randn(4, 3, 8, 8, dtype=F64, generator=gen(31))
    before = s0.clone()
    o, s = kda_attention(q, k, v, f, b, A, dt, -5.0, s0, [1, 1, 1, 1])
    assert torch.equal(s0, before)
    for n in range(4):
        qn, kn = l2_normalize(q[n:n + 1]) * 8 ** -0.5, l2_normalize(k[n:n + 1])
        o1, s1 = naive_recurrent_kda(qn, kn, v[n:n + 1], kda_gate(f[n:n + 1], A, dt, -5.0), torch.sigmoid(b[n:n + 1]),
                                     s0[n])
        assert torch.allclose(o[n], o1[0], rtol=0, atol=1e-12) and torch.allclose(s[n], s1, rtol=0, atol=1e-12), n


def test_kda_recurrent_in_pool_keeps_the_state_after_each_listed_row():
    """Two short chunks with history: the outputs are the chunked op's over the whole chunk, each
    listed slot holds the chunked op's final state over that prefix, the live slot the final state,
    and slots the table does not name are untouched (slot 0 is scratch)."""
    q, k, v, f, b, A, dt, _ = _kda_inputs(6, seed=22)
    pool = torch.randn(8, 3, 8, 8, dtype=F64, generator=gen(23))
    before = pool.clone()
    lens, live = [4, 2], [3, 6]
    table = torch.tensor([[5, 0, 7, 3], [1, 6, 0, 0]])     # seq 0: after rows 1 and 3 into 5 and 7; seq 1: after row 1 into 1
    o = kda_recurrent_in_pool(q, k, v, f, b, A, dt, -5.0, pool, table, lens, torch.tensor([0, 4, 6]))
    for n, (start, ql) in enumerate(((0, 4), (4, 2))):
        rows = slice(start, start + ql)
        whole, _ = kda_attention(q[rows], k[rows], v[rows], f[rows], b[rows], A, dt, -5.0, before[live[n]][None], [ql])
        assert torch.allclose(o[rows], whole, rtol=0, atol=1e-12), n
        for t in range(ql):
            slot = int(table[n, t])
            if slot:
                _, s_t = kda_attention(q[start:start + t + 1], k[start:start + t + 1], v[start:start + t + 1],
                                       f[start:start + t + 1], b[start:start + t + 1], A, dt, -5.0,
                                       before[live[n]][None], [t + 1])
                assert torch.allclose(pool[slot], s_t[0], rtol=0, atol=1e-12), (n, t)
    assert torch.equal(pool[2], before[2]) and torch.equal(pool[4], before[4])


# ---- MLA ------------------------------------------------------------------------------------
def _mla_setup(seed=18, H=3, r=16, dn=8, dr=4, dv=8, bs=3):
    g = gen(seed)
    lengths = [7, 4]
    nblocks = 1 + sum(-(-n // bs) for n in lengths)
    cache = torch.zeros(nblocks, bs, r + dr, dtype=F64)
    tables, nxt = [], 1
    for n in lengths:
        m = -(-n // bs)
        tables.append(list(range(nxt, nxt + m)) + [-1] * (3 - m))
        nxt += m
    lat = [torch.randn(n, r + dr, dtype=F64, generator=g) for n in lengths]
    for s, n in enumerate(lengths):
        for p in range(n):
            cache[tables[s][p // bs], p % bs] = lat[s][p]
    wkvb = torch.randn(H * (dn + dv), r, dtype=F64, generator=g)
    return cache, torch.tensor(tables), lat, wkvb, lengths, (H, r, dn, dr, dv)


@pytest.mark.parametrize("form", ["naive", "absorbed"])
def test_mla_prefill_matches_expanded_attention(form):
    cache, tables, lat, wkvb, lengths, (H, r, dn, dr, dv) = _mla_setup()
    q = torch.randn(3 + 4, H, dn + dr, dtype=F64, generator=gen(19))
    out = mla_prefill_attention(q, cache, tables, wkvb, [3, 4], [4, 0], r, dv, 0.3, form=form)
    for s, (ql, cl, start) in enumerate(((3, 4, 0), (4, 0, 3))):
        kv = (lat[s][:, :r] @ wkvb.T).view(-1, H, dn + dv)
        for i in range(ql):
            pos = cl + i
            for h in range(H):
                keys = torch.cat([kv[:pos + 1, h, :dn], lat[s][:pos + 1, r:]], -1)
                p = torch.softmax(keys @ q[start + i, h] * 0.3, 0)
                assert torch.allclose(out[start + i, h], p @ kv[:pos + 1, h, dn:], atol=1e-12)


@pytest.mark.parametrize("group_rows", [1 << 16, 7])
def test_mla_decode_of_ragged_sequences_in_groups_is_each_alone(monkeypatch, group_rows):
    """The CPU decode path pads sequences to the longest of a group (groups bounded by DECODE_GROUP_ROWS):
    every sequence's output and log-sum-exp are its own attention's (float64, one sequence at a time, from the
    formula), a sequence of length 0 gives 0 and -inf, and cache rows past a sequence (NaN here) are not read."""
    import kimik3.ops.mla as mla
    monkeypatch.setattr(mla, "DECODE_GROUP_ROWS", group_rows)
    g, bs, H, R, P = gen(40), 3, 2, 6, 2
    lengths = [5, 0, 2, 7]
    cache = torch.full((12, bs, R + P), float("nan"), dtype=F64)
    tables = torch.tensor([[3, 1, -1], [0, 0, 0], [7, -1, -1], [2, 9, 4]])
    for n, length in enumerate(lengths):
        for p in range(length):
            cache[tables[n, p // bs], p % bs] = torch.randn(R + P, dtype=F64, generator=g)
    q_lat, q_pe = torch.randn(4, H, R, dtype=F64, generator=g), torch.randn(4, H, P, dtype=F64, generator=g)
    out, lse = mla_decode_attention(q_lat, q_pe, cache, tables, lengths, R, 0.4, return_lse=True)
    for n, length in enumerate(lengths):
        if not length:
            assert torch.equal(out[n], torch.zeros(H, R, dtype=F64)) and torch.isinf(lse[n]).all()
            continue
        e = torch.stack([cache[tables[n, p // bs], p % bs] for p in range(length)])     # [L, R + P]
        s = torch.cat([q_lat[n], q_pe[n]], -1) @ e.T * 0.4                             # [H, L]
        assert torch.allclose(lse[n], torch.log(torch.exp(s).sum(-1)), rtol=0, atol=1e-12)
        assert torch.allclose(out[n], torch.softmax(s, -1) @ e[:, :R], rtol=0, atol=1e-12), n


def test_mla_absorbed_decode_equals_naive():
    cache, tables, lat, wkvb, lengths, (H, r, dn, dr, dv) = _mla_setup()
    q = torch.randn(2, H, dn + dr, dtype=F64, generator=gen(20))
    naive = mla_prefill_attention(q, cache, tables, wkvb, [1, 1], [6, 3], r, dv, 192 ** -0.5, form="naive")
    w = wkvb.view(H, dn + dv, r)
    q_lat = torch.einsum("nhd,hdr->nhr", q[..., :dn], w[:, :dn])
    lat_out = mla_decode_attention(q_lat, q[..., dn:], cache, tables, lengths, r, 192 ** -0.5)
    absorbed = torch.einsum("nhr,hvr->nhv", lat_out, w[:, dn:])
    assert torch.allclose(absorbed, naive, rtol=0, atol=1e-10)


def test_causal_conv1d_decode_step_at_once():
    """A decode step (one row per sequence) is computed for all sequences at once: the float64 formula's values
    (bf16 in and out: within bf16's rounding), and no ops per sequence (64 sequences took ~64x one sequence's
    time in the Python loop, a quarter of a 65-sequence decode step of the default model on a CPU)."""
    import time
    g = gen(22)
    N, C, W = 64, 48, 4
    x = torch.randn(N, C, dtype=F64, generator=g)
    w = torch.randn(C, W, dtype=F64, generator=g)
    state = torch.randn(N, C, W - 1, dtype=F64, generator=g)
    y, new = causal_conv1d(x, w, state, [1] * N)
    for n in range(N):
        hist = torch.cat([state[n], x[n].unsqueeze(-1)], dim=-1)     # [C, W], oldest first
        z = (hist * w).sum(-1)
        assert torch.allclose(y[n], z * torch.sigmoid(z), rtol=1e-13), n
        assert torch.equal(new[n], hist[:, 1:])
    xb, sb, wb = x.bfloat16(), state.bfloat16(), w.bfloat16()
    yb, nb = causal_conv1d(xb, wb, sb, [1] * N)
    z = (torch.cat([sb, xb.unsqueeze(-1)], dim=-1).double() * wb.double()).sum(-1)
    assert yb.dtype == nb.dtype == torch.bfloat16 and torch.equal(nb, torch.cat([sb, xb.unsqueeze(-1)], -1)[..., 1:])
    assert torch.allclose(yb.double(), z * torch.sigmoid(z), rtol=1e-2, atol=1e-2)

    def best(k):
        times = []
        for _ in range(7):
            t = time.perf_counter()
            causal_conv1d(x[:k], w, state[:k], [1] * k)
            times.append(time.perf_counter() - t)
        return min(times)
    best(1), best(N)
    assert best(N) < 8 * best(1), (best(N), best(1))


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_causal_conv1d_equal_chunks_at_once(dtype):
    """A verify step (every sequence the same number of rows) is computed for all sequences at once: the float64
    formula's values, and each sequence's rows what it gets alone (the per-sequence loop; float32: up to the
    vectorized SiLU's rounding, which depends on where a row falls in the vector), its window bit for bit."""
    g = gen(23)
    N, q, C, W = 5, 3, 12, 4
    x = torch.randn(N * q, C, dtype=F64, generator=g).to(dtype)
    w = torch.randn(C, W, dtype=F64, generator=g).to(dtype)
    state = torch.randn(N, C, W - 1, dtype=F64, generator=g).to(dtype)
    y, new = causal_conv1d(x, w, state, [q] * N)
    for n in range(N):
        hist = torch.cat([state[n].t(), x[n * q:(n + 1) * q]]).double()        # oldest first
        for t in range(q):
            z = (hist[t:t + W] * w.double().t()).sum(0)
            torch.testing.assert_close(y[n * q + t].double(), z * torch.sigmoid(z), rtol=1e-5, atol=1e-6)
        y1, new1 = causal_conv1d(x[n * q:(n + 1) * q], w, state[n:n + 1], [q])
        torch.testing.assert_close(y[n * q:(n + 1) * q], y1, rtol=0 if dtype == F64 else 1e-6, atol=0)
        assert torch.equal(new[n], new1[0])


@pytest.mark.parametrize("lens", [[3, 3, 3], [1, 1], [3], [3, 1, 2]])
def test_causal_conv1d_rows_in_pool_keeps_the_window_after_each_row(lens):
    """A verify step's conv (equal chunks: all at once on the CPU; ragged: the pool conv and a gather): the
    float64 formula's outputs, the window after row t of sequence n in slot table[n, t] (slot 0 scratch, may
    repeat), the final window in the sequence's slot, slots not named untouched."""
    g = gen(24)
    N, C, W = len(lens), 6, 4
    x = torch.randn(sum(lens), 2 * C, dtype=F64, generator=g)
    w = torch.randn(2 * C, W, dtype=F64, generator=g)
    pool = torch.randn(12, 2 * C, W - 1, dtype=F64, generator=g)
    slots = torch.tensor([9, 10, 11][:N])
    table = torch.zeros(N, max(lens), dtype=torch.int64)
    nxt = 1
    for n, q in enumerate(lens):
        for t in range(q - 1):
            table[n, t] = nxt if t != 1 else 0       # row 1's window not kept (scratch)
            nxt += t != 1
        table[n, q - 1] = slots[n]
    before = pool.clone()
    cu = torch.tensor([0, *lens]).cumsum(0)
    y1, y2 = causal_conv1d_rows_in_pool(x, w, pool, slots, None, lens, cu, table, 2)
    y = torch.cat([y1, y2], dim=-1)
    for n, q in enumerate(lens):
        hist = torch.cat([before[slots[n]].t(), x[cu[n]:cu[n] + q]])              # oldest first
        for t in range(q):
            z = (hist[t:t + W] * w.t()).sum(0)
            assert torch.allclose(y[cu[n] + t], z * torch.sigmoid(z), rtol=1e-13), (n, t)
            if table[n, t]:
                assert torch.equal(pool[table[n, t]], hist[t + 1:t + W].t()), (n, t)
        assert torch.equal(pool[slots[n]], hist[-(W - 1):].t())
    named = set(table.reshape(-1).tolist()) | set(slots.tolist())
    untouched = [i for i in range(12) if i not in named]
    assert torch.equal(pool[untouched], before[untouched])
