"""A CPU decode step whose slots are consecutive updates its pool rows in place (``ops/pool_rows.py``): the same
outputs and pool, bit for bit, as the gathered copy of other slot orders, the float64 formulas, other rows untouched;
a sequence without history reads zeros."""

from __future__ import annotations

import pytest
import torch

from kimik3.ops.conv import causal_conv1d_in_pool
from kimik3.ops.kda import _reference_inputs, kda_attention_in_pool, naive_recurrent_kda
from kimik3.ops.pool_rows import slot_range

SLOTS = 12


def test_slot_range_is_a_view_only_for_consecutive_slots():
    pool = torch.arange(SLOTS * 2.0).view(SLOTS, 2)
    for n in (1, 3, 9):
        rows = slot_range(pool, torch.arange(3, 3 + n))
        assert rows is not None and rows.data_ptr() == pool[3].data_ptr() and torch.equal(rows, pool[3:3 + n])
    for slots in ([3, 5, 4], [5, 4, 3], [3, 4, 6], [11, 12], []):
        assert slot_range(pool, torch.tensor(slots, dtype=torch.int64)) is None, slots


def _kda(N, H, K, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)      # noqa: E731
    return r(N, H, K), r(N, H, K), r(N, H, K), r(N, H, K), r(N, H), r(H), r(H * K)


@pytest.mark.parametrize("dtype, pool_dtype", [(torch.float32, torch.float32), (torch.float64, torch.float64),
                                               (torch.float64, torch.float32)])   # the last: a wider step, copied back
@pytest.mark.parametrize("masked", [False, True])
def test_kda_decode_on_consecutive_slots(dtype, pool_dtype, masked):
    N, H, K = 4, 2, 8
    q, k, v, f, b, A_log, dt_bias = _kda(N, H, K, dtype, seed=11)
    pool = torch.randn(SLOTS, H, K, K, generator=torch.Generator().manual_seed(12), dtype=pool_dtype)
    has_state = torch.tensor([True, False, True, True]) if masked else None
    before = pool.clone()
    # the same sequences at consecutive slots 3..6 (in place) and at scattered slots (gathered), in a second pool
    other = pool.clone()
    scattered = torch.tensor([9, 1, 7, 0])
    other[scattered] = pool[3:7]
    args = (A_log, dt_bias, -5.0)
    o = kda_attention_in_pool(q, k, v, f, b, *args, pool, torch.arange(3, 7), has_state, [1] * N,
                              torch.arange(N + 1), decode=True)
    o2 = kda_attention_in_pool(q, k, v, f, b, *args, other, scattered, has_state, [1] * N, torch.arange(N + 1),
                               decode=True)
    assert torch.equal(o, o2) and torch.equal(pool[3:7], other[scattered])
    keep = [i for i in range(SLOTS) if not 3 <= i < 7]
    assert torch.equal(pool[keep], before[keep])
    qn, kn, vf, g, beta = _reference_inputs(q.double(), k.double(), v.double(), f.double(), b.double(),
                                            A_log.double(), dt_bias.double(), -5.0, torch.float64)
    for n in range(N):
        s0 = before[3 + n].double() * (0 if masked and not has_state[n] else 1)
        on, sn = naive_recurrent_kda(qn[n:n + 1], kn[n:n + 1], vf[n:n + 1], g[n:n + 1], beta[n:n + 1], s0)
        tol = 1e-12 if pool_dtype == torch.float64 else 1e-5
        torch.testing.assert_close(o[n].double(), on[0], rtol=tol, atol=tol)
        torch.testing.assert_close(pool[3 + n].double(), sn, rtol=tol, atol=tol)


@pytest.mark.parametrize("masked", [False, True])
def test_conv_decode_on_consecutive_slots(masked):
    N, C, W = 4, 6, 4
    g = torch.Generator().manual_seed(13)
    x = torch.randn(N, 3 * C, dtype=torch.float64, generator=g)
    w = torch.randn(3 * C, W, dtype=torch.float64, generator=g)
    pool = torch.randn(SLOTS, 3 * C, W - 1, dtype=torch.float64, generator=g)
    has_state = torch.tensor([True, True, False, True]) if masked else None
    before, other = pool.clone(), pool.clone()
    scattered = torch.tensor([9, 1, 7, 0])
    other[scattered] = pool[3:7]
    cu = torch.arange(N + 1)
    y = torch.cat(causal_conv1d_in_pool(x, w, pool, torch.arange(3, 7), has_state, [1] * N, cu, 3), dim=-1)
    y2 = torch.cat(causal_conv1d_in_pool(x, w, other, scattered, has_state, [1] * N, cu, 3), dim=-1)
    assert torch.equal(y, y2) and torch.equal(pool[3:7], other[scattered])
    keep = [i for i in range(SLOTS) if not 3 <= i < 7]
    assert torch.equal(pool[keep], before[keep])
    for n in range(N):
        hist = torch.cat([before[3 + n].t() * (0 if masked and not has_state[n] else 1), x[n:n + 1]])   # [W, 3C]
        z = (hist * w.t()).sum(0)
        torch.testing.assert_close(y[n], z * torch.sigmoid(z), rtol=1e-12, atol=1e-12)
        assert torch.equal(pool[3 + n], hist[1:].t())
