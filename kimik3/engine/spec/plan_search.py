"""The search of a step's plan (``controller.py``): from each request's chance of reaching draft position j and the
step's costs, the drafts per request of the best expected goodput (tokens per second of the whole step): position by
position the best prefix of the requests (``greedy_depths``), or one depth for all (``uniform_depths``: CUDA
graphs), the deepest plan that beats the one before it by a margin (``best_level``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

FIRST_MARGIN = 1.10      # drafting must raise the expected goodput by 10%: the step model leaves out what drafting
                         # costs beside its steps (requests that draft finish unevenly, so a batch's last ones run
                         # alone: 64-token requests at batch 32 on a CPU spent a fifth of their time so) and the fits
                         # err; at a 2-9% gain (batch 32 on a CPU) the run was slower than plain decoding
BATCH_MARGIN = 0.08      # ... and 8% more of it per doubling of the batch (``first_margin``), up to MAX_MARGIN: both
MAX_MARGIN = 1.5         # grow with the batch (more rows priced from fewer probes, a longer tail); on a CPU at batch
                         # 32 a modelled 1.2x ran 0.87x plain
DEEPER_MARGIN = 1.02     # a deeper plan over the best shallower one: 2% (judged by the whole plan's goodput: 5% per
                         # position stopped a CPU's batch 1 at depth 2-3, though depth 4 was 7% faster than 3)


def reach(a: float, c, n: int) -> list[float]:
    """P(the first j drafts are all accepted), j = 1..n: a * c_2 * .. * c_j (``c``: one rate for every later
    position, or one per position)."""
    out, p = [], a
    for j in range(n):
        if j:
            p *= c if isinstance(c, (int, float)) else c[min(j - 1, len(c) - 1)]
        out.append(p)
    return out


@dataclass(frozen=True)
class Costs:
    base: float          # seconds of the step without drafts (target and draft)
    row: float           # a draft: its verify row and its draft row
    forward: float       # one more attending draft forward
    verify: float = 0.0  # a step that verifies drafts over one that does not (the target's verify path: on a CPU at
                         # batch 1 a third of a decode step, then a tenth of that per row)
    attend: float = 0.0  # the draft attending at all (its first forward over a later one's cost)
    watching: int = 0    # requests that compute their first draft anyway (the first forward runs)
    rows: float = math.inf  # most draft rows a plan may have (``TRUST``)

    def fixed(self, j: int) -> float:
        """What draft position ``j`` adds to the step beside its rows."""
        if j > 1:
            return self.forward
        return self.verify + (0.0 if self.watching else self.attend + self.forward)


def first_margin(batch: int) -> float:
    """How much drafting must raise a step's expected goodput at ``batch`` sequences (``FIRST_MARGIN``,
    ``BATCH_MARGIN``)."""
    return min(FIRST_MARGIN * (1.0 + BATCH_MARGIN * math.log2(max(batch, 1))), MAX_MARGIN)


def best_level(levels: list[tuple[float, list[int]]], margin: float) -> list[int]:
    """Of plans ever deeper ((goodput, depths), the first without drafts), the deepest that beats the one chosen
    before it by ``margin`` (over no drafts: ``first_margin``) or ``DEEPER_MARGIN``: a whole plan judged by its
    goodput, not position by position (a position that barely pays may lead to one that pays well: the verify
    step's fixed cost is paid once)."""
    best = 0
    for j in range(1, len(levels)):
        if levels[j][0] > levels[best][0] * (margin if best == 0 else DEEPER_MARGIN):
            best = j
    return levels[best][1]


def greedy_depths(reach: list[list[float]], rooms: list[int], tokens: float, costs: Costs,
                   margin: float) -> list[int]:
    """Position by position, the best prefix (by gain per cost) of the requests that reach it: one plan per depth
    (``best_level`` picks)."""
    time, depth = costs.base, [0] * len(reach)
    levels = [(tokens / time, list(depth))]
    for j in range(1, max(rooms, default=0) + 1):
        gains = sorted(((reach[i][j - 1], i) for i, room in enumerate(rooms) if depth[i] == j - 1 and room >= j),
                       reverse=True)
        best, take, total, planned = 0.0, 0, 0.0, sum(depth)
        for n, (g, _) in enumerate(gains, 1):
            if planned + n > costs.rows:
                break
            total += g
            ratio = (tokens + total) / (time + costs.fixed(j) + n * costs.row)
            if ratio > best:
                best, take = ratio, n
        if not take:
            break
        tokens += sum(g for g, _ in gains[:take])
        time += costs.fixed(j) + take * costs.row
        for _, i in gains[:take]:
            depth[i] = j
        levels.append((tokens / time, list(depth)))
    return best_level(levels, margin)


def uniform_depths(reach: list[list[float]], rooms: list[int], tokens: float, costs: Costs,
                    margin: float) -> list[int]:
    """The one depth d (each request min(d, its room)) of the best expected goodput (``best_level``)."""
    levels = [(tokens / costs.base, [0] * len(rooms))]
    for d in range(1, max(rooms, default=0) + 1):
        depth = [min(d, r) for r in rooms]
        if sum(depth) > costs.rows:
            break
        gain = sum(sum(reach[i][:n]) for i, n in enumerate(depth))
        time = costs.base + sum(costs.fixed(j) for j in range(1, d + 1)) + sum(depth) * costs.row
        levels.append(((tokens + gain) / time, depth))
    return best_level(levels, margin)
