"""A CPU's waiting draft rows (``draft_model.py``): the rows of a request that neither drafts nor watches wait, their
target states copied, until it drafts again (at batch 32 their catch-up cost 2-3% of a step that drafts nothing,
and a request that never drafts again drops them)."""

from __future__ import annotations

import torch

from kimik3.model.draft_step import DraftWork

MAX_LAG = 256        # rows a request's draft cache may lag behind
WATCH_LAG = 16       # a request with more rows waiting does not watch (``ModelDrafter._drafting``): its watch would
                     # catch them all up (at batch 32 a probe of a few requests made all 32 watch: 2,700 rows, 36 ms,
                     # most of a step), and where nothing drafts its acceptance matters little


def waiting(lag: list) -> int:
    """Rows waiting in a request's ``lag`` (consecutive positions)."""
    return lag[-1][1][-1] - lag[0][1][0] + 1 if lag else 0


def defer_rows(work: DraftWork, spans: list, heads: set[int], states: torch.Tensor, state_of, block_size: int,
               prefix_caching: bool):
    """Rows of requests that neither draft nor watch now wait, their target states copied (``ModelState.lag``);
    a request's waiting rows are caught up with its next caught-up rows (the step it drafts or watches, one that
    completes a block with prefix caching on: a cached block's draft rows are written, or ``MAX_LAG`` rows).
    Waiting rows at or past a chunk's first position are dropped (preempted and recomputed). Rewrites ``work``'s
    rows (those appended to ``states`` index past the step's rows): (the states, old row index -> new one).
    ``state_of``: a request's ``ModelState``."""
    rows, positions, slots, next_ids, extra, moved = [], [], [], [], [], {}
    held, cell, bs, top = [], [], block_size, states.shape[0]     # cell: [the step's waiting rows' states]
    for req, a, n in spans:
        s = state_of(req)
        first = work.positions[a]                     # a request's rows: consecutive positions
        if s.lag and s.lag[-1][1][-1] >= first:       # recomputed (preempted): its waiting rows are stale
            s.lag = [(f, p[:first - p[0]], x[:first - p[0]]) for f, p, x in s.lag if p[0] < first]
        pos = work.positions[a:a + n]
        if id(req) not in heads and waiting(s.lag) + n <= MAX_LAG and not (
                prefix_caching and (first + n) // bs > first // bs):    # (completes no block)
            s.lag.append(((cell, len(held)), pos, work.next_ids[a:a + n]))    # its states: cell[0][i:i + n]
            held.extend(work.rows[a:a + n])
            continue
        table = req.cache.block_ids
        for (f, i), p, x in s.lag:
            rows.extend(range(top, top + len(p)))
            top += len(p)
            extra.append(f[0][i:i + len(p)])
            positions.extend(p)
            slots.extend(table[q // bs] * bs + q % bs for q in p)
            next_ids.extend(x)
        s.lag = []
        for r in range(a, a + n):
            moved[r] = len(rows)
            rows.append(work.rows[r])
        positions.extend(pos)
        slots.extend(work.slots[a:a + n])
        next_ids.extend(work.next_ids[a:a + n])
    if held:    # one copy per step (a slice where the rows, ascending, are consecutive: a decode step's)
        cell.append(states[held[0]:held[-1] + 1].clone() if held[-1] - held[0] + 1 == len(held) else
                    states[torch.tensor(held, dtype=torch.int64, device=states.device)])
    work.rows, work.positions, work.slots, work.next_ids = rows, positions, slots, next_ids
    return (torch.cat([states, *extra]) if extra else states), moved
