"""Draft-model speculation on the CUDA-graph branch, without CUDA (the emulation of
``test_runner_graphs_cpu.py``: each "graph" an eager step over the same static buffers): decode and
verify steps of an Eagle3-drafting engine replay graphs that also write the states the draft reads into
the fixed ``aux_states`` buffer; the drafter reads them from there, they equal the eager engine's, and
greedy output is plain decoding's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kimik3.engine import EngineConfig
from kimik3.model.batch import ForwardBatch, StateCheckpoint
from kimik3.model.cuda_graphs import DecodeGraphs, pack_decode_inputs
from tests.engine.fake_model import reference_greedy
from tests.engine.helpers import EagerReplayGraphs, check_invariants, run
from tests.engine.spec.test_draft_model import engine_with, fixed_plan, oracle, requests, target  # noqa: F401 (fixture)


def record_observed(engine) -> list:
    """Wrap the engine's drafter's ``observe`` to keep a copy of the states of every step (None kept)."""
    drafter, seen = engine.scheduler.drafter, []
    observe = drafter.observe

    def wrapped(out, states):
        seen.append(None if states is None else (states.clone(), states.data_ptr()))
        return observe(out, states)
    drafter.observe = wrapped
    return seen


def graphed(engine, k: int):
    """Give ``engine`` emulated decode / verify graphs that keep its drafter's states, and emulated graphs of the
    draft's own steps, attached as the runner attaches them (``tests/model/test_draft_graphs.py``)."""
    from tests.model.test_draft_graphs import emulate
    cfg, runner = engine.config, engine.runner
    runner.graphs = EagerReplayGraphs(engine.model, engine.cache, cfg.max_num_seqs, cfg.max_model_len, k + 1,
                                      aux_layers=runner.aux_layers)
    runner.graphs.capture()
    runner.capture_draft_graphs = emulate
    runner.attach_draft(engine.scheduler.drafter)
    assert engine.scheduler.drafter.executor.graphs is not None and engine.scheduler.drafter.controller.uniform
    return runner.graphs


@pytest.mark.parametrize("max_num_seqs, async_scheduling", [(1, False), (3, False), (3, True)])
def test_draft_model_graph_steps_keep_states_and_greedy_output(target, monkeypatch, max_num_seqs,  # noqa: F811
                                                               async_scheduling):
    reqs = requests(target, seed=7, n=3, max_tokens=14)
    futures = {tuple(p): reference_greedy(target, p, sp.max_tokens) for p, sp in reqs.values()}
    oracle(monkeypatch, futures, target.config.text.vocab_size)
    fixed_plan(monkeypatch)                 # both engines draft alike (the controller's plan follows timings)
    kw = dict(block_size=4, max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=48,
              enable_prefix_caching=False, async_scheduling=async_scheduling)
    eager = engine_with(target, **kw)
    assert eager.runner.aux_layers == eager.scheduler.drafter.aux_layers and eager.runner.graphs is None
    want_states = record_observed(eager)
    want = run(eager, reqs)
    engine = engine_with(target, **kw)
    graphs = graphed(engine, k=3)
    got_states = record_observed(engine)
    got = run(engine, reqs, check=lambda e: check_invariants(e.kv, e.scheduler.running))
    for rid, (prompt, _) in reqs.items():
        assert got[rid][0][0] == futures[tuple(prompt)] == want[rid][0][0], rid
    assert engine.num_accepted_tokens == eager.num_accepted_tokens > 0
    assert engine.accepted_per_position == eager.accepted_per_position
    replayed = graphs.replayed
    assert any(L == 1 for _, L in replayed) and any(L > 1 for _, L in replayed), replayed
    assert engine.runner.num_graph_steps == len(replayed) < engine.runner.num_steps   # prefills ran eagerly
    assert engine.scheduler.drafter.executor.graphs.num_replays > 0     # and so did the draft's own steps
    # every step's states reached the drafter, the graph steps' from the fixed buffer, equal to the eager steps'
    assert len(got_states) == len(want_states) and None not in got_states and None not in want_states
    from_buffer = sum(ptr == graphs.aux_states.data_ptr() for _, ptr in got_states)
    assert from_buffer == len(replayed), (from_buffer, len(replayed))
    for i, ((g, _), (w, _)) in enumerate(zip(got_states, want_states)):
        assert g.shape == w.shape, i
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"step {i}")


def test_graph_states_are_the_eager_forward_states(target):  # noqa: F811
    """One padded verify graph step (2 sequences padded to 4, L = 3): the fixed buffer's rows equal
    ``forward_step(aux_layers=...)`` on the same tokens (the graph step is what the eager step computes)."""
    aux = (1, 3, target.config.text.num_hidden_layers)
    cache = target.allocate_cache(8, 12, 4)
    graphs = EagerReplayGraphs(target, cache, 4, 24, 3, aux_layers=aux)
    graphs.capture()
    assert graphs.aux_states.shape == (12, 3 * target.config.text.hidden_size)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    ref_cache = target.allocate_cache(8, 12, 4)
    tables = [[1, 2, 3], [4, 5, 6]]
    for c in (cache, ref_cache):        # the prompts' own prefill, eager, into both caches
        target.forward_step(torch.tensor(prompts[0] + prompts[1]),
                            ForwardBatch.build([5, 3], [0, 0], [1, 2], tables, 4), c)
    rows = [[20, 21, 22], [23, 24, 25]]
    meta, tbl = pack_decode_inputs(rows, [5, 3], [1, 2], tables, 4, 4, row_state_slots=[[3, 4, 1], [5, 6, 2]])
    logits = graphs.run(meta, tbl, 2)
    got = graphs.states(2, 3)
    snapshots = tuple(StateCheckpoint(seq, j + 1, slot) for seq, slots in enumerate([[3, 4], [5, 6]])
                      for j, slot in enumerate(slots))
    batch = ForwardBatch.build([3, 3], [5, 3], [1, 2], tables, 4, checkpoints=snapshots)
    assert batch.row_state_slots.tolist() == [[3, 4, 1], [5, 6, 2]]
    hidden, want = target.forward_step(torch.tensor(rows[0] + rows[1]), batch, ref_cache, aux)
    torch.testing.assert_close(got, torch.cat(want, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, target.compute_logits(hidden), rtol=1e-5, atol=1e-5)
    assert DecodeGraphs(target, cache, 4, 24, 3).aux_states is None


def test_decode_only_retry_keeps_the_draft_states(target, caplog):  # noqa: F811
    """Verify graphs that cannot be captured fall back to decode graphs alone, which still write the states
    the draft reads."""
    from kimik3.model.cuda_graphs import capture_or_none
    from tests.engine.helpers import VerifyFailingGraphs
    aux = (1, 3)
    cache = target.allocate_cache(4, 8, 4)
    with caplog.at_level("WARNING", logger="kimik3.model.cuda_graphs"):
        graphs = capture_or_none(VerifyFailingGraphs(target, cache, 2, 16, 3, aux_layers=aux))
    assert graphs is not None and graphs.max_query_len == 1 and graphs.aux_layers == aux
    assert graphs.aux_states is not None and graphs.aux_states.shape == (2, 2 * target.config.text.hidden_size)


def record_drafts(engine) -> list:
    """Wrap the engine's drafter's ``_hand_out`` to keep every step's drafts (request id, drafts)."""
    drafter, seen = engine.scheduler.drafter, []
    hand_out = drafter._hand_out

    def wrapped(reqs, counts, drafts):
        seen.append([(r.request_id, k, list(d)) for r, k, d in zip(reqs, counts, drafts)])
        return hand_out(reqs, counts, drafts)
    drafter._hand_out = wrapped
    return seen


def dflash_engine(target, **kw):
    """An engine drafting with a random DFlash draft (blocks of 4: 3 drafts)."""
    from kimik3.engine.core.llm_engine import LLMEngine
    from kimik3.engine.spec.draft_model import ModelDrafter
    from kimik3.model.dflash import DFlashConfig, DFlashDraft
    from tests.engine.helpers import budget_for
    from tests.engine.spec.test_draft_model import random_module
    text = target.config.text
    draft = random_module(DFlashDraft(DFlashConfig(
        hidden_size=text.hidden_size, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        intermediate_size=48, rms_norm_eps=1e-6, rope_theta=1000.0, vocab_size=text.vocab_size,
        draft_vocab_size=text.vocab_size, target_hidden_size=text.hidden_size, aux_layer_ids=(2, 4),
        block_size=4, mask_token_id=3)), 2)
    cfg = EngineConfig(num_speculative_tokens=3, speculative_method="dflash", speculative_model="test",
                       kda_checkpoint_interval=1, **kw)
    need = -(-cfg.max_model_len // cfg.block_size) + 8
    cfg.cache_memory_bytes = budget_for(target, cfg.block_size, cfg.max_num_seqs, need, None, 3) + \
        (need + 2) * ModelDrafter.bytes_per_block(draft, cfg.block_size)
    return LLMEngine(target, cfg, draft=draft)


def mtp_engine(target, **kw):
    """An engine drafting with a random K3 MTP layer (layer L: MLA, MoE) chained 3 drafts deep."""
    from kimik3.engine.core.llm_engine import LLMEngine
    from kimik3.engine.spec.draft_model import ModelDrafter
    from kimik3.model.mtp import MTPDraft
    from tests.engine.helpers import budget_for
    from tests.engine.spec.test_draft_model import random_module
    draft = random_module(MTPDraft(target.config.text, 1), 1)
    assert not draft.layer(0).is_kda and hasattr(draft.layer(0), "block_sparse_moe")
    cfg = EngineConfig(num_speculative_tokens=3, speculative_method="mtp", speculative_model="test",
                       kda_checkpoint_interval=1, **kw)
    need = -(-cfg.max_model_len // cfg.block_size) + 8
    cfg.cache_memory_bytes = budget_for(target, cfg.block_size, cfg.max_num_seqs, need, None, 3) + \
        (need + 2 + 3 * cfg.max_num_seqs) * ModelDrafter.bytes_per_block(draft, cfg.block_size)
    return LLMEngine(target, cfg, draft=draft)


@pytest.mark.parametrize("method", ["eagle3", "dflash", "mtp"])
def test_draft_steps_replay_graphs_with_the_eager_drafts(target, monkeypatch, method):  # noqa: F811
    """The draft's own steps (Eagle3, DFlash, K3's MTP layer) on emulated draft graphs (``tests/model/
    test_draft_graphs.py``), attached as the runner attaches them where the target replays graphs: every step's
    drafts equal the eager engine's, catch-up and position (or block) graphs replayed (a prompt's many rows ran
    eagerly), each step returned with the draft's work queued and the next scheduled on placeholders
    (``spec/device_drafts.py``), greedy output plain decoding's and acceptance the eager engine's."""
    reqs = requests(target, seed=11, n=2, max_tokens=8)
    futures = {tuple(p): reference_greedy(target, p, sp.max_tokens) for p, sp in reqs.values()}
    fixed_plan(monkeypatch)
    kw = dict(block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=32, enable_prefix_caching=False)
    build = {"eagle3": engine_with, "dflash": dflash_engine, "mtp": mtp_engine}[method]
    eager = build(target, **kw)
    eager.scheduler.drafter.may_lag = False     # as on graphs: every step's rows caught up (no step skips the draft)
    want_drafts = record_drafts(eager)
    want = run(eager, reqs)
    engine = build(target, **kw)
    graphed(engine, k=2 if method == "dflash" else 3)      # DFlash's 3-draft verify steps run eagerly
    draft_graphs = engine.scheduler.drafter.executor.graphs
    got_drafts = record_drafts(engine)
    launched, collected, in_flight = [], [], []
    launch = draft_graphs.launch

    def tracking(work, states, plan=None):
        collect = launch(work, states, plan)
        if collect is None:
            return None
        launched.append(len(launched))

        def counted():
            collected.append(len(collected))
            return collect()
        return counted
    draft_graphs.launch = tracking

    drafter, on_device = engine.scheduler.drafter, []
    pending_drafts = drafter.pending_drafts

    def counting():
        source = pending_drafts()
        on_device.append(source is not None)
        return source
    drafter.pending_drafts = counting

    fed, launch_step, run_eager, eager_ids = [], engine.runner.launch, engine.runner.run, []

    def run_recorded(input_ids, batch, rows):
        eager_ids.append(input_ids.clone())
        return run_eager(input_ids, batch, rows)
    engine.runner.run = run_recorded

    def launch_checked(out, input_ids=None):
        """A verify step on placeholders (a graph or eager): its draft rows held the real drafts."""
        graph_steps, eager_steps = engine.runner.num_graph_steps, len(eager_ids)
        logits = launch_step(out, input_ids)
        if out.pending_drafts is not None:
            out.pending_drafts.resolve(out.chunks)
            if engine.runner.num_graph_steps > graph_steps:
                size, L = engine.runner.graphs.replayed[-1]
                ids = engine.runner.graphs.seen[-1][0][0].view(size, L)
                got = [ids[s, 1:1 + len(c.draft)].tolist() for s, c in enumerate(out.chunks)]
            else:
                assert len(eager_ids) == eager_steps + 1
                ids, ends = eager_ids[-1].tolist(), np.cumsum([c.num_tokens for c in out.chunks]).tolist()
                got = [ids[end - len(c.draft):end] for end, c in zip(ends, out.chunks)]
            assert got == [c.draft for c in out.chunks], (got, out.chunks)
            fed.append(engine.runner.num_graph_steps > graph_steps)
        return logits
    engine.runner.launch = launch_checked

    def check(e):
        check_invariants(e.kv, e.scheduler.running)
        assert len(launched) - len(collected) in (0, 1)
        in_flight.append(len(launched) - len(collected))    # 1: the step returned with the draft's work queued
    got = run(engine, reqs, check=check)
    for rid, (prompt, _) in reqs.items():
        assert got[rid][0][0] == futures[tuple(prompt)] == want[rid][0][0], rid
    assert got_drafts == want_drafts and any(any(d for _, k, d in s if k > 1) for s in got_drafts)
    steps = [key for key in draft_graphs.replayed if key[0] == "step"]
    assert len(steps) > 0 and 0 < draft_graphs.num_replays < len(got_drafts), (draft_graphs.num_replays,
                                                                               len(got_drafts))
    assert engine.num_draft_tokens == eager.num_draft_tokens > 0
    assert launched and sum(in_flight) > len(in_flight) // 2, in_flight     # the host emits while the draft runs
    # verify steps scheduled and launched on placeholders, their rows given the device's drafts: the same
    # acceptance at every position as the eager engine's host drafts
    assert sum(on_device) > 2, on_device
    assert engine.accepted_per_position == eager.accepted_per_position
    assert (method != "dflash") in fed, fed       # verify graphs (Eagle3, MTP) and eager verify steps (DFlash)
