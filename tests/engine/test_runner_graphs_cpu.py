"""The CUDA-graph decode branch of the runner, without CUDA: the batch ladder, input padding, and the
whole engine with each "graph" replaced by an eager step over the same static buffers (same padding,
same pinned ``max_seq_len``), which must give the eager engine's tokens and touch only the null
slot / null block besides the sequences' own."""

from __future__ import annotations

import random

import pytest
import torch

import kimik3
from kimik3.engine import SamplingParams
from kimik3.model.cuda_graphs import graph_batch_sizes, pack_decode_inputs, padded_batch_size
from tests.engine.helpers import EagerReplayGraphs, FailingGraphs, make_engine, run


@pytest.mark.parametrize("max_num_seqs,sizes", [(1, [1]), (5, [1, 2, 4, 5]), (8, [1, 2, 4, 8]),
                                                (64, [1, 2, 4, 8, 16, 32, 64]), (100, [1, 2, 4, 8, 16, 32, 64, 100])])
def test_graph_batch_sizes(max_num_seqs, sizes):
    assert graph_batch_sizes(max_num_seqs) == sizes


def test_graph_batch_sizes_rejects_zero():
    with pytest.raises(ValueError, match="max_num_seqs must be positive"):
        graph_batch_sizes(0)


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
                             [9 * 4 + 1, 4 * 4 + 2, 8 * 4 + 0, 0, 0]]   # slot mapping (block 0 row 0)
    assert tables.tolist() == [[7, 9, 0], [4, 0, 0], [6, 5, 8], [0, 0, 0], [0, 0, 0]]


def test_pack_decode_inputs_errors():
    with pytest.raises(ValueError, match="do not fit a decode graph of 2 rows"):
        pack_decode_inputs([1, 2, 3], [1, 1, 1], [1, 2, 3], [[1], [2], [3]], block_size=4, size=2)
    with pytest.raises(ValueError, match="none for position 4"):
        pack_decode_inputs([1], [4], [1], [[1]], block_size=4, size=1)
    with pytest.raises(ValueError, match="one entry per sequence"):
        pack_decode_inputs([1, 2], [1], [1], [[1]], block_size=4, size=2)


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
        live = set(meta[2].tolist()) | {0}
        blocks = set((meta[3] // 3).tolist()) | {0}
        for pool, (b, a) in (("kda_conv", (before[0], after[0])), ("kda_state", (before[1], after[1]))):
            changed = {s for s in range(b.shape[1]) if not torch.equal(b[:, s], a[:, s])}
            assert changed <= live, f"{pool}: padding touched slots {changed - live}"
        changed = {k for k in range(before[2].shape[1]) if not torch.equal(before[2][:, k], after[2][:, k])}
        assert changed <= blocks, f"mla_latent: padding touched blocks {changed - blocks}"


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
