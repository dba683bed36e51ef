"""The CPU KDA decode/verify path updates its states in place (#52: the 65-sequence step's copies of the states):
bit-identical to the former out-of-place formula (kept here verbatim), equal to ``naive_recurrent_kda`` in float64,
and the pool rows read/written as before (other rows untouched)."""

from __future__ import annotations

import pytest
import torch

from kimik3.ops.kda import _reference_inputs, kda_attention_in_pool, kda_recurrent_in_pool, naive_recurrent_kda


def _old_rows(q, k, v, g, beta, state, rows, lens, after=None):
    """``recurrent_kda_rows`` before the in-place change (clone, new S each step, copy back)."""
    N, H, V, K = state.shape
    S = state.clone()
    o = q.new_empty(q.shape[0], H, V)
    lens_t = None
    for t in range(max(lens, default=0)):
        r = rows[:, t]
        dec, kt = torch.exp(g[r]), k[r]
        sk = torch.bmm(S.view(N * H, V, K), (dec * kt).view(N * H, K, 1)).view(N, H, V)
        delta = beta[r].unsqueeze(-1) * (v[r] - sk)
        Sn = torch.baddbmm((S * dec.unsqueeze(-2)).view(N * H, V, K), delta.view(N * H, V, 1),
                           kt.view(N * H, 1, K)).view(N, H, V, K)
        active = None
        if min(lens) <= t:
            lens_t = torch.tensor(lens, device=q.device) if lens_t is None else lens_t
            active = lens_t > t
            Sn = torch.where(active.view(-1, 1, 1, 1), Sn, S)
        out = torch.bmm(Sn.view(N * H, V, K), q[r].reshape(N * H, K, 1)).view(N, H, V)
        if active is None:
            o[r] = out
        else:
            o[r[active]] = out[active]
        S = Sn
        if after is not None:
            after(t, active, S)
    state.copy_(S)
    return o


def _inputs(T, H, K, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)      # noqa: E731
    return (r(T, H, K), r(T, H, K), r(T, H, K), r(T, H, K), r(T, H), r(H), r(H * K))


def _old_decode_in_pool(q, k, v, f, b, A_log, dt_bias, lb, pool, slots, has_state):
    """The former CPU decode step of ``kda_attention_in_pool``: gather, masked copy, ``to(copy=True)``, the
    clone inside the rows function, scatter."""
    state0 = pool[slots] if has_state is None else pool[slots].masked_fill(~has_state.view(-1, 1, 1, 1), 0)
    qn, kn, vf, g, beta = _reference_inputs(q, k, v, f, b, A_log, dt_bias, lb, state0.dtype)
    state = state0.to(qn.dtype, copy=True)
    o = _old_rows(qn, kn, vf, g, beta, state, torch.arange(q.shape[0])[:, None], [1] * q.shape[0])
    pool[slots] = state.to(pool.dtype)
    return o


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("masked", [False, True])
def test_decode_in_pool_matches_old_path_bitwise(dtype, masked):
    N, H, K, slots_n = 5, 3, 8, 9
    q, k, v, f, b, A_log, dt_bias = _inputs(N, H, K, dtype, seed=1)
    pool = torch.randn(slots_n, H, K, K, generator=torch.Generator().manual_seed(2), dtype=dtype)
    slots = torch.tensor([7, 2, 4, 1, 8])
    has_state = torch.tensor([True, False, True, True, False]) if masked else None
    ref_pool = pool.clone()
    ref = _old_decode_in_pool(q, k, v, f, b, A_log, dt_bias, -5.0, ref_pool, slots, has_state)
    for _ in range(3):             # three steps: the states chain through the pool
        o = kda_attention_in_pool(q, k, v, f, b, A_log, dt_bias, -5.0, pool, slots, has_state, [1] * N,
                                  torch.arange(N + 1), decode=True)
        assert torch.equal(o, ref) and torch.equal(pool, ref_pool)          # other slots untouched as well
        ref = _old_decode_in_pool(q, k, v, f, b, A_log, dt_bias, -5.0, ref_pool, slots, has_state)
    # float64 against the reference recurrence, sequence by sequence, from the pool before the step
    if dtype == torch.float64:
        before = pool.clone()
        o = kda_attention_in_pool(q, k, v, f, b, A_log, dt_bias, -5.0, pool, slots, has_state, [1] * N,
                                  torch.arange(N + 1), decode=True)
        qn, kn, vf, g, beta = _reference_inputs(q, k, v, f, b, A_log, dt_bias, -5.0, torch.float64)
        for n in range(N):
            s0 = before[slots[n]] if has_state is None or has_state[n] else torch.zeros_like(before[0])
            on, sn = naive_recurrent_kda(qn[n:n + 1], kn[n:n + 1], vf[n:n + 1], g[n:n + 1], beta[n:n + 1], s0)
            torch.testing.assert_close(o[n], on[0], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(pool[slots[n]], sn, rtol=1e-12, atol=1e-12)
        untouched = [i for i in range(slots_n) if i not in slots.tolist()]
        assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("lens", [[3, 1, 2], [1, 2, 1, 1], [2, 3, 2], [1, 1, 2]])
def test_verify_in_pool_matches_old_path_bitwise(lens):
    """Ragged short chunks (a verify step, a few sequences with drafts among one-row ones): every row's output
    and state into its slot as the former padded steps (each step over every sequence, the done ones masked)."""
    H, K, N = 2, 8, len(lens)
    T = sum(lens)
    q, k, v, f, b, A_log, dt_bias = _inputs(T, H, K, torch.float32, seed=3 + T)
    pool = torch.randn(24, H, K, K, generator=torch.Generator().manual_seed(4))
    live = list(range(24 - N, 24))
    table = torch.tensor([[live[n] if t >= q - 1 else (0 if t == 1 else 1 + 3 * n + t) for t in range(max(lens))]
                          for n, q in enumerate(lens)])                 # after row 1 scratch 0; live from the last row
    cu = torch.tensor([0, *lens]).cumsum(0)
    ref_pool = pool.clone()
    o = kda_recurrent_in_pool(q, k, v, f, b, A_log, dt_bias, -5.0, pool, table, lens, cu)

    qn, kn, vf, g, beta = _reference_inputs(q, k, v, f, b, A_log, dt_bias, -5.0, ref_pool.dtype)
    live = torch.tensor(live)
    state = ref_pool[live].to(qn.dtype)

    def keep(t, active, S):
        dst = table[:, t]
        if active is not None:
            dst, S = dst[active], S[active]
        ref_pool[dst] = S

    rows = cu[:-1, None] + torch.minimum(torch.arange(max(lens))[None], torch.tensor(lens)[:, None] - 1)
    ref = _old_rows(qn, kn, vf, g, beta, state, rows, lens, keep)
    ref_pool[live] = state
    assert torch.equal(o, ref) and torch.equal(pool[1:], ref_pool[1:])     # slot 0: scratch, any write order


def test_verify_rows_of_equal_length_match_float64_recurrence():
    """A verify step's usual shape, every sequence with the same rows (the pool written in one scatter): the
    outputs and the state after each row, against ``naive_recurrent_kda`` in float64 sequence by sequence; the
    scratch slot may repeat, slots not named are untouched, the live slot (the last column) ends with the final
    state."""
    N, L, H, K = 3, 4, 2, 8
    q, k, v, f, b, A_log, dt_bias = _inputs(N * L, H, K, torch.float64, seed=5)
    pool = torch.randn(16, H, K, K, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    table = torch.tensor([[3, 0, 4, 9], [0, 0, 5, 10], [6, 7, 8, 11]])
    live = table[:, -1]
    before = pool.clone()
    o = kda_recurrent_in_pool(q, k, v, f, b, A_log, dt_bias, -5.0, pool, table, [L] * N,
                              torch.arange(0, N * L + 1, L))
    qn, kn, vf, g, beta = _reference_inputs(q, k, v, f, b, A_log, dt_bias, -5.0, torch.float64)
    for n in range(N):
        rows = slice(n * L, (n + 1) * L)
        on, _ = naive_recurrent_kda(qn[rows], kn[rows], vf[rows], g[rows], beta[rows], before[live[n]])
        torch.testing.assert_close(o[rows], on, rtol=1e-12, atol=1e-12)
        for t in range(L):
            if table[n, t]:
                r = slice(n * L, n * L + t + 1)
                _, s_t = naive_recurrent_kda(qn[r], kn[r], vf[r], g[r], beta[r], before[live[n]])
                torch.testing.assert_close(pool[table[n, t]], s_t, rtol=1e-12, atol=1e-12)
    untouched = [i for i in range(16) if i not in set(table.reshape(-1).tolist())]
    assert torch.equal(pool[untouched], before[untouched])
