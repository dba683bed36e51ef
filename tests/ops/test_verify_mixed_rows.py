"""A CPU verify step whose sequences carry different numbers of rows (a few with drafts, the rest one row: #55):
the conv and the KDA recurrence cost the rows present, not every sequence padded to the longest. Checked against
the float64 formulas sequence by sequence (a fresh, zero state among them), the pool slots each row names, the
slots not named untouched, and in float32 bit for bit against the ops a sequence alone would take (the decode
step for one-row sequences, the equal-rows verify for the others, ``causal_conv1d`` for the conv)."""

from __future__ import annotations

import pytest
import torch

from kimik3.ops.conv import causal_conv1d, causal_conv1d_rows_in_pool
from kimik3.ops.kda import _reference_inputs, kda_attention_in_pool, kda_recurrent_in_pool, naive_recurrent_kda

LENS = [[2, 1, 1, 2, 1], [1, 1, 1], [3, 2, 2], [1, 4, 1], [2, 2, 1], [1, 1, 3]]
SLOTS = 24


def _table(lens: list[int], live: list[int]) -> torch.Tensor:
    """[N, max len]: a fresh slot after each non-final row, but scratch 0 after row 1; the live slot at the last."""
    table = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    nxt = 1
    for n, q in enumerate(lens):
        for t in range(q - 1):
            if t != 1:
                table[n, t] = nxt
                nxt += 1
        table[n, q - 1] = live[n]
    return table


def _live(lens, consecutive=False):
    """Live slots: descending (gathered), or consecutive (the pool rows updated in place, ``slot_range``)."""
    return [SLOTS - len(lens) + n if consecutive else SLOTS - 1 - n for n in range(len(lens))]


def _kda_inputs(T, H, K, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)      # noqa: E731
    return r(T, H, K), r(T, H, K), r(T, H, K), r(T, H, K), r(T, H), r(H), r(H * K)


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("lens", LENS)
def test_kda_mixed_rows_match_float64_recurrence(lens, consecutive):
    H, K = 2, 8
    N, T = len(lens), sum(lens)
    q, k, v, f, b, A_log, dt_bias = _kda_inputs(T, H, K, torch.float64, seed=sum(lens))
    pool = torch.randn(SLOTS, H, K, K, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    live = _live(lens, consecutive)
    pool[live[-1]] = 0                                   # a fresh slot: zero state
    table = _table(lens, live)
    before = pool.clone()
    cu = torch.tensor([0, *lens]).cumsum(0)
    o = kda_recurrent_in_pool(q, k, v, f, b, A_log, dt_bias, -5.0, pool, table, lens, cu)
    qn, kn, vf, g, beta = _reference_inputs(q, k, v, f, b, A_log, dt_bias, -5.0, torch.float64)
    for n, ql in enumerate(lens):
        rows = slice(int(cu[n]), int(cu[n]) + ql)
        on, sn = naive_recurrent_kda(qn[rows], kn[rows], vf[rows], g[rows], beta[rows], before[live[n]])
        torch.testing.assert_close(o[rows], on, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(pool[live[n]], sn, rtol=1e-12, atol=1e-12)
        for t in range(ql - 1):
            if table[n, t]:
                r = slice(int(cu[n]), int(cu[n]) + t + 1)
                _, s_t = naive_recurrent_kda(qn[r], kn[r], vf[r], g[r], beta[r], before[live[n]])
                torch.testing.assert_close(pool[table[n, t]], s_t, rtol=1e-12, atol=1e-12)
    named = set(table.reshape(-1).tolist()) - {0}
    untouched = [i for i in range(1, SLOTS) if i not in named]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("lens", LENS)
def test_kda_mixed_rows_as_alone(lens):
    """float32: one-row sequences as a decode step of them, the others as an equal-rows verify."""
    H, K = 2, 8
    N, T = len(lens), sum(lens)
    q, k, v, f, b, A_log, dt_bias = _kda_inputs(T, H, K, torch.float32, seed=3 + sum(lens))
    pool = torch.randn(SLOTS, H, K, K, generator=torch.Generator().manual_seed(8))
    live, cu = _live(lens), torch.tensor([0, *lens]).cumsum(0)
    table = _table(lens, live)
    ref_pool = pool.clone()
    o = kda_recurrent_in_pool(q, k, v, f, b, A_log, dt_bias, -5.0, pool, table, lens, cu)
    args = (q, k, v, f, b)
    for group in ({n for n in range(N) if lens[n] == 1}, {n for n in range(N) if lens[n] > 1}):
        for L in sorted({lens[n] for n in group}):
            seqs = [n for n in sorted(group) if lens[n] == L]
            rows = torch.cat([torch.arange(int(cu[n]), int(cu[n]) + L) for n in seqs])
            sub = [a[rows] for a in args]
            if L == 1:
                ref = kda_attention_in_pool(*sub, A_log, dt_bias, -5.0, ref_pool, torch.tensor([live[n] for n in seqs]),
                                            None, [1] * len(seqs), torch.arange(len(seqs) + 1), decode=True)
            else:
                ref = kda_recurrent_in_pool(*sub, A_log, dt_bias, -5.0, ref_pool, table[seqs, :L], [L] * len(seqs),
                                            torch.arange(0, L * len(seqs) + 1, L))
            torch.testing.assert_close(o[rows], ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pool[1:], ref_pool[1:], rtol=1e-6, atol=1e-6)      # slot 0: scratch


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("lens", LENS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_conv_mixed_rows(lens, dtype, consecutive):
    """The outputs as ``causal_conv1d`` of the same windows (to rounding) and as the float64 formula; the window
    after each row in its slot, the final one in the live slot; a sequence without history reads zeros."""
    g = torch.Generator().manual_seed(30 + sum(lens))
    N, C, W = len(lens), 6, 4
    x = torch.randn(sum(lens), 3 * C, dtype=dtype, generator=g)
    w = torch.randn(3 * C, W, dtype=dtype, generator=g)
    pool = torch.randn(SLOTS, 3 * C, W - 1, dtype=dtype, generator=g)
    live = _live(lens, consecutive)
    slots, table = torch.tensor(live), _table(lens, live)
    has_state = torch.tensor([n != N - 1 for n in range(N)])                # the last sequence: fresh
    before = pool.clone()
    cu = torch.tensor([0, *lens]).cumsum(0)
    y = torch.cat(causal_conv1d_rows_in_pool(x, w, pool, slots, has_state, lens, cu, table, 3), dim=-1)
    windows = before[slots].masked_fill(~has_state.view(-1, 1, 1), 0)
    y_ref, _ = causal_conv1d(x, w, windows, lens)
    torch.testing.assert_close(y, y_ref, rtol=1e-6 if dtype == torch.float32 else 1e-14, atol=1e-7)
    for n, ql in enumerate(lens):
        hist = torch.cat([windows[n].t(), x[cu[n]:cu[n] + ql]]).double()     # oldest first
        for t in range(ql):
            z = (hist[t:t + W] * w.double().t()).sum(0)
            torch.testing.assert_close(y[cu[n] + t].double(), z * torch.sigmoid(z),
                                       rtol=1e-12 if dtype == torch.float64 else 1e-5, atol=1e-6)
            if table[n, t]:
                assert torch.equal(pool[table[n, t]].double(), hist[t + 1:t + W].t()), (n, t)
    named = set(table.reshape(-1).tolist()) - {0}
    untouched = [i for i in range(1, SLOTS) if i not in named]
    assert torch.equal(pool[untouched], before[untouched])
