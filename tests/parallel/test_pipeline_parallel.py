"""Pipeline parallelism on CPU ranks (gloo, float64): stages of contiguous decoder layers, the residual
stream (AttnRes blocks and partial, or the plain residual and its pending output) sent between stages;
PP2 and PP2 x TP2 (with EP) give the one-process logits with 1 to 3 micro-batches per step, each stage caching
only its layers and holding only its parameters; stages overlap on consecutive micro-batches (a recorded
timeline); the stage planner balances bytes and prefers attention-residual block starts. Rank bodies live in
``ranks.py``."""

import re

import pytest
import torch

from kimik3.distributed import plan_stages
from kimik3.engine import EngineConfig, LLMEngine
from kimik3.loader.load import load_model
from kimik3.model import ForwardBatch, StateCheckpoint
from kimik3.parallel.pipeline import micro_batch_bounds
from kimik3.testing import make_tiny_checkpoint
from tests.helpers import rel_err
from tests.parallel.ranks import (ENGINE_CONFIG, engine_prompts, image_prompts, pipeline_engine_rank, pipeline_images_rank,
                                  pipeline_rank, run_engine, run_steps, spawn)

ARCHS = ("kimi_k3", "kimi_linear")
# name: (stages, expert parallel, the cut layer of two stages or None = planned, micro-batches per step);
# TP = world / stages
LAYOUTS = {
    2: {"pp2": (2, False, None, 1), "pp2-mb2": (2, False, None, 2), "pp2-cut1-mb3": (2, False, 1, 3)},
    4: {"pp2xtp2-mb2": (2, False, None, 2), "pp2xep2-cut4": (2, True, 4, 1)},
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("pp")
    return {arch: make_tiny_checkpoint(d / arch, arch, seed=1, num_heads=4, **({"vision": False} if arch == "kimi_k3" else {}))
            for arch in ARCHS}


def _stage_of(name: str, ranges) -> set[int]:
    """The stages that should hold parameter ``name`` (spec parallelism §4.3)."""
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    if layer:
        return {s for s, (lo, hi) in enumerate(ranges) if lo <= int(layer[1]) < hi}
    if name.startswith(("model.embed_tokens.", "vision.")):
        return {0}
    if name.startswith(("lm_head.", "model.norm.", "model.output_attn_res_")):
        return {len(ranges) - 1}
    raise AssertionError(f"unexpected parameter {name}")


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_layouts_match_one_process(ckpts, tmp_path, world):
    """Logits of every step equal the one-process ones, with 1 to 3 micro-batches per step (cuts between and inside
    chunks, a KDA checkpoint in a cut chunk); each stage caches its own layers and holds only its parameters: its
    layers, the embedding on the first stage, the final norm / output mixer / LM head on the last, none twice."""
    ones = {arch: load_model(path, dtype=torch.float64) for arch, path in ckpts.items()}
    reference = {arch: run_steps(model)[0] for arch, model in ones.items()}
    spawn(pipeline_rank, world, {a: str(p) for a, p in ckpts.items()}, LAYOUTS[world], str(tmp_path / "out.pt"),
          timeout=300)
    results = torch.load(tmp_path / "out.pt", weights_only=False)
    for arch in ARCHS:
        L = ones[arch].config.text.num_hidden_layers
        whole = {n: p.numel() * p.element_size() for n, p in ones[arch].named_parameters()}
        for name, (pp, _, cut, _) in LAYOUTS[world].items():
            logits, per_rank = results[arch, name]
            for step, (a, b) in enumerate(zip(logits, reference[arch])):
                assert rel_err(a, b) <= 1e-12, f"{arch} {name} step {step}: rel err {rel_err(a, b):.2e}"
            ranges = per_rank[0][1]
            assert ranges[0][0] == 0 and ranges[-1][1] == L and len(ranges) == pp
            if cut:
                assert ranges == ((0, cut), (cut, L))
            tp = world // pp
            for r, (layers, _, params) in enumerate(per_rank):      # each stage caches its own layers only
                lo, hi = ranges[r // tp]
                assert layers and all(lo <= i < hi for i in layers), (arch, name, r, layers)
                wrong = [n for n in params if r // tp not in _stage_of(n, ranges)]
                assert not wrong, (arch, name, r, wrong[:5])
            # TP rank 0 of each stage: every parameter of the one-process model on exactly one stage (EP / TP
            # split some of them), and the stages' bytes add up to the whole model's when TP is 1
            held = [n for s in range(pp) for n in per_rank[s * tp][2]]
            assert sorted(held) == sorted(whole), (arch, name)
            if tp == 1:
                assert sum(sum(p[2].values()) for p in per_rank) == sum(whole.values())
                first, last = per_rank[0][2], per_rank[-1][2]
                assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
                assert "lm_head.weight" in last and "model.norm.weight" in last and "model.embed_tokens.weight" not in last


def test_micro_batches_in_one_process_match_the_whole_batch(ckpts):
    """The micro-batches of a step run one after the other in one process (``ForwardBatch.slice_rows``: cuts
    inside chunks and a short step, the checkpoint renumbered) give the whole step's logits and caches."""
    for arch, path in ckpts.items():
        model = load_model(path, dtype=torch.float64)
        whole, _, cache = run_steps(model)
        for micro in (2, 3, 5):
            parts, _, cut_cache = run_steps(model, micro_batches=micro)
            for step, (a, b) in enumerate(zip(parts, whole)):
                assert rel_err(a, b) <= 1e-12, f"{arch} {micro} micro-batches, step {step}: {rel_err(a, b):.2e}"
            for name in ("kda_state", "kda_conv", "mla_latent"):       # slot / block 0: scratch, the null block
                a, b = getattr(cut_cache, name)[:, 1:], getattr(cache, name)[:, 1:]
                assert rel_err(a, b) <= 1e-12, (arch, micro, name)


def test_micro_batch_bounds_balance_tokens():
    decode = ForwardBatch.build([1] * 5, [3] * 5, list(range(1, 6)), [[1]] * 5, 4)
    assert micro_batch_bounds(decode, 2) == [0, 2, 5]
    assert micro_batch_bounds(decode, 1) == [0, 5]
    assert micro_batch_bounds(decode, 9) == [0, 1, 2, 3, 4, 5]          # at most one micro-batch per row
    prefill = ForwardBatch.build([30, 2], [0, 0], [1, 2], [list(range(1, 9)), [9]], 4)
    assert micro_batch_bounds(prefill, 2) == [0, 16, 32]                 # a chunk is cut inside
    with pytest.raises(ValueError, match="micro-batch count"):
        micro_batch_bounds(decode, 0)


def test_a_cut_short_step_keeps_each_rows_state_slot():
    """A short step (verify chunks: a KDA state slot per row) cut inside a chunk: the first piece's last row keeps
    the state in the live slot, the second piece's rows keep their own slots, checkpoints follow their rows."""
    verify = ForwardBatch.build([4, 3], [5, 5], [1, 2], [[1, 2, 3]] * 2, 4,
                                checkpoints=(StateCheckpoint(0, 2, 7), StateCheckpoint(0, 3, 8)))
    assert verify.row_state_slots.tolist() == [[0, 7, 8, 1], [0, 0, 2, 0]]
    head, tail = verify.slice_rows(0, 2), verify.slice_rows(2, 7)
    assert head.row_state_slots.tolist() == [[0, 1]] and head.checkpoints == (StateCheckpoint(0, 2, 7),)
    assert tail.row_state_slots.tolist() == [[8, 1, 0], [0, 0, 2]] and tail.checkpoints == (StateCheckpoint(0, 1, 8),)
    assert tail.context_lens_cpu == [7, 5] and tail.query_lens_cpu == [2, 3] and tail.cu_seqlens.tolist() == [0, 2, 5]
    assert verify.slice_rows(3, 4).row_state_slots is None and verify.slice_rows(3, 4).is_decode


def test_a_micro_batch_keeps_its_image_rows_with_or_without_the_embeddings():
    """A micro-batch takes the image rows inside it, renumbered, and their embeddings where the batch has them (the
    first stage); a later stage's batch has the rows but not the embeddings."""
    batch = ForwardBatch.build([6, 4], [0, 0], [1, 2], [[1, 2], [3]], 4)
    batch.embed_rows, batch.embeds = torch.tensor([1, 2, 7]), torch.arange(6.0).view(3, 2)
    head, tail = batch.slice_rows(0, 5), batch.slice_rows(5, 10)
    assert head.embed_rows.tolist() == [1, 2] and head.embeds.tolist() == [[0, 1], [2, 3]]
    assert tail.embed_rows.tolist() == [2] and tail.embeds.tolist() == [[4, 5]]
    batch.embeds = None
    later = batch.slice_rows(5, 10)
    assert later.embed_rows.tolist() == [2] and later.embeds is None


def test_image_prompts_through_the_pipeline(tmp_path):
    """PP2 through the engine (two micro-batches a step) with image prompts: the first stage encodes the images, the
    second runs micro-batches whose image rows it has no embeddings for (it failed there); the greedy outputs equal
    the one-process engine's."""
    path = make_tiny_checkpoint(tmp_path / "k3", "kimi_k3", seed=1, num_heads=4)
    model = load_model(path, dtype=torch.float64)
    want = run_engine(LLMEngine(model, EngineConfig(**ENGINE_CONFIG)), image_prompts(model))[0]
    spawn(pipeline_images_rank, 2, str(path), str(tmp_path / "out.pt"), timeout=300)
    outs, encoded = torch.load(tmp_path / "out.pt", weights_only=False)
    assert outs == want
    assert encoded == [4, 0], encoded                    # the vision tower runs on the first stage only


def test_stages_overlap_on_consecutive_micro_batches(ckpts, tmp_path):
    """PP2 through the engine with every layer slowed (40 ms a token per stage): with 2 micro-batches per step
    stage 0 works on micro-batch 1 while stage 1 works on micro-batch 0 (their recorded intervals overlap by
    most of the shorter), and a step's span shrinks from about 2 to 1.5 times stage 0's work; with 1 the stages
    never overlap. Greedy tokens equal the one-process engine's either way."""
    path = ckpts["kimi_k3"]
    model = load_model(path, dtype=torch.float64)
    want = run_engine(LLMEngine(model, EngineConfig(**ENGINE_CONFIG)), engine_prompts(model.config.text.vocab_size)[0],
                      max_tokens=4)[0]
    spawn(pipeline_engine_rank, 2, str(path), [2, 1], 0.04, str(tmp_path / "out.pt"), timeout=300)
    results = torch.load(tmp_path / "out.pt", weights_only=False)
    spans = {}
    for micro, (outs, per_rank) in results.items():
        assert outs == want, micro
        timeline = dict(per_rank)                  # stage -> per step, (micro-batch, start, end) of its work
        assert len(timeline[0]) == len(timeline[1]) > 0
        overlaps, ratio = [], []
        for first, second in zip(timeline[0], timeline[1]):
            assert [k for k, *_ in first] == [k for k, *_ in second] == list(range(len(first)))
            for (_, a0, a1), (_, b0, b1) in zip(first[1:], second):       # stage 0 on k + 1, stage 1 on k
                overlaps.append((min(a1, b1) - max(a0, b0)) / min(a1 - a0, b1 - b0))
            ratio.append((second[-1][2] - first[0][1]) / sum(end - start for _, start, end in first))
        spans[micro] = sorted(ratio)[len(ratio) // 2]
        if micro == 1:
            assert not overlaps and all(s[0][1] >= f[-1][2] for f, s in zip(timeline[0], timeline[1]))
        else:
            assert overlaps and sum(o > 0.5 for o in overlaps) >= 0.8 * len(overlaps), overlaps
    # median step span over stage 0's work: ~2 with one micro-batch, ~1.5 with two
    assert spans[2] < 0.9 * spans[1], spans


def test_stage_planner_balances_bytes_and_prefers_block_starts():
    assert plan_stages([10] * 8, 2) == ((0, 4), (4, 8))
    assert plan_stages([30, 10, 10, 10, 10, 10, 10, 10], 2) == ((0, 3), (3, 8))
    # block size 3: the even cut (before layer 4) sends 2 blocks + the partial; before layer 3, one layer's
    # bytes off balance, 1 block + the partial. Block size 4: both send 1 block, the balanced cut stays
    assert plan_stages([10] * 8, 2, block_size=3) == ((0, 3), (3, 8))
    assert plan_stages([10] * 8, 2, block_size=4) == ((0, 4), (4, 8))
    assert plan_stages([10] * 9, 3) == ((0, 3), (3, 6), (6, 9))
    with pytest.raises(ValueError, match="pipeline parallel size 9"):
        plan_stages([10] * 8, 9)
