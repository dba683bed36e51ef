"""The CPU's waiting draft rows (``engine/spec/draft_lag.py``): which rows wait, and how waiting rows are caught up
(against brute force over positions, block sizes and lags)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kimik3.engine.spec.draft_lag import MAX_LAG, defer_rows, waiting
from kimik3.engine.spec.draft_model import ModelState
from kimik3.model.draft_step import DraftWork


def _req(blocks: int = 64):
    return SimpleNamespace(spec=ModelState(), cache=SimpleNamespace(block_ids=[100 + b for b in range(blocks)]))


def _work(req, first: int, n: int, row0: int, block_size: int) -> DraftWork:
    table = req.cache.block_ids
    positions = list(range(first, first + n))
    return DraftWork(list(range(row0, row0 + n)), [1000 + p for p in positions], positions,
                     [table[p // block_size] * block_size + p % block_size for p in positions], [], [], [])


@pytest.mark.parametrize("sizes", [[5, 1, 1, 2, 1, 3, 1, 1, 4, 1] * 30, [1] * 600], ids=["mixed", "decode"])
@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_rows_wait_unless_a_block_completes_or_too_many_wait(prefix_caching, block_size, sizes):
    """Chunks of 1-5 rows of one request that never drafts: its rows wait unless, with prefix caching, a chunk
    completes a block (a cached block's draft rows are written) or more than ``MAX_LAG`` would wait; then the
    waiting rows and the chunk's are caught up in order, each waiting row's state the one its step held."""
    req, first, lag_rows = _req(blocks=1000), 0, []
    for step, n in enumerate(sizes):
        work = _work(req, first, n, 7, block_size)
        states = torch.arange(40.0).view(20, 2) + 100 * step
        out, moved = defer_rows(work, [(req, 0, n)], set(), states, lambda r: r.spec, block_size, prefix_caching)
        positions = list(range(first, first + n))
        completes = prefix_caching and any((q + 1) % block_size == 0 for q in positions)
        if not completes and len(lag_rows) + n <= MAX_LAG:
            lag_rows += [(q, states[7 + j].clone()) for j, q in enumerate(positions)]
            assert work.rows == [] and moved == {} and waiting(req.spec.lag) == len(lag_rows)
        else:
            want = lag_rows + [(q, states[7 + j]) for j, q in enumerate(positions)]
            assert work.positions == [q for q, _ in want]
            assert work.next_ids == [1000 + q for q, _ in want]
            assert work.slots == [(100 + q // block_size) * block_size + q % block_size for q, _ in want]
            assert torch.equal(out[work.rows], torch.stack([s for _, s in want]))
            assert moved == {j: len(lag_rows) + j for j in range(n)} and req.spec.lag == []
            lag_rows = []
        states.add_(1e6)             # the step's buffer is overwritten: waiting rows keep their copies
        first += n


def test_a_drafting_request_catches_up_and_others_wait():
    """Two requests in one step: the head (drafting) catches up its waiting rows and its own, the other waits."""
    bs = 4
    a, b = _req(), _req()
    work = DraftWork([0, 1], [11, 21], [5, 9], [0, 0], [], [], [])
    work.slots = [a.cache.block_ids[1] * bs + 1, b.cache.block_ids[2] * bs + 1]
    states = torch.tensor([[1.0], [2.0]])
    defer_rows(work, [(a, 0, 1), (b, 1, 1)], set(), states, lambda r: r.spec, bs, False)
    assert waiting(a.spec.lag) == 1 and waiting(b.spec.lag) == 1
    work = DraftWork([0, 1], [12, 22], [6, 10], [0, 0], [], [], [])
    work.slots = [a.cache.block_ids[1] * bs + 2, b.cache.block_ids[2] * bs + 2]
    out, moved = defer_rows(work, [(a, 0, 1), (b, 1, 1)], {id(a)}, torch.tensor([[3.0], [4.0]]), lambda r: r.spec,
                            bs, False)
    assert work.positions == [5, 6] and work.next_ids == [11, 12] and out[work.rows].view(-1).tolist() == [1.0, 3.0]
    assert moved == {0: 1} and a.spec.lag == [] and waiting(b.spec.lag) == 2
