"""The CUDA-graph decode branch of the runner, without CUDA: the batch ladder, input padding, and the
whole engine with each "graph" replaced by an eager step over the same static buffers (same padding,
same pinned ``max_seq_len``), which must give the eager engine's tokens and touch only the null
slot / null block besides the sequences' own."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch

import kimik3
from kimik3.engine import SamplingParams
from kimik3.model.cuda_graphs import garbage_collection_paused, graph_batch_sizes, pack_decode_inputs, \
    padded_batch_size
from tests.engine.helpers import EagerReplayGraphs, FailingGraphs, VerifyFailingGraphs, make_engine, oracle_requests, \
    run


@pytest.mark.parametrize("max_num_seqs,sizes", [(1, [1]), (5, [1, 2, 4, 5]), (8, [1, 2, 4, 8]),
                                                (64, [1, 2, 4, 8, 16, 32, 64]), (100, [1, 2, 4, 8, 16, 32, 64, 100])])
def test_graph_batch_sizes(max_num_seqs, sizes):
    assert graph_batch_sizes(max_num_seqs) == sizes


def test_graph_batch_sizes_rejects_zero():
    with pytest.raises(ValueError, match="max_num_seqs must be positive"):
        graph_batch_sizes(0)


def test_captures_run_with_garbage_collected_first_and_paused():
    """An unreachable cycle (an earlier engine holding graphs, say) is freed before a capture, and
    nothing is collected during it: a graph freed mid-capture invalidates the capture on a GPU."""
    class Node:
        pass

    def cycle() -> weakref.ref:
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    old = gc.get_threshold()
    try:
        gc.set_threshold(1, 1, 1)
        with garbage_collection_paused():
            assert not gc.isenabled()
            during = cycle()
            for _ in range(1000):        # allocations that would trigger collections at threshold 1
                [[] for _ in range(10)]
            assert during() is not None, "garbage was collected during the capture"
        assert gc.isenabled(), "the collector was left off"
        gc.disable()                     # only the context manager's own collection may free this one
        before = cycle()
        with garbage_collection_paused():
            assert before() is None, "the cycle made before the capture was not collected"
        assert not gc.isenabled(), "a collector that was off was turned on"
    finally:
        gc.enable()
        gc.set_threshold(*old)


@pytest.mark.parametrize("n,size", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, None)])
def test_padded_batch_size(n, size):
    assert padded_batch_size(n, [1, 2, 4, 8]) == size


def test_pack_decode_inputs_pads_with_null_entries():
    meta, tables = pack_decode_inputs(token_ids=[11, 12, 13], context_lens=[5, 2, 8], state_slots=[3, 1, 2],
                                      block_tables=[[7, 9], [4], [6, 5, 8]], block_size=4, size=5)
    assert meta.dtype == torch.int64 and tables.dtype == torch.int32
    assert meta.tolist() == [[11, 12, 13, 0, 0],            # input ids
                             [5, 2, 8, 0, 0],               # context lens
                             [3, 1, 2, 0, 0],               # state slots (0 = null)
                             [9 * 4 + 1, 4 * 4 + 2, 8 * 4 + 0, 0, 0],   # slot mapping (block 0 row 0)
                             [0, 0, 0, 0, 0]]               # row state slots (verify steps only)
    assert tables.tolist() == [[7, 9, 0], [4, 0, 0], [6, 5, 8], [0, 0, 0], [0, 0, 0]]


def test_pack_verify_inputs_lays_out_rows_per_sequence():
    """A verify step: each sequence's last token and drafts as consecutive rows, their latent slots
    (crossing a block), the [size, L] row state slots; padding sequences all zeros."""
    meta, tables = pack_decode_inputs(token_ids=[[11, 21, 22], [12, 31, 32]], context_lens=[3, 5], state_slots=[3, 1],
                                      block_tables=[[7, 9], [4, 6]], block_size=4, size=4,
                                      row_state_slots=[[8, 9, 3], [0, 10, 1]])
    assert meta.shape == (5, 12)
    assert meta[0].tolist() == [11, 21, 22, 12, 31, 32] + [0] * 6
    assert meta[1, :4].tolist() == [3, 5, 0, 0] and meta[2, :4].tolist() == [3, 1, 0, 0]
    assert meta[3].tolist() == [7 * 4 + 3, 9 * 4 + 0, 9 * 4 + 1, 6 * 4 + 1, 6 * 4 + 2, 6 * 4 + 3] + [0] * 6
    assert meta[4].tolist() == [8, 9, 3, 0, 10, 1] + [0] * 6
    with pytest.raises(ValueError, match="same number of tokens"):
        pack_decode_inputs([[1, 2], [3]], [1, 1], [1, 2], [[1], [2]], block_size=4, size=2,
                           row_state_slots=[[0, 1], [2]])


def test_pack_decode_inputs_errors():
    with pytest.raises(ValueError, match="do not fit a decode graph of 2 rows"):
        pack_decode_inputs([1, 2, 3], [1, 1, 1], [1, 2, 3], [[1], [2], [3]], block_size=4, size=2)
    with pytest.raises(ValueError, match="none for position 4"):
        pack_decode_inputs([1], [4], [1], [[1]], block_size=4, size=1)
    with pytest.raises(ValueError, match="one entry per sequence"):
        pack_decode_inputs([1, 2], [1], [1], [[1]], block_size=4, size=2)


def assert_touched_only_own(meta, before, after, block_size: int, step: str) -> None:
    """A replay (its ``meta`` and the cache pools before and after it) changed only its sequences'
    state slots (live and row slots), the latent blocks of its tokens, and the null slot and block."""
    live = set(meta[2].tolist()) | set(meta[4].tolist()) | {0}
    blocks = set((meta[3] // block_size).tolist()) | {0}
    for pool, (b, a) in (("kda_conv", (before[0], after[0])), ("kda_state", (before[1], after[1]))):
        changed = {s for s in range(b.shape[1]) if not torch.equal(b[:, s], a[:, s])}
        assert changed <= live, f"{pool}: {step} touched slots {changed - live}"
    changed = {k for k in range(before[2].shape[1]) if not torch.equal(before[2][:, k], after[2][:, k])}
    assert changed <= blocks, f"mla_latent: {step} touched blocks {changed - blocks}"


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return kimik3.load_model(tiny_ckpt["kimi_k3"], device="cpu", dtype=torch.float32)


def _requests(vocab: int):
    rng = random.Random(3)
    system = [rng.randrange(5, vocab) for _ in range(7)]
    prompts = [system + [rng.randrange(5, vocab) for _ in range(k)] for k in (1, 4, 9)]
    prompts += [[rng.randrange(5, vocab) for _ in range(k)] for k in (2, 5)]
    return {f"r{i}": (p, SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True))
            for i, p in enumerate(prompts)}


def test_engine_graph_branch_matches_eager(model):
    reqs = _requests(model.config.text.vocab_size)
    arrivals = {0: ["r0", "r3"], 2: ["r1", "r2", "r4"]}
    kw = dict(block_size=3, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32,
              kda_checkpoint_interval=1, extra_blocks=40)
    eager = run(make_engine(model, **kw), reqs, arrivals)
    engine = make_engine(model, **kw)
    runner = engine.runner
    runner.graphs = EagerReplayGraphs(model, engine.cache, 8, 32)
    runner.graphs.capture()
    graphed = run(engine, reqs, arrivals)
    assert graphed == eager
    assert runner.num_graph_steps > 0 and runner.num_graph_steps < runner.num_steps   # some steps fell back
    padded = [s for s in runner.graphs.seen if (s[0][2] == 0).any()]
    assert padded, "no decode step was padded"
    for meta, before, after in padded:
        assert_touched_only_own(meta, before, after, block_size=3, step="a padded decode step")


@pytest.mark.parametrize("arch", ["kimi_k3", "kimi_linear"])
def test_verify_steps_replay_graphs_exactly_greedy(tiny_ckpt, arch, monkeypatch):
    """Speculative verify steps as graph steps (oracle drafts, every other step with a wrong second
    draft): every token is the model's own greedy continuation, graphs of 2..4 tokens per sequence
    replayed (padded sequences too), and padding touched only the null slot and block."""
    model = kimik3.load_model(tiny_ckpt[arch], device="cpu", dtype=torch.float32)
    reqs, futures = oracle_requests(model, monkeypatch, seed=4)
    engine = make_engine(model, block_size=4, max_num_seqs=3, max_num_batched_tokens=32, max_model_len=40,
                         enable_prefix_caching=False, extra_blocks=12, num_speculative_tokens=3)
    runner = engine.runner                  # (prefix checkpoints inside a verify chunk run eagerly)
    runner.graphs = EagerReplayGraphs(model, engine.cache, 4, 40, 4)   # ladder 1, 2, 4: 3 sequences pad to 4
    runner.graphs.capture()
    results = run(engine, reqs)
    for rid, (prompt, params) in reqs.items():
        assert results[rid][0][0] == futures[tuple(prompt)], rid
    verify = [(k, meta) for k, (meta, _, _) in zip(runner.graphs.replayed, runner.graphs.seen) if k[1] > 1]
    assert any(size > 1 for (size, _), _ in verify), runner.graphs.replayed
    assert any((meta[2, :size] == 0).any() for (size, _), meta in verify), "no verify step was padded"
    assert engine.num_accepted_tokens > 0 and engine.num_draft_tokens > engine.num_accepted_tokens
    for key, (meta, before, after) in zip(runner.graphs.replayed, runner.graphs.seen):
        assert_touched_only_own(meta, before, after, block_size=4, step=f"step {key}")


def test_capture_failure_falls_back_to_eager_with_one_warning(model, caplog):
    from kimik3.model.cuda_graphs import capture_or_none
    reqs = _requests(model.config.text.vocab_size)
    kw = dict(block_size=3, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32, extra_blocks=40)
    eager = run(make_engine(model, **kw), reqs, {0: list(reqs)})
    engine = make_engine(model, **kw)
    graphs = FailingGraphs(model, engine.cache, 8, 32)
    with caplog.at_level("WARNING", logger="kimik3.model.cuda_graphs"):
        engine.runner.graphs = capture_or_none(graphs)
    assert engine.runner.graphs is None and graphs.graphs == {}
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "operation not permitted" in warnings[0].getMessage()
    assert run(engine, reqs, {0: list(reqs)}) == eager
    assert engine.runner.num_graph_steps == 0


def test_verify_capture_failure_keeps_the_decode_graphs(model, caplog):
    """Verify graphs that cannot be captured cost only themselves: one warning, the decode graphs
    captured again alone, verify steps eager, tokens unchanged."""
    from kimik3.model.cuda_graphs import capture_or_none
    reqs = _requests(model.config.text.vocab_size)
    kw = dict(block_size=3, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32, extra_blocks=40,
              num_speculative_tokens=2, speculative_ngram_min=1, enable_prefix_caching=False)
    eager = run(make_engine(model, **kw), reqs, {0: list(reqs)})
    engine = make_engine(model, **kw)
    with caplog.at_level("WARNING", logger="kimik3.model.cuda_graphs"):
        engine.runner.graphs = graphs = capture_or_none(VerifyFailingGraphs(model, engine.cache, 8, 32, 3))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "decode steps are captured again alone" in warnings[0], warnings
    assert graphs is not None and graphs.max_query_len == 1 and set(graphs.graphs) == {(s, 1) for s in graphs.sizes}
    assert run(engine, reqs, {0: list(reqs)}) == eager
    assert engine.runner.num_graph_steps > 0


def test_verify_graphs_keep_sampled_and_logprob_requests_exact(model, monkeypatch):
    """Seeded sampled requests with logprobs and n-gram drafts (every other one corrupted): verify
    steps as graph replays give the eager engine's tokens and logprobs."""
    import kimik3.engine.spec.ngram as ngram
    from tests.engine.helpers import oracle_proposer
    vocab = model.config.text.vocab_size
    rng = random.Random(6)
    prompts = [[rng.randrange(5, vocab) for _ in range(6 + 3 * i)] for i in range(3)]
    greedy = run(make_engine(model, block_size=4, max_num_seqs=3, max_model_len=40, extra_blocks=12),
                 {str(i): (p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)) for i, p in enumerate(prompts)})
    monkeypatch.setattr(ngram, "propose_ngram", oracle_proposer(
        {tuple(p): greedy[str(i)][0][0] for i, p in enumerate(prompts)}, vocab))
    reqs = {str(i): (p, SamplingParams(temperature=0.8, top_p=0.9, seed=10 + i, max_tokens=10, ignore_eos=True,
                                       logprobs=3)) for i, p in enumerate(prompts)}
    kw = dict(block_size=4, max_num_seqs=3, max_num_batched_tokens=32, max_model_len=40, enable_prefix_caching=False,
              extra_blocks=12, num_speculative_tokens=3)
    eager = make_engine(model, **kw)
    want = run(eager, reqs)
    engine = make_engine(model, **kw)
    engine.runner.graphs = EagerReplayGraphs(model, engine.cache, 4, 40, 4)   # ladder 1, 2, 4: 3 sequences pad to 4
    engine.runner.graphs.capture()
    got = run(engine, reqs)
    graphs = engine.runner.graphs
    assert any(L > 1 and (meta[2, :size] == 0).any() for (size, L), (meta, _, _) in zip(graphs.replayed, graphs.seen)), \
        "no padded verify step replayed a graph"
    assert eager.num_draft_tokens > 0
    for rid in reqs:
        assert got[rid][0][0] == want[rid][0][0], rid
        assert len(got[rid][0][2]) == len(got[rid][0][0]) == len(want[rid][0][2]), rid
        for a, b in zip(got[rid][0][2], want[rid][0][2]):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a), rid
