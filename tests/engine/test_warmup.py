"""The warm-up (``kimik3/engine/warmup.py``) leaves no trace: after it, the engine's greedy outputs equal
``model(ids)`` decoding, every cache block is free, no request is left, and it refuses a busy engine."""

from __future__ import annotations

import pytest
import torch

import kimik3
from kimik3.engine import SamplingParams
from kimik3.engine.warmup import step_groups, warm_up, warmup_lengths
from tests.engine.fake_model import reference_greedy
from tests.engine.helpers import make_engine, run


def test_lengths_cover_each_power_of_two_and_its_neighbours():
    assert warmup_lengths(17) == [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17]
    assert warmup_lengths(20) == [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 20]
    assert warmup_lengths(1) == [1]


@pytest.mark.parametrize("arch", ["kimi_k3", "kimi_linear"])
def test_warm_up_leaves_no_trace(tiny_ckpt, arch):
    model = kimik3.load_model(tiny_ckpt[arch], device="cpu", dtype=torch.float32)
    engine = make_engine(model, block_size=2, max_num_seqs=3, max_num_batched_tokens=9, max_model_len=24,
                         enable_prefix_caching=True, extra_blocks=20)
    seconds = warm_up(engine)
    assert seconds > 0 and engine.runner.num_steps > 0 and not engine.groups
    assert engine.kv.blocks.num_free == engine.plan.num_usable_blocks
    assert not engine.kv.blocks.cached and not engine.kv.checkpoints         # the prefix cache is empty
    vocab = model.config.text.vocab_size
    prompts = [[(7 * i + 11 * n) % vocab for i in range(n)] for n in (5, 9, 13)]
    reqs = {f"r{i}": (p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)) for i, p in enumerate(prompts)}
    results = run(engine, reqs)
    for rid, (prompt, params) in reqs.items():
        assert results[rid][0][0] == reference_greedy(model, prompt, params.max_tokens), rid


def test_warm_up_refuses_a_busy_engine(tiny_ckpt):
    model = kimik3.load_model(tiny_ckpt["kimi_k3"], device="cpu", dtype=torch.float32)
    engine = make_engine(model, block_size=2, max_num_seqs=2, max_model_len=16)
    engine.add_request("busy", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        warm_up(engine)


def test_step_groups_fill_each_step_size_with_prompts_the_model_admits():
    # then a group overflowing the 17-token step by a tail: fillers, then a prompt whose last tokens come next step
    assert step_groups(17, 40, 4) == [[n] for n in warmup_lengths(17)] + [[17 + 16]]
    groups = step_groups(17, 6, 4)
    assert [sum(g) for g in groups[:-1]] == warmup_lengths(17)
    assert all(max(g) - min(g) <= 1 and max(g) <= 6 and len(g) == -(-sum(g) // 6) for g in groups[:-1])
    assert groups[-1] == [5, 5, 4, 6]             # 14 + 3 = 17 tokens in one step, the last prompt's other 3 next
    assert [sum(g) for g in step_groups(100, 6, 2)] == warmup_lengths(12)     # two prompts fill 12 at most: no tail
    *fillers, last = step_groups(8192, 398, 64)[-1]
    assert max(fillers) <= 398 and last == 398 and sum(fillers) + last - 16 == 8192


@pytest.mark.parametrize("max_model_len", [40, 12])
def test_warm_up_steps_take_each_size_class_and_hit_the_prefix_cache(tiny_ckpt, max_model_len):
    """Kernels specialise on a step's token count, so the warm-up has a step of exactly each warm-up
    length up to the step budget (one prompt alone, or a group of prompts filling the step together
    where the budget exceeds the longest prompt), steps that mix prefill chunks with decode rows, and
    prefix hits."""
    model = kimik3.load_model(tiny_ckpt["kimi_k3"], device="cpu", dtype=torch.float32)
    engine = make_engine(model, block_size=2, max_num_seqs=4, max_num_batched_tokens=17, max_model_len=max_model_len,
                         enable_prefix_caching=True, extra_blocks=80, kda_checkpoint_interval=2)
    steps = []
    schedule = engine.scheduler.schedule

    def record():
        out = schedule()
        steps.append([(c.num_tokens, c.samples, c.start, c.req.request_id) for c in out.chunks])
        return out
    engine.scheduler.schedule = record
    warm_up(engine)
    prefill_only = {sum(c[0] for c in chunks) for chunks in steps if chunks and all(c[0] > 1 for c in chunks)}
    assert set(warmup_lengths(17)) - {1} <= prefill_only      # (a one-token prompt's step looks like a decode row)
    # round (1)'s last group: a prompt's tail chunk over the part of it the step before computed
    last = f"warmup-{len(step_groups(17, max_model_len - 2, 4)) - 1}-"
    assert any(1 < n <= 16 and start >= 4 and samples and rid.startswith(last)
               for chunks in steps for n, samples, start, rid in chunks)
    assert any(len(c) > 1 and any(x[0] > 1 for x in c) and any(x[0] == 1 for x in c) for c in steps)  # mixed
    assert engine.kv.num_hit_tokens > 0
    assert not engine.kv.blocks.cached and not engine.kv.checkpoints
