"""Engine outputs equal cache-free reference decoding under chunking, preemption, aborts and prefix hits.

The fake model (fake_model.py) checks every cache read, so these runs also prove the block tables,
state restores and checkpoints are right; test_real_model.py repeats the key cases on tiny checkpoints.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kimik3.engine import SamplingParams
from tests.engine.fake_model import FakeModel, reference_greedy
from tests.engine.helpers import check_invariants, count_calls, make_engine, run


def _prompts(rng: random.Random, n: int, max_len: int, vocab: int = 61) -> list[list[int]]:
    """Random prompts, many sharing system prompts (prefix hits) of lengths on and off block boundaries."""
    systems = [[rng.randrange(vocab) for _ in range(rng.randint(1, max_len // 2))] for _ in range(3)]
    out = []
    for _ in range(n):
        tail = [rng.randrange(vocab) for _ in range(rng.randint(0, max_len // 2))]
        p = (rng.choice(systems) + tail) if rng.random() < 0.7 else tail
        out.append(p or [rng.randrange(vocab)])
    return out


scenario = st.fixed_dictionaries({
    "seed": st.integers(0, 10_000),
    "block_size": st.integers(2, 4),
    "max_num_seqs": st.integers(1, 6),
    "max_num_batched_tokens": st.integers(1, 17),
    "extra_blocks": st.integers(0, 4),
    "interval": st.integers(1, 3),
    "prefix": st.sampled_from([True, True, False]),
    "num_requests": st.integers(2, 12),
    "staggered": st.booleans(),
    "aborts": st.integers(0, 2),
    "speculative": st.sampled_from([0, 0, 1, 3]),    # n-gram draft tokens per step (0 = off)
    "cycling": st.booleans(),                        # outputs cycle, so drafts are often accepted
    "sampled": st.integers(0, 2),                    # extra seeded temperature-0.8 requests (plumbing only)
    "async": st.booleans(),                          # async scheduling (with speculation: while drafts pause)
    "long_prefill": st.sampled_from([0, 0, 1, 3]),   # long_prefill_token_threshold (0 = the step's budget)
})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario)
def test_greedy_matches_reference(sc):
    rng = random.Random(sc["seed"])
    model = FakeModel(eos_token_id=rng.choice([None, 5]), next_from_last=sc["cycling"])
    prompts = _prompts(rng, sc["num_requests"], 30)
    reqs = {f"r{i}": (p, SamplingParams(temperature=0, max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.3))
            for i, p in enumerate(prompts)}
    # sampled requests share the batches (and, with speculation, verify drafts by sampling); the
    # fake model checks their cache plumbing on every step, their tokens are not compared
    sampled = {f"s{i}": (p, SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randint(1, 12)))
               for i, p in enumerate(_prompts(rng, sc["sampled"], 30))}
    reqs.update(sampled)
    # the cache holds the longest request plus a few blocks: several running requests force preemption
    max_model_len = max(len(p) + params.max_tokens for p, params in reqs.values())
    engine = make_engine(model, block_size=sc["block_size"], max_num_seqs=sc["max_num_seqs"],
                         max_num_batched_tokens=sc["max_num_batched_tokens"], max_model_len=max_model_len,
                         enable_prefix_caching=sc["prefix"], kda_checkpoint_interval=sc["interval"],
                         extra_blocks=sc["extra_blocks"], num_speculative_tokens=sc["speculative"],
                         speculative_ngram_min=1, speculative_ngram_max=3,
                         async_scheduling=sc["async"], long_prefill_token_threshold=sc["long_prefill"])
    ahead = count_calls(engine.scheduler, "schedule_ahead")
    arrivals: dict[int, list[str]] = {}
    for rid in reqs:
        arrivals.setdefault(rng.randint(0, 15) if sc["staggered"] else 0, []).append(rid)
    aborted = rng.sample(sorted(reqs), min(sc["aborts"], len(reqs)))
    aborts: dict[int, list[str]] = {}
    for rid in aborted:
        aborts.setdefault(rng.randint(0, 8), []).append(rid)

    def check(e):
        check_invariants(e.kv, e.scheduler.running)

    results = run(engine, reqs, arrivals, aborts, check)
    for rid, (prompt, params) in reqs.items():
        if rid in sampled:
            tokens, reason = results[rid][0][:2]
            assert len(tokens) <= params.max_tokens and reason in ("stop", "length", "abort")
            assert reason != "length" or len(tokens) == params.max_tokens or len(prompt) + len(tokens) == max_model_len
            continue
        ref = reference_greedy(model, prompt, params.max_tokens, None if params.ignore_eos else model.config.text.eos_token_id,
                               max_model_len)
        tokens, reason = results[rid][0][:2]
        if rid in aborted and reason == "abort":
            assert tokens == ref[:len(tokens)]
            continue
        assert tokens == ref, f"{rid} prompt {prompt}"
        assert reason == ("stop" if ref and ref[-1] == model.config.text.eos_token_id and not params.ignore_eos
                          else "length")
    event(f"preempted: {engine.scheduler.num_preemptions > 0}")
    event(f"prefix hit: {engine.kv.num_hit_tokens > 0}")
    if engine.config.async_scheduling:
        event(f"steps scheduled ahead: {ahead.hits > 0}")
    if sc["speculative"]:
        event(f"drafts accepted: {engine.num_accepted_tokens > 0}, rejected: "
              f"{engine.num_accepted_tokens < engine.num_draft_tokens}")
    # everything returned: no block or slot held, nothing pending
    assert not engine.has_unfinished_requests()
    check_invariants(engine.kv, [])
    assert engine.kv.blocks.num_free == engine.plan.num_usable_blocks


def test_preemption_recomputes_and_matches():
    model = FakeModel()
    engine = make_engine(model, block_size=2, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=24,
                         extra_blocks=1, enable_prefix_caching=False)
    rng = random.Random(3)
    reqs = {f"r{i}": ([rng.randrange(61) for _ in range(rng.randint(3, 12))], SamplingParams(temperature=0, max_tokens=10))
            for i in range(6)}
    results = run(engine, reqs)
    assert engine.scheduler.num_preemptions > 0
    for rid, (prompt, params) in reqs.items():
        assert results[rid][0][0] == reference_greedy(model, prompt, 10)


def test_prefix_hit_on_exact_boundary_and_partial_tail():
    model = FakeModel()
    engine = make_engine(model, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64,
                         kda_checkpoint_interval=1, extra_blocks=20)
    system = list(range(10, 22))                      # 12 tokens = 3 full blocks
    greedy = SamplingParams(temperature=0, max_tokens=3)
    cases = {"a": system, "b": system + [1, 2], "c": system[:8], "d": system + [3, 4, 5, 6]}
    hits = {}
    for rid, prompt in cases.items():
        out = run(engine, {rid: (prompt, greedy)})
        assert out[rid][0][0] == reference_greedy(model, prompt, 3)
        hits[rid] = engine.kv.num_hit_tokens
    # a: cold. b: its first 3 blocks are a's prompt -> 12 tokens hit.
    # c: 8 tokens on a boundary -> hit clamped to 4 (one token must be computed).
    # d: 16 tokens; a's 3 prompt blocks plus nothing more (block 4 holds a's output, not d's).
    assert hits["a"] == 0
    assert hits["b"] - hits["a"] == 12
    assert hits["c"] - hits["b"] == 4
    assert hits["d"] - hits["c"] == 12


def test_hit_is_clamped_to_a_checkpoint():
    model = FakeModel()
    engine = make_engine(model, block_size=2, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64,
                         kda_checkpoint_interval=3, extra_blocks=20)
    prompt = list(range(1, 16))                       # 7 full blocks; checkpoints after blocks 3 and 6
    greedy = SamplingParams(temperature=0, max_tokens=2)
    run(engine, {"a": (prompt, greedy)})
    out = run(engine, {"b": (prompt + [40], greedy)})
    assert engine.kv.num_hit_tokens == 12             # 7 blocks cached, clamped to the checkpoint at block 6
    assert out["b"][0][0] == reference_greedy(model, prompt + [40], 2)


@pytest.mark.parametrize("spec", [0, 3], ids=["plain", "speculative"])
def test_n_samples_share_the_prompt(spec):
    model = FakeModel(sharpness=0.3, next_from_last=bool(spec))
    engine = make_engine(model, block_size=2, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                         kda_checkpoint_interval=1, extra_blocks=40, num_speculative_tokens=spec,
                         speculative_ngram_min=1)
    prompt = list(range(3, 20))
    out = run(engine, {"r": (prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6))})
    assert len(out["r"]) == 3 and all(len(c[0]) == 6 for c in out["r"])
    assert len({tuple(c[0]) for c in out["r"]}) > 1, "n samples should differ"
    assert engine.kv.num_hit_tokens == 2 * 16         # samples 2 and 3 reuse the 8 full prompt blocks
    assert (engine.num_draft_tokens > 0) == bool(spec)
    check_invariants(engine.kv, [])


def test_abort_frees_memory_immediately():
    model = FakeModel()
    engine = make_engine(model, block_size=2, max_num_seqs=3, max_num_batched_tokens=4, max_model_len=32,
                         extra_blocks=10, enable_prefix_caching=False)
    engine.add_request("a", {"prompt_token_ids": list(range(20))}, SamplingParams(temperature=0, max_tokens=5))
    engine.add_request("b", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=5))
    engine.step()
    free_before = engine.kv.blocks.num_free
    engine.abort_request("a")
    assert engine.kv.blocks.num_free > free_before
    check_invariants(engine.kv, engine.scheduler.running)
    deltas = engine.step()
    final = [d for d in deltas if d.request_id == "a"]
    assert final and final[0].finished and final[0].outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()


def test_waiting_abort_and_unknown_id():
    engine = make_engine(FakeModel(), max_num_seqs=1, max_model_len=16, extra_blocks=2)
    engine.add_request("a", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=3))
    engine.add_request("b", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=3))
    engine.abort_request("b")           # still waiting
    engine.abort_request("nope")        # unknown ids are ignored
    seen = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            seen[d.request_id] = d.outputs[-1].finish_reason if d.outputs else None
    assert seen == {"a": "length", "b": "abort"}


def test_max_model_len_caps_generation():
    model = FakeModel()
    engine = make_engine(model, block_size=4, max_model_len=10, extra_blocks=0)
    out = run(engine, {"a": ([1, 2, 3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=100))})
    tokens, reason, _ = out["a"][0]
    assert len(tokens) == 4 and reason == "length"


@pytest.mark.parametrize("budget", [1, 2, 5])
def test_decodes_and_chunked_prefill_share_steps(budget):
    """Running decodes go first; the rest of the budget goes to a chunk of a long prompt."""
    model = FakeModel()
    engine = make_engine(model, block_size=3, max_num_batched_tokens=budget + 1, max_model_len=64, extra_blocks=10)
    engine.add_request("short", {"prompt_token_ids": [4]}, SamplingParams(temperature=0, max_tokens=20))
    engine.step()
    engine.add_request("long", {"prompt_token_ids": list(range(30))}, SamplingParams(temperature=0, max_tokens=1))
    out = engine.scheduler.schedule()
    assert [(c.req.request_id, c.num_tokens) for c in out.chunks] == [("short", 1), ("long", budget)]


def test_long_prefill_token_threshold_caps_a_prompts_chunk():
    """vLLM's long_prefill_token_threshold: a prompt (just admitted or running) computes at most that many tokens a
    step however much budget is left, so the decodes beside it keep short steps; the tokens are unchanged."""
    model = FakeModel()
    engine = make_engine(model, block_size=4, max_num_batched_tokens=64, max_model_len=64, extra_blocks=10,
                         long_prefill_token_threshold=5)
    chunks = []
    schedule = engine.scheduler.schedule

    def recorded():
        out = schedule()
        chunks.append({c.req.request_id: c.num_tokens for c in out.chunks})
        return out
    engine.scheduler.schedule = recorded
    long = list(range(3, 33))
    out = run(engine, {"short": ([4], SamplingParams(temperature=0, max_tokens=20)),
                       "long": (long, SamplingParams(temperature=0, max_tokens=3))}, arrivals={0: ["short"], 1: ["long"]})
    assert out["long"][0][0] == reference_greedy(model, long, 3)
    assert out["short"][0][0] == reference_greedy(model, [4], 20)
    prefill = [c["long"] for c in chunks if "long" in c]
    assert prefill[:6] == [5, 5, 5, 5, 5, 5] and all(c.get("short") == 1 for c in chunks[1:7])


def test_offline_api_is_exported_at_the_top_level():
    import kimik3

    llm = kimik3.LLM(str(kimik3.DEFAULT_MODEL), max_num_seqs=2, max_model_len=64)
    out = llm.generate(["Hello", "Hello"], kimik3.SamplingParams(max_tokens=4, temperature=0))
    assert out[0].outputs[0].token_ids == out[1].outputs[0].token_ids and len(out[0].outputs[0].token_ids) == 4
