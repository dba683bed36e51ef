"""MLA prefill in pieces of the context on CUDA (Triton kernel, both forms) at real head sizes
against the torch reference in float32 (the reference itself is checked against float64 math in
tests/ops/test_mla_prefill.py), with ragged batches mixing fresh prompts and continuations whose
contexts span several pieces; the caching allocator is filled with NaN before each fast run.
Then engine level: a prompt prefilled in many chunks gives the greedy tokens of one chunk.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from kimik3.ops.backend import reference_ops
from kimik3.ops.mla import mla_prefill_attention
from kimik3.ops.options import KernelTuning, kernel_options, use_kernel_options
from tests.gpu.test_fast_ops import BF16_BOUND, _paged, poison_allocator
from tests.helpers import rel_errs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16 = torch.bfloat16
R, P, DN, DV = 512, 64, 128, 128          # both releases: kv_lora_rank, rope, nope, v head dims


def run_case(H, query_lens, context_lens, form, block, seed=0, bs=64):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cache, tables = _paged([c + q for c, q in zip(context_lens, query_lens)], bs, R + P, g)
    q = torch.randn(sum(query_lens), H, DN + P, generator=g, device="cuda").to(BF16)
    kv_b = (torch.randn(H * (DN + DV), R, generator=g, device="cuda") / math.sqrt(R)).to(BF16)
    scale = (DN + P) ** -0.5
    with reference_ops():                     # default mla_prefill_block: one piece for these contexts
        ref = mla_prefill_attention(q.float(), cache.float(), tables, kv_b.float(), query_lens, context_lens,
                                    R, DV, scale, form="naive")
    with use_kernel_options(kernel_options().tuned(mla_prefill_block=block)):
        poison_allocator()
        out = mla_prefill_attention(q, cache, tables, kv_b, query_lens, context_lens, R, DV, scale, form=form)
    assert out.dtype == BF16 and out.shape == (sum(query_lens), H, DV)
    return rel_errs(out, ref, query_lens)


CASES = {
    # fresh prompts beside continuations; 1024-position pieces: contexts span up to 4 of them
    "mixed": ([300, 1, 77, 512, 64], [0, 40, 1500, 3000, 0]),
    "one_chunk_long_context": ([1024], [3100]),
    "decode_like": ([1, 3, 2], [2047, 4000, 17]),
}


@pytest.mark.parametrize("form", ["naive", "absorbed"])
@pytest.mark.parametrize("H", [96, 32], ids=["H96_k3", "H32_linear"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_matches_reference(case, H, form):
    query_lens, context_lens = CASES[case]
    errs = run_case(H, query_lens, context_lens, form, block=1024)
    assert max(errs) < BF16_BOUND, errs


def test_single_piece_matches_reference():
    """The default mla_prefill_block (no merge: the kernel writes bf16 directly)."""
    errs = run_case(96, [700, 5], [0, 900], "naive", block=KernelTuning().mla_prefill_block, seed=1)
    assert max(errs) < BF16_BOUND, errs


# ---- engine level ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    from benchmarks.gpu.bench_slice import build_slice
    from tests.gpu.test_engine_graphs import CONFIG
    return build_slice(json.loads(CONFIG.read_text()))


def greedy(model, budget, reqs):
    from kimik3.engine import EngineConfig, LLMEngine
    from tests.gpu.test_engine_graphs import generate
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=1024, block_size=16,
                       enable_prefix_caching=False, cache_memory_bytes=3 << 30, enforce_eager=True)
    engine = LLMEngine(model, cfg)
    return generate(engine, reqs), engine.runner.num_steps


def test_many_chunks_give_the_greedy_tokens_of_one_chunk(model, monkeypatch, kernel_options):
    """One chunk per prompt (budget 2048: naive form, one piece) against 48-token chunks with
    128-position pieces (continuations of <= 48 queries take the absorbed form by prefill_form,
    decode rows beside a chunk too). Both runs' tokens are checked against the model called directly
    (``assert_model_greedy``): the slice's top-5 logprobs lie within ~0.2 nats, so an expert flipped
    by rounding in one run (0.5-1 nats) parts the runs outside each other's top-5 (r0's token 3 at
    8e0e2ef), while each run's tokens stay the model's greedy choice."""
    from kimik3.engine import SamplingParams
    from tests.gpu.test_engine_graphs import SLICE_CROSS_NOISE, assert_model_greedy, flips_allowed
    rng = random.Random(1)
    vocab = model.config.text.vocab_size
    reqs = {f"r{i}": ([rng.randrange(1000, vocab) for _ in range(n)],
                      SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5))
            for i, n in enumerate((700, 301, 45))}
    one, one_steps = greedy(model, 2048, reqs)
    kernel_options(mla_prefill_block=128)
    many, many_steps = greedy(model, 48, reqs)
    assert many_steps >= one_steps + 10, (one_steps, many_steps)       # 1046 prompt tokens / 48 per step
    for name, run in (("one chunk", one), ("48-token chunks", many)):
        for rid, (prompt, sp) in reqs.items():
            print(name, end=" ")
            assert_model_greedy(model, rid, prompt, *run[rid], SLICE_CROSS_NOISE, 2 * SLICE_CROSS_NOISE,
                                flips=flips_allowed(sp.max_tokens))
