"""MTP draft steps on draft graphs (``model/draft_graphs.py``) without CUDA: each "graph" is its captured function
run eagerly over the same fixed buffers (``EagerDraftGraphs``, ``tests/model/test_draft_graphs.py``). K3's MTP layers
with an MLA or a KDA token mixer, MoE or dense MLP, one layer or two chained: against the eager ``DraftExecutor`` on a
copy of the same cache (random latents and states), the same drafts, latents and KDA states (the live slots advanced
by the committed rows alone, the drafts' rows on scratch copies), step after step from reused buffers, with mixed
depths, padded rows and heads; steps that fit no graph run eagerly."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from kimik3.config import parse_config
from kimik3.model.draft_graphs import DraftGraphs
from kimik3.model.draft_step import DraftExecutor, allocate_draft_cache
from kimik3.model.mtp import MTPDraft
from kimik3.testing import tiny_k3_config
from tests.model.test_draft_graphs import BS, emulate, random_work

VOCAB = 64

# the MTP layers (layer L first): KDA where True; MoE unless dense
LAYOUTS = {"mla-moe": ((False,), False), "mla-dense": ((False,), True), "kda-moe": ((True,), False),
           "kda-dense": ((True,), True), "mla+kda": ((False, True), False), "kda+mla": ((True, False), True)}


def mtp_draft(kinds: tuple[bool, ...], dense: bool, seed: int = 0) -> MTPDraft:
    """A random float32 MTP draft of tiny K3 layers (KDA where ``kinds[j]``; a dense MLP where ``dense``)."""
    text = parse_config(tiny_k3_config(vocab_size=VOCAB, vision=False)).text
    L = text.num_hidden_layers
    listed = tuple(L + 1 + j for j, kda in enumerate(kinds) if kda)
    cfg = dataclasses.replace(text, kda=dataclasses.replace(text.kda, kda_layers=text.kda.kda_layers + listed),
                              num_nextn_predict_layers=len(kinds),
                              first_k_dense_replace=L + len(kinds) if dense else text.first_k_dense_replace)
    draft = MTPDraft(cfg, len(kinds))
    g = torch.Generator().manual_seed(seed)
    for p in draft.parameters():
        if p.dtype.is_floating_point:
            p.data.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]) if p.dim() > 1 else
                         torch.ones(p.shape))
    for j, kda in enumerate(kinds):       # a decay near 0.9 a row: a state that missed or repeated a row shows
        if kda:
            draft.layer(j).self_attn.A_log.data.fill_(0.0)
            draft.layer(j).self_attn.dt_bias.data.fill_(-4.0)
    assert [draft.layer(j).is_kda for j in range(len(kinds))] == list(kinds)
    assert all(hasattr(draft.layer(j), "mlp") == dense for j in range(len(kinds)))
    return draft.float().eval()


def clone_cache(cache):
    return dataclasses.replace(cache, kda_conv=cache.kda_conv.clone(), kda_state=cache.kda_state.clone(),
                               mla_latent=cache.mla_latent.clone())


def sync(dst, src) -> None:
    for name in ("kda_conv", "kda_state", "mla_latent"):
        getattr(dst, name).copy_(getattr(src, name))


NUM_SLOTS = 16          # state slots: null 0, each sequence's 1 + i, each head's scratch from SCRATCH
SCRATCH = 8


def mtp_executors(draft, max_num_seqs: int = 4, k: int = 3, max_model_len: int = 40, capture=emulate):
    """An eager executor and one with graphs (``capture``: emulated, or ``capture_draft_or_none`` on CUDA) over two
    copies of one random draft cache, on the draft's device."""
    num_blocks = -(-max_model_len // BS) * max_num_seqs + 1
    total = num_blocks + 3 * max(max_num_seqs, 3)
    device = next(draft.parameters()).device
    cache = allocate_draft_cache(draft, total, BS, NUM_SLOTS)
    g = torch.Generator().manual_seed(1)
    for t in (cache.kda_conv, cache.kda_state, cache.mla_latent):
        t.copy_(torch.randn(t.shape, generator=g).to(device) * (0.1 if t is cache.kda_state else 1.0))
    eager = DraftExecutor(draft, clone_cache(cache), BS)
    graphed = DraftExecutor(draft, cache, BS)
    graphed.graphs = capture(DraftGraphs(draft, cache, BS, max_num_seqs, max_model_len, k, torch.float32, min_span=8))
    return eager, graphed, num_blocks


def mtp_work(rng: random.Random, num_blocks: int, seqs, state_ops: bool = False):
    """``random_work``'s step with the fields a KDA first layer reads: sequence i in state slot 1 + i, each head a
    scratch slot; ``state_ops``: a state copy and a reset of the target's step first."""
    work, T = random_work(rng, num_blocks, num_blocks, seqs, VOCAB)
    work.seq_slots = [1 + i for i in range(len(seqs))]
    first = [sum(work.seq_lens[:i]) for i in range(len(seqs))]
    work.head_seqs = [next(i for i in range(len(seqs)) if first[i] <= h < first[i] + seqs[i][1]) for h in work.heads]
    work.scratch_slots = [SCRATCH + i for i in range(len(work.heads))]
    if state_ops:
        work.state_copies, work.state_resets = [(6, 7)], [5]
    return work, T


# steps of (caught-up position start, rows, depth or None) per sequence
STEPS = [[(30, 1, 2), (12, 2, 2), (6, 1, 1), (18, 2, 1)],        # 4 heads
         [(9, 3, 3), (2, 1, 1), (20, 4, 2), (5, 2, None)],       # 3 heads (padded to 4), 10 rows (16)
         [(30, 1, 2), (12, 2, 2)],
         [(3, 1, 1)],
         [(9, 3, 3), (1, 2, None)],
         [(0, 6, None), (14, 1, 3)],                             # a prompt's rows and one head
         [(4, 5, None)]]                                         # catch-up alone


def check_mtp_steps(draft, eager: DraftExecutor, graphed: DraftExecutor, num_blocks: int, steps=STEPS,
                    rtol: float = 1e-5, atol: float = 1e-5, exact: bool = True) -> float:
    """``steps`` one after another on both executors: the same drafts; the same latents but where the graphs'
    shallower heads drafted on past their own depth (rows no one reads before they are caught up again) and in the
    null block; the same KDA states and conv windows but in the null slot and the scratch slots of heads shallower
    than the deepest (which a graph of the deeper heads' count runs on). Not ``exact`` (bf16 on CUDA, where the
    padded batches' kernels round differently and a near-tie may pick another draft, and every later one differs):
    only what no draft changes, the caught-up rows' latents and the sequences' live states and windows (within
    ``rtol`` / ``atol``). Returns the share of drafts equal."""
    rng = random.Random(3)
    same = total = 0
    for i, seqs in enumerate(steps):
        work, T = mtp_work(rng, num_blocks, seqs, state_ops=i % 2 == 1)
        states = torch.randn(T, draft.cfg.hidden_size, generator=torch.Generator().manual_seed(i))
        states = states.to(eager.device)
        assert graphed.graphs.fits(work, states), i
        want, got = eager.run(work, states), graphed.run(work, states)
        assert [len(d) for d in got] == work.depths
        same += sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
        total += sum(work.depths)
        if not exact:
            check_committed(eager.cache, graphed.cache, work, rtol, atol)
            sync(eager.cache, graphed.cache)
            continue
        assert got == want, (i, got, want)
        deeper = max(work.depths, default=0)
        spare = set()
        for h, d, t in zip(work.heads, work.depths, work.tables):
            spare |= {t[p // BS] * BS + p % BS for p in range(work.positions[h] + d, work.positions[h] + deeper)
                      if p // BS < len(t)}
        c_e, c_g = eager.cache, graphed.cache
        rows = sorted(set(range(BS, c_e.mla_latent.shape[1] * BS)) - spare)
        if c_e.mla_latent.shape[0]:
            flat_e, flat_g = (c.mla_latent.flatten(1, 2)[:, rows] for c in (c_e, c_g))
            torch.testing.assert_close(flat_g, flat_e, rtol=rtol, atol=atol)
        shallow = {SCRATCH + j for j, d in enumerate(work.depths) if d < deeper}
        slots = sorted(set(range(1, NUM_SLOTS)) - shallow)
        for name in ("kda_state", "kda_conv"):
            torch.testing.assert_close(getattr(c_g, name)[:, slots], getattr(c_e, name)[:, slots], rtol=rtol,
                                       atol=atol)
        sync(c_e, c_g)                  # the next step starts from the same cache in both
    return same / max(total, 1)


def check_committed(eager, graphed, work, rtol: float, atol: float) -> None:
    """The caches where the step's committed rows went, which no draft changes: the first MLA layer's rows at the
    caught-up positions and each sequence's live state slot and conv window."""
    slots = torch.tensor(work.slots, device=eager.mla_latent.device)
    if eager.mla_latent.shape[0]:
        torch.testing.assert_close(graphed.mla_latent[:1].flatten(1, 2)[:, slots],
                                   eager.mla_latent[:1].flatten(1, 2)[:, slots], rtol=rtol, atol=atol)
    live = torch.tensor(work.seq_slots, device=slots.device)
    for name in ("kda_state", "kda_conv"):
        torch.testing.assert_close(getattr(graphed, name)[:, live], getattr(eager, name)[:, live], rtol=rtol,
                                   atol=atol)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mtp_graph_steps_equal_the_eager_executor(layout):
    """Steps of mixed depths, padded rows and heads, one after another from the same buffers: one catch-up replay
    a step and one replay per draft position (the first, the second and later ones each their own graph where the
    draft has KDA layers), a KDA first layer's catch-up in rounds where the step allows, drafts, latents and states
    as the eager executor's."""
    kinds, dense = LAYOUTS[layout]
    draft = mtp_draft(kinds, dense)
    eager, graphed, num_blocks = mtp_executors(draft)
    g = graphed.graphs
    assert g.sizes == [1, 2, 4] and g.row_sizes == [1, 2, 4, 8, 16] and g.spans == [44]
    check_mtp_steps(draft, eager, graphed, num_blocks)
    positions = sum(max((d for _, _, d in seqs if d), default=0) for seqs in STEPS)
    rounds = [key for key in g.replayed if key[0] == "rounds"]
    assert len(g.replayed) - len(rounds) == len(STEPS) + positions, g.replayed
    # a KDA first layer's catch-up in graphs: each sequence's rows but a head's, one a round, where the step has no
    # state copies (even steps), no prompt's first row and at most k rows a sequence (else eagerly)
    want = []
    for i, seqs in enumerate(STEPS if kinds[0] else ()):
        m = [n - (d is not None) for _, n, d in seqs]
        if i % 2 == 0 and max(m) <= 3 and not any(start == 0 and k for (start, _, _), k in zip(seqs, m)) and max(m):
            want.append(("rounds", 1 << (len(seqs) - 1).bit_length(), max(m)))
    assert rounds == want and (want or not kinds[0]), rounds
    steps = {key for key in g.replayed if key[0] == "step"}
    n = len(kinds)
    want = {(j % n, min(j, 2) if any(kinds) else 0) for j in range(3)}
    assert {key[3:] for key in steps} == want, steps
    assert {("rows", 16), ("step", 4, 44, 0, 0), ("step", 1, 44, 2 % n, 2 if any(kinds) else 0)} <= set(g.replayed)


def test_mtp_steps_no_graph_fits_run_eagerly():
    """More rows than the largest catch-up graph, more heads than the largest step graph, a head at position 0
    (eagerly a prefill row): the eager executor, and the KDA first layer's catch-up once."""
    draft = mtp_draft((True,), False)
    eager, graphed, num_blocks = mtp_executors(draft, max_num_seqs=2, k=2)
    g = graphed.graphs
    assert g.row_sizes[-1] == 6 and g.sizes[-1] == 2
    check_mtp_steps(draft, eager, graphed, num_blocks, steps=[[(5, 2, 2), (9, 1, 1)]])
    g.replayed.clear()
    rng = random.Random(5)
    for seqs in ([(1, 7, 1)], [(2, 1, 1), (5, 1, 1), (8, 1, 2)], [(0, 1, 2)]):
        work, T = mtp_work(rng, num_blocks, seqs)
        states = torch.randn(T, draft.cfg.hidden_size)
        assert g.plan(work) is None and not g.fits(work, states)
        assert graphed.run(work, states) == eager.run(work, states)
        for name in ("kda_state", "kda_conv"):
            torch.testing.assert_close(getattr(graphed.cache, name), getattr(eager.cache, name), rtol=0, atol=0)
        sync(eager.cache, graphed.cache)
    assert g.replayed == []
    work, T = mtp_work(rng, num_blocks, [(3, 2, 1)])
    assert not g.fits(work, torch.randn(T, draft.cfg.hidden_size, dtype=torch.float64))     # other states' dtype


def test_mtp_drafts_capture():
    """MTP drafts capture (also split over tensor-parallel ranks: every rank captures its own, ``parallel/worker.py``),
    their graphs keyed by layer and state phase, in one key span."""
    draft = mtp_draft((False, True), False)
    assert DraftGraphs.can_capture(draft)
    g = DraftGraphs(draft, allocate_draft_cache(draft, 9, BS, 4), BS, 4, 40, 3, torch.float32)
    assert [g.step_key(4, 44, j) for j in range(4)] == [("step", 4, 44, 0, 0), ("step", 4, 44, 1, 1),
                                                         ("step", 4, 44, 0, 2), ("step", 4, 44, 1, 2)]
    plain = mtp_draft((False,), True)
    g = DraftGraphs(plain, allocate_draft_cache(plain, 9, BS, 4), BS, 4, 40, 3, torch.float32)
    assert {g.step_key(2, 44, j) for j in range(3)} == {("step", 2, 44, 0, 0)}


def test_a_step_works_out_its_plan_once():
    """A step through the executor works out its graphs (``DraftGraphs.plan``, a loop over the heads) and a KDA first
    layer's catch-up rounds (``rounds_for``, a loop over the sequences) once each, whether the rounds replay or the
    catch-up runs eagerly first, or the step runs eagerly (no graph fits); the drafts are the eager executor's."""
    draft = mtp_draft((True,), False)
    eager, graphed, num_blocks = mtp_executors(draft)
    g, calls = graphed.graphs, []
    for name in ("plan", "rounds_for"):
        def counted(work, f=getattr(g, name), name=name):
            calls.append(name)
            return f(work)
        setattr(g, name, counted)
    rng = random.Random(7)
    # rounds in graphs; the catch-up eagerly (state ops); a head at position 0 (no graph fits)
    for seqs, state_ops, replays in (([(9, 3, 2), (5, 1, 1)], False, True), ([(9, 3, 2)], True, True),
                                     ([(0, 1, 1)], False, False)):
        work, T = mtp_work(rng, num_blocks, seqs, state_ops)
        states = torch.randn(T, draft.cfg.hidden_size)
        calls.clear()
        g.replayed.clear()
        assert graphed.run(work, states) == eager.run(work, states), seqs
        assert calls == (["plan", "rounds_for"] if replays else ["plan"]), (seqs, calls)
        assert bool(g.replayed) == replays and (("rounds", 2, 2) in g.replayed) == (replays and not state_ops)
        sync(eager.cache, graphed.cache)
