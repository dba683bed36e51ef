"""The draft-model controller (``engine/spec/controller.py``): acceptance counts, the cost fits, and a plan that
maximises expected tokens per second (checked against brute force over every choice of drafts)."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from kimik3.engine.spec.controller import EXPLORE, FIRST_MARGIN, PROBE_EVERY, Acceptance, DraftController, LinearFit, Rate


class NoProbe:
    def random(self) -> float:
        return 1.0


def controller(k: int, step: tuple[float, float, float], draft: tuple[float, float, float, float]) -> DraftController:
    """A controller whose fits hold exactly these coefficients (no probes, past the first steps' exploration)."""
    c = DraftController(k)
    c.rng = NoProbe()
    for b in range(1, 8):
        c.steps[b] = LinearFit(list(step), [1.0, 1.0, 1.0], weight=1e9)
        c.steps[b].count = EXPLORE
        c.drafts[b] = LinearFit(list(draft), [1.0] * 4, weight=1e9)
    return c


def goodput(depth, rates, batch, watching, step, draft) -> float:
    """Expected tokens per second of a step with these drafts (the controller's cost model, written out)."""
    tokens = batch + sum(sum(a * c ** (j - 1) for j in range(1, d + 1)) for d, (a, c) in zip(depth, rates))
    forwards = max(max(depth, default=0), 1 if watching else 0)
    time = step[0] + step[1] * batch + step[2] * sum(depth) + draft[0] + draft[1] * batch
    time += draft[2] * forwards + draft[3] * sum(depth)
    return tokens / time


@pytest.mark.parametrize("seed", range(12))
def test_plan_is_near_the_best_choice_of_drafts(seed):
    rng = random.Random(seed)
    n, k = 3, 3
    step = (rng.uniform(0.01, 0.1), rng.uniform(0.001, 0.01), rng.uniform(0.0, 0.01))
    draft = (0.0, 0.0, rng.uniform(0.0, 0.02), rng.uniform(0.0, 0.003))
    rates = [(rng.uniform(0.05, 0.95), rng.uniform(0.05, 0.95)) for _ in range(n)]
    rooms = [rng.randint(0, k) for _ in range(n)]
    watching = rng.randint(0, 1)
    plan = controller(k, step, draft).plan(rates, rooms, n, watching)
    assert all(0 <= d <= r for d, r in zip(plan, rooms))
    best = max(goodput(d, rates, n, watching, step, draft)
               for d in itertools.product(*[range(r + 1) for r in rooms]))
    got = goodput(plan, rates, n, watching, step, draft)
    none = goodput([0] * n, rates, n, watching, step, draft)
    assert got >= none - 1e-12                                  # never worse than no drafts
    assert got >= 0.97 * best or (plan == [0] * n and best < FIRST_MARGIN * none), (plan, got, best)   # or a wash


@pytest.mark.parametrize("seed", range(6))
def test_uniform_plan_is_the_best_single_depth(seed):
    """With CUDA graphs (one number of drafts per verify step) the plan is the best common depth."""
    rng = random.Random(100 + seed)
    n, k = 4, 4
    step = (rng.uniform(0.01, 0.1), rng.uniform(0.001, 0.01), rng.uniform(0.0, 0.005))
    draft = (0.0, 0.0, rng.uniform(0.0, 0.01), rng.uniform(0.0, 0.002))
    rates = [(rng.uniform(0.3, 0.95), rng.uniform(0.3, 0.95)) for _ in range(n)]
    c = controller(k, step, draft)
    c.uniform = True
    plan = c.plan(rates, [k] * n, n, 0)
    assert len(set(plan)) == 1
    options = {d: goodput([d] * n, rates, n, 0, step, draft) for d in range(k + 1)}
    assert options[plan[0]] >= max(options.values()) / 1.05


def test_drafts_stop_where_they_stop_paying():
    """A draft row that costs a decode row's share (a large CPU batch) pays only above acceptance ~1: nothing
    drafts; with nearly free rows (a GPU at batch 1) good drafts go as deep as they may."""
    rates, rooms = [(0.6, 0.5)] * 4, [4] * 4
    costly = controller(4, (0.0, 0.01, 0.01), (0.0, 0.0, 0.002, 0.001)).plan(rates, rooms, 4, 0)
    assert costly == [0, 0, 0, 0]
    cheap = controller(4, (0.02, 0.001, 0.00001), (0.0, 0.0, 0.0001, 0.00001)).plan([(0.8, 0.8)] * 4, rooms, 4, 0)
    assert cheap == [4, 4, 4, 4]
    mixed = controller(4, (0.0, 0.01, 0.004), (0.0, 0.0, 0.001, 0.0005)).plan([(0.95, 0.9), (0.2, 0.2)], [4, 4], 2, 0)
    assert mixed[0] > 0 and mixed[1] == 0                      # one request's drafts pay, the other's do not


def test_acceptance_counts_first_and_later_drafts():
    acc = Acceptance()
    acc.record(4, 2, decay=1.0)        # drafts 1, 2 accepted, 3 rejected, 4 not reached
    assert (acc.first.hits, acc.first.tries) == (1.0, 1.0)
    assert (acc.later.hits, acc.later.tries) == (1.0, 2.0)
    acc.record(3, 0, decay=1.0)
    assert (acc.first.hits, acc.first.tries, acc.later.tries) == (1.0, 2.0, 2.0)
    acc.record(2, 2, decay=1.0)        # all accepted: position 2 tried and accepted
    assert (acc.later.hits, acc.later.tries) == (2.0, 3.0)
    acc.record_watch(True, decay=0.5)
    assert acc.first.tries == pytest.approx(2.5) and acc.first.hits == pytest.approx(2.0)
    assert Rate(0.0, 0.0).estimate(0.7) == pytest.approx(0.7)      # no observations: the prior


def test_linear_fit_recovers_step_costs_and_keeps_unexcited_ones_at_the_prior():
    rng = np.random.default_rng(0)
    fit = LinearFit([0.05, 0.002, 0.002], [1.0, 32.0, 32.0], decay=0.99)
    for _ in range(200):
        seqs, drafts = int(rng.integers(1, 40)), int(rng.integers(0, 100))
        fit.add([1.0, seqs, drafts], 0.1 + 0.01 * seqs + 0.004 * drafts + rng.normal(0, 0.002))
    assert fit.beta[2] == pytest.approx(0.004, rel=0.05)          # a draft row's cost
    for seqs, drafts in ((16, 0), (24, 40), (32, 96)):
        assert fit.predict([1.0, seqs, drafts]) == pytest.approx(0.1 + 0.01 * seqs + 0.004 * drafts, rel=0.03)
    quiet = LinearFit([0.0, 0.0, 0.003], [1.0, 8.0, 8.0])
    for _ in range(50):
        quiet.add([1.0, 8.0, 0.0], 0.2)              # never any drafts: their cost stays the prior's
    assert quiet.beta[2] == pytest.approx(0.003, rel=1e-6)
    assert quiet.predict([1.0, 8.0, 0.0]) == pytest.approx(0.2, rel=0.03)


def test_a_new_batch_size_starts_from_the_nearest_measured_one():
    c = DraftController(4)
    for _ in range(20):
        c.record_step(1, 2, 0.05)
    assert c.step_fit(32) is c.steps[1]
    c.record_step(32, 0, 0.4)
    assert set(c.steps) == {1, 6} and c.step_fit(32) is c.steps[6] and c.step_fit(20) is c.steps[6]


def test_probes_vary_the_drafts_around_the_plan():
    """A new batch size alternates one draft each and none; later, now and then a step without drafts, one with a
    draft fewer and one with a draft more each (drafting), or one draft each (not drafting); most run the plan."""
    c = DraftController(4)
    assert [c._dither([3, 0, 2], [4, 4, 0], seen) for seen in range(EXPLORE)] == [[1, 1, 0], [0, 0, 0]] * (EXPLORE // 2)
    runs = [tuple(c._dither([3, 1, 2], [4, 4, 2], EXPLORE)) for _ in range(900)]
    share = {d: runs.count(d) / len(runs) for d in set(runs)}
    assert set(share) == {(3, 1, 2), (0, 0, 0), (2, 0, 1), (4, 2, 2)}
    for probe in ((0, 0, 0), (2, 0, 1), (4, 2, 2)):
        assert abs(share[probe] - 1 / PROBE_EVERY) < 0.04, probe
    idle = {tuple(c._dither([0, 0], [2, 0], EXPLORE)) for _ in range(200)}
    assert idle == {(0, 0), (1, 0)}


def test_later_positions_follow_the_measured_profile():
    """Rates per draft position: the global acceptance of draft j after j - 1 (falling with depth here), scaled by
    how the request's later drafts fare against everyone's."""
    c = DraftController(3)
    for _ in range(200):
        c.settle(Acceptance(), 3, 3)            # position 2 accepted, position 3 ...
        c.settle(Acceptance(), 3, 2)            # ... rejected half the time
    a, cond = c.rates(Acceptance())
    assert cond[0] > 0.95 and abs(cond[1] - 0.5) < 0.05
    good = Acceptance()
    good.record(3, 3, 1.0)
    assert c.rates(good)[1][1] >= cond[1]


# Measured on the 2-core CPU box (bench_spec's default model + Eagle3 draft, process CPU seconds): a step of one
# sequence 46 ms plus 17 ms per draft row, of 32 sequences 154 ms plus 1.77 ms per draft row; the draft 6 ms a step
# to catch up, 6 ms a forward plus 0.19 ms a row.
CPU = {"step": {1: (0.046, 0.017), 32: (0.154, 0.00177)}, "draft": (0.006, 0.00002, 0.006, 0.00019)}
# the same draft rows cost about a decode row each and a forward costs a fifth of a step: drafts never pay at 32
COSTLY = {"step": {1: (0.046, 0.003), 32: (0.154, 0.005)}, "draft": (0.006, 0.00002, 0.03, 0.0002)}
# a GPU: a verify row nearly free at batch 32, a draft forward small against the step
GPU = {"step": {1: (0.010, 0.0001), 32: (0.012, 0.00002)}, "draft": (0.0002, 0.0, 0.0004, 0.000002)}
ACCEPT = (0.8, 0.75, 0.6, 0.5)        # P(draft j accepted | draft j - 1 accepted), the held-out text's profile


def simulate(c: DraftController, costs: dict, batch: int, steps: int, seed: int) -> tuple[float, list[float]]:
    """Closed loop on injected timings (no clock): each step the plan's drafts cost ``costs``' step time and draft
    time, are accepted at ``ACCEPT``'s rates (seeded), and are reported back as the engine does. Returns (tokens per
    second over the steps, the mean drafts per request of each step)."""
    rng = random.Random(seed)
    accs = [Acceptance() for _ in range(batch)]
    (s0, s1), (d0, d1, d2, d3) = costs["step"][batch], costs["draft"]
    tokens = seconds = 0.0
    depths = []
    for _ in range(steps):
        depth = c.plan([c.rates(a) for a in accs], [c.k] * batch, batch, 0)
        step = s0 + s1 * sum(depth)
        draft = d0 + d1 * batch + d2 * max(depth) + d3 * sum(depth)
        c.record_step(batch, sum(depth), step)
        c.record_draft(batch, batch, max(depth), sum(depth), draft)
        for acc, d in zip(accs, depth):
            m = 0
            while m < d and rng.random() < ACCEPT[m]:
                m += 1
            c.settle(acc, d, m)
            tokens += 1 + m
        seconds += step + draft
        depths.append(sum(depth) / batch)
    return tokens / seconds, depths


def fixed_depth(costs: dict, batch: int, d: int) -> float:
    """Expected tokens per second of every request drafting ``d`` (0: plain decoding, no draft work at all)."""
    (s0, s1), (d0, d1, d2, d3) = costs["step"][batch], costs["draft"]
    if d == 0:
        return batch / s0
    tokens = batch * (1 + sum(math.prod(ACCEPT[:j]) for j in range(1, d + 1)))
    return tokens / (s0 + s1 * batch * d + d0 + d1 * batch + d2 * d + d3 * batch * d)


@pytest.mark.parametrize("seed", range(3))
def test_batch_32_on_a_cpu_drafts_what_pays(seed):
    """After batch 1 was measured, batch 32's costs come from its own steps (not batch 1's fit extrapolated, whose
    fixed part passed for a base several times the real one and made deep drafts look cheap: 0.84x plain): its
    drafts earn near the best fixed depth's goodput, >= 1.15x plain decoding, exploration and probes included."""
    c = DraftController(4)
    c.rng = random.Random(seed)
    simulate(c, CPU, 1, 60, seed)
    got, depths = simulate(c, CPU, 32, 60, seed)
    best = max(fixed_depth(CPU, 32, d) for d in range(5))
    assert best / fixed_depth(CPU, 32, 0) > 1.2
    assert got >= 0.93 * best and got >= 1.15 * fixed_depth(CPU, 32, 0), (got / fixed_depth(CPU, 32, 0), depths)
    assert 0.8 <= sum(depths[-20:]) / 20 <= 2.5               # one or two deep, not the four that lose


@pytest.mark.parametrize("seed", range(3))
def test_batch_32_stops_drafting_where_drafts_cannot_pay(seed):
    """Draft rows that cost a decode row: after the first steps the plan drafts nothing (probes aside, and seldom:
    ``could_pay`` is False), and the goodput is plain decoding's less the draft's catch-up."""
    c = DraftController(4)
    c.rng = random.Random(seed)
    simulate(c, COSTLY, 1, 60, seed)
    simulate(c, COSTLY, 32, 30, seed)
    got, depths = simulate(c, COSTLY, 32, 150, seed)
    assert max(fixed_depth(COSTLY, 32, d) for d in range(1, 5)) < fixed_depth(COSTLY, 32, 0)
    assert sum(depths) / len(depths) < 0.05, depths          # probes only: one step in IDLE_PROBE_EVERY
    assert not c.could_pay(32) and c.could_pay(1)
    catch_up = 0.006 + 0.00002 * 32
    assert got >= 0.98 * 32 / (0.154 + catch_up), got / fixed_depth(COSTLY, 32, 0)


@pytest.mark.parametrize("seed", range(3))
def test_batch_32_on_a_gpu_drafts_deep(seed):
    """The same controller where a verify row is nearly free at batch 32 (a GPU): every request drafts deep, near the
    best fixed depth's goodput: the decision comes from measured costs, not from the kind of device."""
    c = DraftController(4)
    c.rng = random.Random(seed)
    simulate(c, GPU, 1, 60, seed)
    got, depths = simulate(c, GPU, 32, 60, seed)
    best = max(fixed_depth(GPU, 32, d) for d in range(5))
    assert got >= 0.85 * best and sorted(depths[-20:])[10] >= 2.0, depths      # the median step, probes aside
    assert c.could_pay(32)


def test_a_table_fixes_the_drafts_per_batch_size():
    """vLLM's num_speculative_tokens_per_batch_size: the table's drafts for the batch size (a gap or past the last
    range: the range before it; at most k), whatever the rates and costs."""
    c = DraftController(4, schedule=((1, 1, 4), (2, 8, 2), (16, 31, 9), (32, 64, 0)))
    assert [c.scheduled(b) for b in (1, 2, 8, 12, 16, 31, 32, 500)] == [4, 2, 2, 2, 4, 4, 0, 0]
    for _ in range(20):
        c.record_step(3, 0, 0.1)            # costs that would stop any plan
    assert c.plan([(0.01, 0.01)] * 3, [4, 1, 0], 3, 0) == [2, 1, 0]
    assert c.plan([(0.9, 0.9)] * 2, [4, 4], 40, 0) == [0, 0]
    assert not c.could_pay(1) and DraftController(4).could_pay(1)
    assert DraftController(4).scheduled(1) is None
