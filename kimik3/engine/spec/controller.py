"""How many drafts each request of the next step carries: the measured acceptance against the measured cost.

A draft model's step (``draft_model.py``) chooses, per request, the number of drafts k_r (0: a plain decode step)
that maximises the step's expected goodput: emitted tokens per second of the whole step (target and draft),
SmartSpec's criterion (Liu et al. 2024, "Optimizing speculative decoding for serving LLMs using goodput"), per
request instead of one k for the batch.

* Acceptance (``Acceptance``, ``acceptance.py``, per request, and the drafter's global one as its prior): the rate
  at which the first draft is accepted, a, and the rate at which a later draft is accepted after the one before it
  was. The first j drafts are all accepted with probability a * c_2 * .. * c_j, c_i the global acceptance of
  position i after i - 1 (measured per position: later drafts fail more often) scaled by how the request's later
  drafts fare against everyone's. Verify steps update them (``settle``); a request that does not draft still gets
  its first draft computed now and then and scored against the token that comes (``watched``), so its rate follows
  the text and it drafts again once drafts would pay (only in steps where others draft: ``ModelDrafter._plan``).
  Exponentially decayed counts (recent text weighs most), pulled toward the global rates by ``PRIOR``
  pseudo-observations. The plan takes a draw of a from its Beta posterior (Thompson sampling, ``rates``; while the
  request is young not under its mean plus a standard deviation, less in a larger batch), not its mean: a request
  whose rate is little known (a new one, one whose first drafts failed, one that stopped drafting where nobody
  watches: batch 1) drafts now and then while its rate might pay, and is measured so; one known well drafts as its
  rate says. (With the mean, a warm-up's one rejected draft left a 0.4 prior that drafted nothing for 35 of a CPU's
  64 batch-1 steps: 0.95x plain where fixed depth 4 gave 1.55x.)
* Costs (``LinearFit``, ``linear_fit.py``): the target's step time against [1, sequences, draft rows, verifies]
  (verifies: 1 where the step verifies any draft: the target's verify path costs a third of a decode step on a CPU
  at batch 1, then a tenth of that per row; a linear fit without it priced every draft at the first one's cost and
  stopped at depth 2-3), one fit per batch-size octave (a draft row's cost changes with the batch: on a GPU at batch
  1 nearly nothing, on a CPU at batch 32 a decode row's), and the draft's time against [1, caught-up rows, forwards,
  forward rows, attends] (attends: 1 where any forward runs; the first costs more than a later one), one fit per
  octave too; decayed least squares with a weak prior taken from the octave's own first step (not another octave's
  fit: extrapolated from batch 1 to 32 it made deep drafts look cheap, 0.84x plain on a CPU), clipped against
  outliers from its second step on, on the engine's own decode steps (``ModelDrafter.clock``: wall time on a GPU,
  the process's CPU time on a CPU). Steps sized only by the plan would not tell a draft row's cost from the rest of
  a step, so some steps probe (``_dither``): a new batch size's first steps run one draft each, then none; later,
  while drafting, one step in ``PROBE_EVERY`` runs without drafts, one with a draft fewer each and one with a draft
  more each; while not drafting one in ``IDLE_PROBE_EVERY`` runs one draft for a random few of the requests.
* Plan (``DraftController.plan``; the search: ``plan_search.py``): from no drafts (B tokens in T seconds), draft
  position j = 1, 2, .. is added for the best prefix (by gain: the probability above) of the requests that reach it,
  each position's plan costed whole (a verify row and a draft row per draft, one more draft forward per position, the
  verify step's and the first forward's fixed costs at the first) and within ``TRUST`` times the draft rows the batch
  size's steps were measured with (costs are not linear in them; probes and the plans' own steps extend it); of these
  ever deeper plans the deepest that beats the one before it by ``DEEPER_MARGIN`` (no drafts: ``first_margin``, more
  at larger batches) is the step's (``best_level``: a whole plan judged by its goodput, so a first position that alone
  barely pays its fixed costs does not stop the deeper ones that pay, and a 5% margin per position no longer stops a
  CPU's batch 1 at depth 2-3 where depth 4 was 7% faster). So drafts stop where they stop paying (adversarial text, a
  weak draft, a large batch), for one request or for all, and the cost of one request's drafts is weighed against the
  whole step's. Requests that do not draft watch only in steps where others draft (their first drafts ride on a
  forward that runs anyway), so a step that drafts nothing costs only the draft's catch-up of its rows
  (tests/engine/spec/test_controller.py: injected CPU and GPU timings). With ``uniform`` (CUDA graphs) the plans are
  one depth for all requests, the same judgment picks. A step where no plan could pay even with every draft accepted
  (``idle``: a large batch on a CPU) draws no rates and plans nothing but its probes. A plan that drafts nothing
  (probes aside) holds for the next batch // ``REST_PER`` steps (at most ``MAX_REST``) of its batch-size octave
  (``rests``: no rates, no plan, no probe; the plan's idle probe is as likely as theirs together), so a large batch
  that does not draft plans one step in a few; a plan that drafts, a new octave or a batch under ``REST_PER`` plans
  every step.
* A table (vLLM's ``num_speculative_tokens_per_batch_size``, ``scheduled``) replaces the plan: each request drafts
  the table's number for the step's batch size, whatever the measurements (fixed-depth measurements).
"""

from __future__ import annotations

import logging
import random

from kimik3.engine.spec.acceptance import GLOBAL_DECAY, PRIOR, REQUEST_DECAY, Acceptance, Rate
from kimik3.engine.spec.linear_fit import COST_DECAY, LinearFit
from kimik3.engine.spec.plan_search import Costs, first_margin, greedy_depths, reach, uniform_depths

logger = logging.getLogger(__name__)

MAX_WATCH_GAP = 16       # a request that does not draft computes its first draft at least every 16 decode steps
PROBE_EVERY = 12         # steps between probes of each kind (at random; see ``DraftController._dither``)
IDLE_PROBE_EVERY = 96    # while nothing drafts: a probe of one draft for a few of the requests (acceptance is explored
                         # by sampling, ``rates``; a probe of all 32 every 12 steps doubled a CPU step: 5%)
EXPLORE = 2              # a batch size's first steps: one draft each, then none
TRUST = 2.0              # a plan's draft rows stay within twice the most its batch size's steps were measured with:
                         # the costs are not linear (a CPU's batch-32 verify step: a fixed cost, then cheaper rows),
                         # and a fit from probes of few rows priced 96 rows at half their cost (0.88x plain)
REST_PER = 8             # a plan that drafts nothing (probes aside) holds for the next batch // 8 steps of its
MAX_REST = 8             # octave, at most 8 (``DraftController.rests``): they draw no rates and plan nothing (at
                         # batch 32 on a CPU costs, rates and plan took 0.25 ms of a 45 ms step that drafts nothing,
                         # a fifth of the drafter's bookkeeping); below batch 8 every step plans (batch 1 unchanged)


class DraftController:
    """The costs and the global acceptance of one drafter, and the per-step plan (module docstring)."""

    def __init__(self, k: int, schedule: tuple[tuple[int, int, int], ...] | None = None):
        self.k = k
        self.schedule = schedule    # vLLM's num_speculative_tokens_per_batch_size: fixed drafts per batch size
        self.accept = Acceptance(Rate(1.2, 2.0), Rate(1.2, 2.0))     # optimistic start (0.6): drafts get measured
        self.positions = [Rate(1.2, 2.0) for _ in range(max(k - 1, 0))]   # global: draft j + 2 after j + 1 accepted
        # per batch-size octave: step seconds ~ [1, sequences, draft rows, verifies (1 where any)], and draft seconds
        # ~ [1, caught-up rows, forwards, forward rows, attends (1 where any forward)]
        self.steps: dict[int, LinearFit] = {}
        self.drafts: dict[int, LinearFit] = {}
        self.measured: dict[int, float] = {}    # per octave: the most draft rows of a step measured (decayed)
        self.rng = random.Random(0)
        self.uniform = False        # one number of drafts for every request of a step (CUDA graphs replay them)
        self._resting = (0, 0)      # (batch-size octave, steps left) that skip their plan (``rests``)

    def rates(self, acc: Acceptance, sample: bool = True, crowd: int = 1) -> tuple[float, list[float]]:
        """A request's first-draft acceptance and its acceptance at draft positions 2..k after the one before:
        the global rate of each position (later drafts fail more often), scaled by how the request's later drafts
        fare against everyone's. The first-draft rate is a draw from its posterior (Thompson sampling; ``sample``
        False: its mean), and while the request is young not under its mean plus the standard deviation its
        posterior would have after the drafts it has had scored (``seen``, undecayed): a request with few
        observations (a new one, or one whose early drafts failed) drafts now and then while its rate might pay, and
        so gets measured (Thompson alone left a quarter of simulated batch-1 runs stuck after an early rejection,
        where the rest of the request would repay a few drafts many times over); one with many where its rate
        says. That bound shrinks with the square root of the ``crowd`` of requests planned together (at batch 32 on
        a CPU, 32 new requests each taken at its bound drafted where their means would not: 0.91x plain)."""
        return self.rates_of([acc], sample, crowd)[0]

    def rates_of(self, accs: list[Acceptance], sample: bool = True, crowd: int = 1) -> list[tuple[float, list[float]]]:
        """``rates`` of each of ``accs`` in turn (the same draws, in order), the global rates computed once."""
        g = self.accept
        later = g.later.estimate(0.5, 0.0)
        prior = g.first.estimate(0.5, 0.0)
        positions = [p.estimate(0.5, 0.0) for p in self.positions]
        crowd, out = max(crowd, 1), []
        for acc in accs:
            scale = acc.later.estimate(later) / max(later, 1e-6)
            first = acc.first.estimate(prior)
            if sample:
                young = first + (first * (1.0 - first) / (acc.seen + PRIOR + 1.0) / crowd) ** 0.5
                first = max(acc.first.sample(prior, self.rng), min(young, 1.0))
            out.append((first, [min(1.0, q * scale) for q in positions]))
        return out

    def settle(self, acc: Acceptance, drafts: int, accepted: int) -> None:
        acc.record(drafts, accepted, REQUEST_DECAY)
        self.accept.record(drafts, accepted, GLOBAL_DECAY)
        for j in range(1, min(drafts, accepted + 1)):          # draft j + 1 was verified (draft j accepted)
            self.positions[j - 1].add(float(j < accepted), 1.0, GLOBAL_DECAY)

    def watched(self, acc: Acceptance, hit: bool) -> None:
        acc.record_watch(hit, REQUEST_DECAY)
        self.accept.record_watch(hit, GLOBAL_DECAY)

    def step_fit(self, seqs: int, fits: dict[int, LinearFit] | None = None) -> LinearFit | None:
        """The step fit (or of ``fits``: the draft's) of ``seqs``' octave (1, 2-3, 4-7, ...: a draft row's cost
        changes with the batch size, a GPU's from nearly nothing to a decode row's), else the nearest octave's (None
        before any step)."""
        fits = self.steps if fits is None else fits
        if not fits:
            return None
        b = seqs.bit_length()
        return fits[min(fits, key=lambda o: (abs(o - b), -o))]

    def record_step(self, seqs: int, drafts: int, seconds: float) -> None:
        """A decode/verify step of the target (and the engine's work around it) took ``seconds``."""
        b = seqs.bit_length()
        if b not in self.steps:
            # A new octave's prior: this step's time, half fixed and half over its rows (a draft row ~ a decode row),
            # weak, so the octave's first steps (one draft each, then none: ``_dither``) set both costs. Not the
            # nearest octave's fit: at batch 1 the fixed part dominates, and extrapolated to batch 32 it passed for a
            # base several times the real one, against which deep drafts looked cheap (0.84x plain on a CPU).
            # No verify cost in the prior (a GPU's verify graphs cost a decode graph's), and weak: the data sets it.
            per_row = 0.5 * seconds / max(seqs + drafts, 1)
            self.steps[b] = LinearFit([0.5 * seconds, per_row, per_row, 0.0],
                                      [1.0, max(seqs, 1), 0.25 * max(seqs, 1), 0.25])
        self.steps[b].add([1.0, seqs, drafts, float(drafts > 0)], seconds)
        self.measured[b] = max(self.measured.get(b, 0.0) * COST_DECAY, float(drafts))

    def record_draft(self, seqs: int, rows: int, forwards: int, forward_rows: int, seconds: float) -> None:
        """The draft's work after a decode/verify step of ``seqs`` sequences took ``seconds``: catching up ``rows``
        and ``forwards`` attending forwards of ``forward_rows`` rows in all. One fit per batch-size octave, as the
        step's: one fit for all batch sizes (at batch 1 a forward's and a forward row's costs are one number) got
        batch 32's forward rows wrong by a factor of 8, and its outlier clipping kept them wrong for many steps."""
        b = seqs.bit_length()
        if b not in self.drafts:     # a weak prior: the first time split evenly between its parts, none to attending
            q = 0.25 * seconds
            self.drafts[b] = LinearFit([q, q / max(rows, 1), q / max(forwards, 1), q / max(forward_rows, 1), 0.0],
                                       [1.0, max(rows, 1), 1.0, max(forward_rows, 1), 0.25])
        self.drafts[b].add([1.0, rows, forwards, forward_rows, float(forwards > 0)], seconds)

    def scheduled(self, batch: int) -> int | None:
        """Drafts per request at ``batch`` sequences by the table given (``num_speculative_tokens_per_batch_size``,
        vLLM's: a batch size in a gap or past the last range takes the range before it; at most k), else None."""
        if self.schedule is None:
            return None
        drafts = self.schedule[0][2]
        for first, _, n in self.schedule:
            if first > batch:
                break
            drafts = n
        return min(drafts, self.k)

    def _costs(self, batch: int, watching: int) -> Costs | None:
        """The step's costs at ``batch`` sequences from the fits (None before any step was measured)."""
        step = self.step_fit(batch)
        if step is None:
            return None
        draft = self.step_fit(batch, self.drafts)
        beta, dbeta = step.beta, draft.beta if draft is not None else [0.0] * 5
        return Costs(base=max(step.predict([1.0, batch, 0, 0]), 1e-9) + max(float(dbeta[0] + dbeta[1] * batch), 0.0),
                      row=max(float(beta[2]), 0.0) + max(float(dbeta[3]), 0.0), forward=max(float(dbeta[2]), 0.0),
                      verify=max(float(beta[3]), 0.0), attend=max(float(dbeta[4]), 0.0), watching=watching,
                      rows=TRUST * self.measured.get(batch.bit_length(), 0.0))

    def idle(self, rooms: list[int], batch: int, costs: Costs | None = None) -> bool:
        """Whether no plan can pay at ``batch`` whatever the requests' rates (all drafts accepted: D drafts emit at
        most ``batch`` + D tokens in at least the base, the first position's fixed and D rows' time, monotone in D),
        so ``plan`` drafts nothing but its probes: its rates need not be drawn (``plan``'s ``rates`` None).
        ``costs``: the step's (``_costs``), where computed already."""
        if self.scheduled(batch) is not None or not rooms:
            return False
        costs = costs if costs is not None else self._costs(batch, 0)
        if costs is None:
            return False
        bar, most = first_margin(batch) * batch / costs.base, sum(min(r, self.k) for r in rooms)
        return all((batch + d) / (costs.base + costs.fixed(1) + d * costs.row) <= bar for d in (1, most))

    def rest(self, batch: int) -> int:
        """Steps of ``batch`` sequences that follow a plan without drafts before the next plan (``REST_PER``)."""
        return min(batch // REST_PER, MAX_REST)

    def rests(self, batch: int) -> bool:
        """Whether this step of ``batch`` sequences skips its plan (no rates drawn, no drafts, no probe): the last
        plan at its batch-size octave drafted nothing (probes aside) and fewer than ``rest`` steps have passed since
        (counted here). Never with a table (``schedule``), nor in a new octave, nor below ``REST_PER``."""
        octave, left = self._resting
        if left and octave == batch.bit_length():
            self._resting = (octave, left - 1)
            return True
        return False

    def plan_step(self, accs: list[Acceptance], rooms: list[int], batch: int) -> list[int]:
        """The drafts of each of a step's requests (``accs``: their acceptance; none watching): ``plan`` on the
        step's rates (drawn only where a plan could pay: ``idle``), the costs computed once."""
        costs = self._costs(batch, 0) if self.scheduled(batch) is None else None
        rates = None if self.idle(rooms, batch, costs) else self.rates_of(accs, crowd=batch)
        return self.plan(rates, rooms, batch, 0, costs)

    def plan(self, rates: list[tuple[float, float]] | None, rooms: list[int], batch: int, watching: int,
             costs: Costs | None = None) -> list[int]:
        """Drafts per candidate (``rates``: its (a, c); ``rooms``: most drafts it may take) for a step of
        ``batch`` sequences in which ``watching`` other requests compute their first draft anyway. With
        ``uniform`` (the target replays CUDA graphs, whose verify steps need one number of drafts for all) one
        depth for every candidate, the best one. With a table (``schedule``) the table's drafts for ``batch``.
        ``rates`` None: the step is ``idle`` (no drafts but the probes'). ``costs``: the step's, where computed
        already (``_costs``). A plan without drafts past the octave's first steps rests the next ``rest`` steps
        (``rests``), and its probe is as likely as the steps it stands for together (``IDLE_PROBE_EVERY``)."""
        fixed = self.scheduled(batch)
        if fixed is not None:
            return [min(r, fixed) for r in rooms]
        costs = costs if costs is not None else self._costs(batch, watching)
        if costs is None or not rooms:
            return [min(r, self.k) for r in rooms]          # nothing measured yet: draft, and measure
        depth = [0] * len(rooms)                            # rates None: ``idle``, no plan pays
        if rates is not None:
            reaches = [reach(a, c, min(room, self.k)) for (a, c), room in zip(rates, rooms)]
            depth = (uniform_depths if self.uniform else greedy_depths)(reaches, rooms, float(batch), costs,
                                                                          first_margin(batch))
            logger.debug("plan: batch %d, costs %s: %d drafts, depth %d", batch, costs, sum(depth), max(depth))
        own = self.steps.get(batch.bit_length())
        seen, rest = own.count if own is not None else 0, 0
        if seen >= EXPLORE and not any(depth):
            rest = self.rest(batch)
            self._resting = (batch.bit_length(), rest)
        return self._dither(depth, rooms, seen, rest + 1)

    def _dither(self, depth: list[int], rooms: list[int], seen: int, span: int = 1) -> list[int]:
        """Now and then a step runs a nearby plan instead, so the fits see what drafts cost and how deeper drafts
        fare at this batch size (steps only as large as the plan's would not tell a draft row from the rest of a
        step, and positions never drafted would keep their prior). A batch size's first ``EXPLORE`` steps run one
        draft each, then none; after that, at random, while drafting one step in ``PROBE_EVERY`` runs without
        drafts (the plain step's own time), one with a draft fewer each and one with a draft more each; while not
        drafting one in ``IDLE_PROBE_EVERY`` with one draft for a random number of the requests, up to a quarter of
        them (what drafts would cost now; of varying number, so the fits tell a draft row from the verify step's
        fixed cost; few, so the probe costs a small part of a large batch's step: plans grow from them, ``TRUST``);
        ``span`` times as likely where the plan stands for ``span`` steps (``rests``)."""
        if seen < EXPLORE:
            return [1 if r and seen % 2 == 0 else 0 for r in rooms]
        u = self.rng.random() * (PROBE_EVERY if any(depth) else IDLE_PROBE_EVERY / span)
        if any(depth):
            if u < 1.0:
                return [0] * len(depth)
            if u < 2.0:
                return [max(d - 1, 0) for d in depth]
            return [min(d + 1, r, self.k) for d, r in zip(depth, rooms)] if u < 3.0 else depth
        if u >= 1.0:
            return depth
        n = self.rng.randint(1, max(len(rooms) // 4, 1))
        return [1 if r and i < n else 0 for i, r in enumerate(rooms)]
