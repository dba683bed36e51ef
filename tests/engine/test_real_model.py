"""The engine on tiny random K3 / Kimi-Linear checkpoints: greedy outputs equal ``model(ids)`` decoding
with chunked prefill, block size 2-3, preemption from a tiny cache, an abort mid-run and prefix hits."""

from __future__ import annotations

import random

import pytest
import torch

import kimik3
import kimik3.testing
from kimik3.engine import LLM, SamplingParams
from tests.engine.fake_model import reference_greedy
from tests.engine.helpers import budget_for, make_engine, run


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_linear"])
def model(request, tiny_ckpt):
    return kimik3.load_model(tiny_ckpt[request.param], device="cpu", dtype=torch.float32)


def _requests(vocab: int, seed: int):
    rng = random.Random(seed)
    system = [rng.randrange(5, vocab) for _ in range(6)]       # 6 = 2 and 3 blocks of size 3 and 2
    prompts = [system, system + [9], system[:4], system + [rng.randrange(5, vocab) for _ in range(7)],
               [rng.randrange(5, vocab) for _ in range(11)], [rng.randrange(5, vocab)]]
    return {f"r{i}": (p, SamplingParams(temperature=0, max_tokens=rng.randint(2, 5), ignore_eos=True))
            for i, p in enumerate(prompts)}


@pytest.mark.parametrize("block_size,budget_tokens,extra_blocks", [(2, 6, 0), (3, 5, 30)],
                         ids=["B2-chunk6-preempt", "B3-chunk5-prefix"])
def test_greedy_matches_reference(model, block_size, budget_tokens, extra_blocks):
    vocab = model.config.text.vocab_size
    reqs = _requests(vocab, seed=block_size)
    engine = make_engine(model, block_size=block_size, max_num_seqs=4, max_num_batched_tokens=budget_tokens,
                         max_model_len=20, kda_checkpoint_interval=1, extra_blocks=extra_blocks)
    # r0 first (its prompt is then cached), the rest later; r4 aborted while running
    arrivals = {0: ["r0"], 8: ["r1", "r2", "r3", "r4"], 9: ["r5"]}
    results = run(engine, reqs, arrivals, aborts={12: ["r4"]})
    for rid, (prompt, params) in reqs.items():
        tokens, reason, _ = results[rid][0]
        ref = reference_greedy(model, prompt, params.max_tokens)
        if reason == "abort":
            assert rid == "r4" and tokens == ref[:len(tokens)]
        else:
            assert tokens == ref, rid
    if extra_blocks == 0:
        assert engine.scheduler.num_preemptions > 0
    else:
        assert engine.kv.num_hit_tokens > 0
    assert engine.kv.blocks.num_free == engine.plan.num_usable_blocks


def test_llm_generate_api(tiny_ckpt):
    path = tiny_ckpt["kimi_k3"]
    model = kimik3.load_model(path, device="cpu", dtype=torch.float32)
    budget = budget_for(model, 4, 8, 64, 1)
    llm = LLM(str(path), device="cpu", dtype=torch.float32, block_size=4, max_num_seqs=8, max_model_len=64,
              kv_cache_memory_bytes=budget, kda_checkpoint_interval=1, seed=0)
    prompts = [{"prompt_token_ids": [11, 12, 13, 14, 15]}, {"prompt_token_ids": [20, 21]}]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2))
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        assert o.finished and c.finish_reason == "length"
        assert c.token_ids == reference_greedy(model, p["prompt_token_ids"], 4)
        assert len(c.logprobs) == 4 and all(len(d) >= 2 and t in d for d, t in zip(c.logprobs, c.token_ids))
        assert c.text == ""            # tiny checkpoints ship no tokenizer
    first = model(torch.tensor(prompts[0]["prompt_token_ids"]))[-1].log_softmax(-1)
    lp = outs[0].outputs[0].logprobs[0]
    for t, v in lp.items():
        assert v == pytest.approx(float(first[t]), abs=1e-4)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("hello")


def test_string_prompts_text_and_stop_strings_with_a_real_tokenizer(tmp_path):
    from kimik3.tokenizer import load_tokenizer
    from kimik3.tokenizer_build import build_tiny_tokenizer
    build_tiny_tokenizer(tmp_path, base_vocab_size=512, seed=0)
    tok = load_tokenizer(tmp_path)
    kimik3.testing.make_tiny_checkpoint(tmp_path, arch="kimi_k3", vocab_size=tok.vocab_size)
    llm = LLM(str(tmp_path), device="cpu", dtype=torch.float32, max_model_len=64, kv_cache_memory_bytes=4 << 20)
    prompts = ["hello world, this is", "another prompt"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, o in zip(prompts, outs):
        assert o.prompt == prompt and o.prompt_token_ids == tok.encode(prompt)
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
    text = outs[0].outputs[0].text
    stop = text[3:5]
    cut = text.find(stop)
    again = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stop))[0]
    c = again.outputs[0]
    assert c.text == text[:cut] and c.finish_reason == "stop" and c.stop_reason == stop
    assert c.token_ids == outs[0].outputs[0].token_ids[:len(c.token_ids)]
