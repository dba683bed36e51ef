"""MLA prefill attention in pieces of the context (kimik3/ops/mla.py, kimik3/ops/triton/mla_prefill.py)
against float64 attention computed straight from the math (spec token-mixers §4.2-4.3).

The Triton kernel runs on CPU through TRITON_INTERPRET=1 (tests/ops/conftest.py) at tiny sizes;
``KernelTuning.mla_prefill_block`` is shrunk so contexts span several pieces. Errors are bounded per sequence.
"""

import math

import pytest
import torch

from kimik3.ops import mla
from kimik3.ops.mla import merge_attention, mla_prefill_attention, prefill_form, prefill_pieces
from tests.helpers import LaunchRecorder, rel_errs

F64, BF16 = torch.float64, torch.bfloat16


def gen(seed):
    return torch.Generator().manual_seed(seed)


def softmax_attention(q, k, v, visible, scale):
    """Plain float64 softmax attention of q [Q, D] over k [K, D], v [K, Dv] (one head)."""
    s = (q.double() @ k.double().t() * scale).masked_fill(~visible, float("-inf"))
    return torch.softmax(s, dim=-1) @ v.double()


def paged(total_lens, bs, D, g, dtype=F64):
    """A paged cache with each sequence's blocks scattered over it, and its block tables."""
    need = [-(-L // bs) for L in total_lens]
    cache = torch.randn(sum(need) + 3, bs, D, generator=g).to(dtype)
    perm = torch.randperm(sum(need) + 3, generator=g)
    tables = torch.full((len(total_lens), max(need)), -1, dtype=torch.int32)
    used = 0
    for n, nb in enumerate(need):
        tables[n, :nb] = perm[used:used + nb].int()
        used += nb
    return cache, tables


def mla_from_math(q, cache, tables, kv_b, query_lens, context_lens, R, dv, scale):
    """Naive MLA, float64, one sequence and one head at a time: o [T, H, dv]."""
    T, H, d_qk = q.shape
    bs = cache.shape[1]
    dn = kv_b.shape[0] // H - dv
    w = kv_b.double().view(H, dn + dv, R)
    out, start = [], 0
    for n, (ql, cl) in enumerate(zip(query_lens, context_lens)):
        S = cl + ql
        e = torch.stack([cache[tables[n, p // bs], p % bs] for p in range(S)]).double()
        heads = []
        for h in range(H):
            k = torch.cat([e[:, :R] @ w[h, :dn].t(), e[:, R:]], dim=1)              # [S, dn + dr]
            v = e[:, :R] @ w[h, dn:].t()
            visible = torch.arange(S).view(1, S) <= torch.arange(cl, S).view(ql, 1)
            heads.append(softmax_attention(q[start:start + ql, h], k, v, visible, scale))
        out.append(torch.stack(heads, dim=1))
        start += ql
    return torch.cat(out)


# ---- (a) the merge -----------------------------------------------------------------------
def test_merge_of_pieces_is_plain_softmax():
    """Rows at positions 10..19 attend keys 0..19 causally; the keys split into pieces
    [0, 7), [7, 7) (empty), [7, 15) (the bound cuts it: rows 10..13 see part of it) and [15, 20)
    (rows 10..14 see none of it: lse -inf there)."""
    g = gen(0)
    Q, K, D, Dv, scale = 10, 20, 6, 5, 0.3
    q, k, v = torch.randn(Q, D, generator=g, dtype=F64), torch.randn(K, D, generator=g, dtype=F64), \
        torch.randn(K, Dv, generator=g, dtype=F64)
    qpos = torch.arange(10, 20).view(Q, 1)
    ref = softmax_attention(q, k, v, torch.arange(K).view(1, K) <= qpos, scale)
    o = torch.zeros(Q, Dv, dtype=F64)
    lse = torch.full((Q,), float("-inf"), dtype=F64)
    saw_empty_rows = False
    for lo, hi in ((0, 7), (7, 7), (7, 15), (15, 20)):
        s = (q @ k[lo:hi].t() * scale).masked_fill(torch.arange(lo, hi).view(1, -1) > qpos, float("-inf"))
        m = torch.logsumexp(s, dim=-1) if hi > lo else torch.full((Q,), float("-inf"), dtype=F64)
        p = torch.exp(s - m.masked_fill(m == float("-inf"), 0).unsqueeze(-1))
        saw_empty_rows |= bool((m == float("-inf")).any()) and hi > lo
        o, lse = merge_attention(o, lse, p @ v[lo:hi], m)
    assert saw_empty_rows
    assert (o - ref).abs().max().item() < 1e-12
    full = torch.logsumexp((q @ k.t() * scale).masked_fill(torch.arange(K).view(1, K) > qpos, float("-inf")), -1)
    assert (lse - full).abs().max().item() < 1e-12


def test_merge_of_two_empty_results_stays_empty():
    o, lse = merge_attention(torch.zeros(3, 2, dtype=F64), torch.full((3,), float("-inf"), dtype=F64),
                             torch.zeros(3, 2, dtype=F64), torch.full((3,), float("-inf"), dtype=F64))
    assert torch.equal(o, torch.zeros(3, 2, dtype=F64)) and bool((lse == float("-inf")).all())


def test_pieces_cover_every_key_once_within_the_block():
    query_lens, context_lens, block = [3, 1, 0, 6], [0, 25, 9, 11], 8
    pieces = prefill_pieces(query_lens, context_lens, block)
    seen = {n: [] for n in range(4)}
    for k_lens, k_pos0 in pieces:
        assert 0 < sum(k_lens) <= block
        for n, (kl, k0) in enumerate(zip(k_lens, k_pos0)):
            seen[n] += range(k0, k0 + kl)
    assert seen == {0: list(range(3)), 1: list(range(26)), 2: [], 3: list(range(17))}
    assert len(pieces) == math.ceil((3 + 26 + 17) / block)


# ---- (c) the op's reference path ---------------------------------------------------------
CASES = {   # (query_lens, context_lens): fresh prompts beside continuations spanning several pieces
    "mixed": ([5, 1, 7, 3], [0, 19, 3, 30]),
    "fresh": ([9, 4], [0, 0]),
    "one_long": ([2], [41]),
}


def _inputs(query_lens, context_lens, H, R, P, dn, dv, g, dtype=F64, bs=4):
    cache, tables = paged([c + q for c, q in zip(context_lens, query_lens)], bs, R + P, g, dtype)
    q = torch.randn(sum(query_lens), H, dn + P, generator=g).to(dtype)
    kv_b = (torch.randn(H * (dn + dv), R, generator=g) / math.sqrt(R)).to(dtype)
    return q, cache, tables, kv_b


@pytest.mark.parametrize("form", ["naive", "absorbed"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_path_in_pieces_matches_the_math(case, form, monkeypatch, kernel_options):
    kernel_options(mla_prefill_block=8)
    query_lens, context_lens = CASES[case]
    H, R, P, dn, dv = 3, 16, 8, 8, 8
    q, cache, tables, kv_b = _inputs(query_lens, context_lens, H, R, P, dn, dv, gen(1))
    scale = (dn + P) ** -0.5
    ref = mla_from_math(q, cache, tables, kv_b, query_lens, context_lens, R, dv, scale)
    out = mla_prefill_attention(q, cache, tables, kv_b, query_lens, context_lens, R, dv, scale, form=form)
    assert max(rel_errs(out, ref, query_lens)) < 1e-12


def test_form_rule_and_bad_form():
    assert prefill_form(4, 0) == "naive"                                    # nothing cached
    assert prefill_form(4, 1000) == "absorbed"                              # a short run over a context
    assert prefill_form(8192, 100000) == "naive"
    q, cache, tables, kv_b = _inputs([2], [3], 2, 16, 8, 8, 8, gen(2))
    with pytest.raises(ValueError, match="form"):
        mla_prefill_attention(q, cache, tables, kv_b, [2], [3], 16, 8, 0.3, form="flash")
    with pytest.raises(ValueError, match="query_lens"):
        mla_prefill_attention(q, cache, tables, kv_b, [3], [3], 16, 8, 0.3)


def test_mixed_forms_in_one_step_match_the_math(monkeypatch, kernel_options):
    """form=None: long chunks naive, decode-like rows over a context absorbed, in one call."""
    kernel_options(mla_prefill_block=8)
    kernel_options(mla_absorbed_max_query_len=4)
    query_lens, context_lens = [5, 1, 7, 3, 2], [0, 19, 3, 30, 0]
    assert [prefill_form(a, b) for a, b in zip(query_lens, context_lens)] == \
        ["naive", "absorbed", "naive", "absorbed", "naive"]
    H, R, P, dn, dv = 3, 16, 8, 8, 8
    q, cache, tables, kv_b = _inputs(query_lens, context_lens, H, R, P, dn, dv, gen(5))
    scale = (dn + P) ** -0.5
    calls = []
    inner = mla._prefill
    monkeypatch.setattr(mla, "_prefill", lambda *a: calls.append(a[9]) or inner(*a))          # a[9]: the form
    out = mla_prefill_attention(q, cache, tables, kv_b, query_lens, context_lens, R, dv, scale)
    assert sorted(calls) == ["absorbed", "naive"]
    ref = mla_from_math(q, cache, tables, kv_b, query_lens, context_lens, R, dv, scale)
    assert max(rel_errs(out, ref, query_lens)) < 1e-12


# ---- (b) the Triton kernel under the interpreter -----------------------------------------
triton_cases = pytest.mark.parametrize("form", ["naive", "absorbed"])


def _kernel_from_math(qa, qb, ka, kb, v, query_lens, q_pos0, k_lens, k_pos0, scale):
    """o, lse per row in float64 straight from the definitions (rows with no visible key: 0, -inf)."""
    T, Hq, _ = qa.shape
    Hk = ka.shape[1]
    v = ka if v is None else v
    o = torch.zeros(T, Hq, v.shape[-1], dtype=F64)
    lse = torch.full((T, Hq), float("-inf"), dtype=F64)
    qs = ks = 0
    for ql, c, kl, k0 in zip(query_lens, q_pos0, k_lens, k_pos0):
        for h in range(Hq):
            g = h // (Hq // Hk)
            k = torch.cat([ka[ks:ks + kl, g], kb[ks:ks + kl, min(g, kb.shape[1] - 1)]], dim=-1).double()
            qq = torch.cat([qa[qs:qs + ql, h], qb[qs:qs + ql, h]], dim=-1).double()
            s = (qq @ k.t() * scale).masked_fill(torch.arange(k0, k0 + kl).view(1, -1) >
                                                 torch.arange(c, c + ql).view(-1, 1), float("-inf"))
            for i in range(ql):
                if kl and bool(torch.isfinite(s[i]).any()):
                    lse[qs + i, h] = torch.logsumexp(s[i], 0)
                    o[qs + i, h] = torch.softmax(s[i], 0) @ v[ks:ks + kl, g].double()
        qs, ks = qs + ql, ks + kl
    return o, lse


@pytest.mark.parametrize("splits", [1, 3], ids=["one_split", "split_k"])
@triton_cases
def test_prefill_kernel_matches_the_math(form, splits):
    """One piece of a ragged batch: a fresh prompt, a continuation whose piece the causal bound
    cuts (rows before k_pos0 see nothing), one with no keys in this piece, one fully visible;
    in one program per query tile or split three ways over the keys (merged by the second kernel)."""
    from kimik3.ops.triton.mla_prefill import PrefillConfig, mla_prefill_triton
    g = gen(3)
    query_lens, q_pos0 = [20, 9, 3, 5], [0, 40, 12, 70]
    k_lens, k_pos0 = [20, 19, 0, 33], [0, 44, 0, 30]
    if form == "naive":
        Hq, Hk, DA, DB, DV = 3, 3, 32, 16, 16
    else:
        Hq, Hk, DA, DB, DV = 5, 1, 32, 16, 32
    T, S = sum(query_lens), sum(k_lens)
    qa, qb = torch.randn(T, Hq, DA, generator=g).to(BF16), torch.randn(T, Hq, DB, generator=g).to(BF16)
    ka, kb = torch.randn(S, Hk, DA, generator=g).to(BF16), torch.randn(S, 1, DB, generator=g).to(BF16)
    v = torch.randn(S, Hk, DV, generator=g).to(BF16) if form == "naive" else None
    scale = 0.2
    cu = lambda xs: torch.tensor([0, *xs], dtype=torch.int32).cumsum(0).int()     # noqa: E731
    o = torch.full((T, Hq, DV), float("nan"), dtype=torch.float32)
    lse = torch.full((T, Hq), float("nan"), dtype=torch.float32)
    cfg = PrefillConfig(16, 16, 4, 2)
    mla_prefill_triton(qa, qb, ka, kb, v, cu(query_lens), cu(k_lens), torch.tensor(q_pos0, dtype=torch.int32),
                       torch.tensor(k_pos0, dtype=torch.int32), max(query_lens), scale, torch.float32, cfg,
                       out=(o, lse), max_key_len=max(k_lens), num_splits=splits)
    o_ref, lse_ref = _kernel_from_math(qa, qb, ka, kb, v, query_lens, q_pos0, k_lens, k_pos0, scale)
    empty = lse_ref == float("-inf")
    assert empty.any() and (~empty).any()
    assert torch.equal(lse[empty], lse_ref[empty].float()) and bool((o[empty] == 0).all())
    seen = ~empty
    assert (lse[seen].double() - lse_ref[seen]).abs().max().item() < 2e-2      # scores of bf16 products
    errs = rel_errs(torch.where(empty.unsqueeze(-1), 0, o), o_ref, query_lens)
    assert all(e < 1e-2 or ql == 0 for e, ql in zip(errs, [20, 9, 0, 5])), errs


@pytest.mark.parametrize("sms", [4, 64], ids=["no_split", "split_k"])
@triton_cases
def test_prefill_op_on_the_kernel_path_matches_the_math(form, sms, monkeypatch, kernel_options):
    """The CUDA branch of the op (pieces, varlen gather, kernel, merge) run on CPU tensors; with
    64 "SMs" the kernel splits each piece's keys (3 tiles of 16) over programs."""
    kernel_options(mla_prefill_block=48)
    kernel_options(cpu_kernels=True)                                     # the kernels on CPU tensors
    from kimik3.ops.triton import mla_prefill
    monkeypatch.setattr(mla_prefill, "config_for", lambda da, dv: mla_prefill.PrefillConfig(16, 16, 4, 2))
    monkeypatch.setattr(mla_prefill, "_num_sms", lambda device: sms)
    kernel_options(mla_prefill_split_min_tiles=1)
    launches = []
    kernel = mla_prefill._merge_splits_kernel
    monkeypatch.setattr(mla_prefill, "_merge_splits_kernel", LaunchRecorder(kernel, launches))
    query_lens, context_lens = [6, 1, 17, 3], [0, 23, 5, 40]
    H, R, P, dn, dv = 2, 32, 16, 16, 16
    q, cache, tables, kv_b = _inputs(query_lens, context_lens, H, R, P, dn, dv, gen(4), BF16)
    scale = (dn + P) ** -0.5
    ref = mla_from_math(q, cache, tables, kv_b, query_lens, context_lens, R, dv, scale)
    out = mla_prefill_attention(q, cache, tables, kv_b, query_lens, context_lens, R, dv, scale, form=form)
    assert out.dtype == BF16 and (len(launches) > 0) == (sms == 64)
    errs = rel_errs(out, ref, query_lens)
    assert max(errs) < 2e-2, errs          # bf16 K/V (naive) or q_lat (absorbed), truncating roundings
