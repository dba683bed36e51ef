"""Async scheduling (``EngineConfig.async_scheduling``) on the tiny K3 / Kimi-Linear checkpoints: greedy
outputs equal ``model(ids)`` decoding, sampled and constrained requests give the synchronous engine's
tokens and logprobs, requests ended by the in-flight step's token (stop tokens) or aborted while it is in
flight leave it cleanly, and a failure of a step scheduled ahead reaches the caller after the tokens of
the step before it. (The fake-model property test in test_llm_engine.py runs async too.)"""

from __future__ import annotations

import random

import pytest
import torch

import kimik3
from kimik3.engine import SamplingParams
from kimik3.engine.core.llm_engine import StepError
from kimik3.engine.sample.sampling_params import StructuredOutputsParams
from tests.engine.fake_model import reference_greedy
from tests.engine.helpers import count_calls, make_engine, oracle_proposer, run, turn_async


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_linear"])
def model(request, tiny_ckpt):
    return kimik3.load_model(tiny_ckpt[request.param], device="cpu", dtype=torch.float32)


def engines(model, **kw):
    """A synchronous and an async engine with the same settings (prefix caching on)."""
    kw = dict(block_size=4, kda_checkpoint_interval=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=40,
              extra_blocks=20, **kw)
    return make_engine(model, **kw), make_engine(model, async_scheduling=True, **kw)


def prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(5, vocab) for _ in range(5)]
    return [system + [rng.randrange(5, vocab) for _ in range(rng.randint(1, 9))] for _ in range(n)]


def test_greedy_equals_the_model_and_stop_tokens_end_in_flight(model):
    vocab = model.config.text.vocab_size
    reqs = {}
    for i, p in enumerate(prompts(vocab, 6, seed=1)):
        ref = reference_greedy(model, p, 9)
        stop = [ref[2 + i % 5]] if i % 2 else []         # half of them end on a stop token mid-run
        reqs[f"r{i}"] = (p, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, stop_token_ids=stop))
    _, engine = engines(model)
    ahead = count_calls(engine.scheduler, "schedule_ahead")
    arrivals = {0: ["r0", "r1", "r2"], 5: ["r3", "r4"], 9: ["r5"]}    # arrivals end the pipelining for a step
    results = run(engine, reqs, arrivals)
    for rid, (p, params) in reqs.items():
        ref = reference_greedy(model, p, 9)
        stop = params.stop_token_ids
        want = ref[:ref.index(stop[0]) + 1] if stop else ref
        tokens, reason, _ = results[rid][0]
        assert tokens == want and reason == ("stop" if stop else "length"), rid
    assert ahead.hits > 5
    assert not engine.has_unfinished_requests() and engine.kv.blocks.num_free == engine.plan.num_usable_blocks


def test_sampled_requests_give_the_synchronous_tokens_and_logprobs(model):
    """Seeded and unseeded (engine generator) samples with penalties and logprobs: the async engine
    draws the same noise for the same rows, so its tokens equal the synchronous engine's exactly."""
    vocab = model.config.text.vocab_size
    reqs = {}
    for i, p in enumerate(prompts(vocab, 6, seed=2)):
        reqs[f"s{i}"] = (p, SamplingParams(temperature=0.9, top_p=0.9, max_tokens=7 + i, seed=i if i % 2 else None,
                                           presence_penalty=0.5 * (i % 3 == 0), logprobs=2,
                                           stop_token_ids=[7] if i == 4 else []))
    sync, asyn = engines(model)
    ahead = count_calls(asyn.scheduler, "schedule_ahead")
    a, b = run(sync, reqs), run(asyn, reqs)
    assert ahead.hits > 5
    for rid in reqs:
        assert b[rid][0][0] == a[rid][0][0] and b[rid][0][1] == a[rid][0][1], rid
        # logprobs: the same tokens, values to float32 rounding (an ahead step may carry one more row
        # than the synchronous step, for a request its in-flight token ends, and matmuls round by shape)
        for la, lb in zip(a[rid][0][2], b[rid][0][2]):
            assert list(la) == list(lb) and all(abs(la[t] - lb[t]) < 1e-4 for t in la), rid


def test_abort_while_in_flight(model):
    """An abort lands while the request's step is in flight: that step's token never reaches it, its
    final delta says abort, and the others continue exactly."""
    vocab = model.config.text.vocab_size
    ps = prompts(vocab, 3, seed=3)
    _, engine = engines(model)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    got: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}

    def step():
        for d in engine.step():
            got.setdefault(d.request_id, []).extend(d.outputs[0].token_ids)
            reasons[d.request_id] = d.outputs[0].finish_reason
    while len(got.get("r1", [])) < 3 or engine.pipeline.in_flight is None:
        step()
    before = len(got["r1"])
    engine.abort_request("r1")
    while engine.has_unfinished_requests():
        step()
    assert reasons["r1"] == "abort" and len(got["r1"]) == before
    assert got["r1"] == reference_greedy(model, ps[1], before)
    for rid in ("r0", "r2"):
        assert got[rid] == reference_greedy(model, ps[int(rid[1])], 10), rid
    assert engine.kv.blocks.num_free == engine.plan.num_usable_blocks


def test_constrained_requests_give_the_synchronous_tokens(tiny_ckpt):
    llm = kimik3.LLM(kimik3.DEFAULT_MODEL, max_num_seqs=8, max_model_len=256)
    tok = llm.engine.get_tokenizer()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "w": {"enum": ["a", "bb"]}},
              "required": ["n", "w"], "additionalProperties": False}
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=60,
                             structured_outputs=StructuredOutputsParams(json=schema)) for i in range(6)]
    prompts_ = [f"give {i}" for i in range(6)]
    sync = [o.outputs[0] for o in llm.generate(prompts_, params, use_tqdm=False)]
    turn_async(llm.engine)
    ahead = count_calls(llm.engine.scheduler, "schedule_ahead")
    asyn = [o.outputs[0] for o in llm.generate(prompts_, params, use_tqdm=False)]
    assert ahead.hits > 5
    import json
    for s, a in zip(sync, asyn):
        assert a.token_ids == s.token_ids and a.finish_reason == s.finish_reason == "stop"
        assert set(json.loads(tok.decode(a.token_ids))) == {"n", "w"}


def test_every_request_option_gives_the_synchronous_outputs():
    """Async scheduling is the default on a GPU, so each request option must give the synchronous
    engine's outputs under it (text, tokens, finish reasons, logprobs), side by side in one batch:
    stop strings (kept or cut), min_tokens, bad_words, logit_bias, allowed_token_ids, n = 2 samples,
    prompt_logprobs, penalties, seeded and greedy rows, and requests arriving mid-run."""
    llm = kimik3.LLM(kimik3.DEFAULT_MODEL, max_num_seqs=6, max_model_len=256)
    tok = llm.engine.get_tokenizer()
    story = "Once upon a time there was a little"
    common = dict(max_tokens=24, ignore_eos=True)
    options = [
        SamplingParams(temperature=0, stop=[" the", "."], **common),
        SamplingParams(temperature=0, stop=[" the"], include_stop_str_in_output=True, **common),
        SamplingParams(temperature=0.8, seed=3, min_tokens=10, stop=[" a"], **common),
        SamplingParams(temperature=0, bad_words=[" the", " a"], logprobs=3, **common),
        SamplingParams(temperature=0.9, seed=5, logit_bias={tok.encode(" dog")[0]: 8.0}, **common),
        SamplingParams(temperature=1.0, seed=7, allowed_token_ids=tok.encode(" cat dog sat on the mat"), **common),
        SamplingParams(temperature=0.8, seed=11, n=2, presence_penalty=0.8, frequency_penalty=0.3, **common),
        SamplingParams(temperature=0, prompt_logprobs=2, repetition_penalty=1.3, **common),
    ]
    prompts_ = [f"{story} {w}" for w in ("girl", "boy", "cat", "dog", "king", "bird", "fox", "tree")]

    def outputs():
        got, step = {}, 0
        while step < 4 or llm.engine.has_unfinished_requests():
            for i in range(len(options)) if step in (0, 3) else ():     # half of them arrive mid-run
                if (i % 2 == 0) == (step == 0):
                    llm.engine.add_request(f"q{i}", prompts_[i], options[i])
            for d in llm.engine.step():
                for c in d.outputs:
                    acc = got.setdefault((d.request_id, c.index), {"ids": [], "text": "", "lps": [], "prompt": None})
                    acc["ids"] += c.token_ids
                    acc["text"] += c.text
                    acc["lps"] += c.logprobs or []
                    acc["reason"] = c.finish_reason
                if d.prompt_logprobs is not None:
                    got[(d.request_id, 0)]["prompt"] = d.prompt_logprobs
            step += 1
        return got
    sync = outputs()
    turn_async(llm.engine)
    ahead = count_calls(llm.engine.scheduler, "schedule_ahead")
    asyn = outputs()
    assert ahead.hits > 5 and set(asyn) == set(sync) and len(sync) == len(options) + 1
    for key, s in sync.items():
        a = asyn[key]
        assert (a["ids"], a["text"], a["reason"]) == (s["ids"], s["text"], s["reason"]), key
        for la, ls in zip(a["lps"], s["lps"]):
            assert list(la) == list(ls) and all(abs(la[t] - ls[t]) < 1e-4 for t in la), key
        assert (a["prompt"] is None) == (s["prompt"] is None), key
        for pa, ps in zip(a["prompt"] or [], s["prompt"] or []):
            assert (pa is None and ps is None) or (list(pa) == list(ps) and all(abs(pa[t] - ps[t]) < 1e-4 for t in pa))
    assert sync[("q7", 0)]["prompt"] is not None and len(sync[("q3", 0)]["lps"]) == 24
    assert sync[("q1", 0)]["text"].endswith(" the") and not sync[("q0", 0)]["text"].endswith((" the", "."))
    assert len(sync[("q2", 0)]["ids"]) >= 10


def test_a_failed_step_ahead_is_raised_after_the_step_before_it(model, monkeypatch):
    vocab = model.config.text.vocab_size
    reqs = {f"r{i}": (p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
            for i, p in enumerate(prompts(vocab, 2, seed=4))}
    _, engine = engines(model)
    launch = engine.runner.launch
    at_failure: dict[str, int] = {}

    def failing(out, input_ids=None):
        if input_ids is not None and out.chunks[0].req.num_output_tokens >= 2:
            at_failure.update((c.req.group_id, c.req.num_output_tokens) for c in out.chunks)
            raise RuntimeError("boom")
        return launch(out, input_ids)
    monkeypatch.setattr(engine.runner, "launch", failing)
    for rid, (p, sp) in reqs.items():
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
    got: dict[str, list[int]] = {}
    for _ in range(50):
        for d in engine.step():
            got.setdefault(d.request_id, []).extend(d.outputs[0].token_ids)
        if at_failure:
            break
    engine.abort_request("r0")           # lands while the failure waits to be raised
    with pytest.raises(StepError, match="boom") as err:
        engine.step()
    assert sorted(err.value.request_ids) == ["r0", "r1"]
    engine.abort_request("r1")           # the server's answer to a StepError: abort the requests it names
    finals = {d.request_id: d.outputs[0].finish_reason for d in engine.step()}
    assert finals == {"r0": "abort", "r1": "abort"} and not engine.has_unfinished_requests()   # r0's kept
    for rid, (p, _) in reqs.items():       # the in-flight step's tokens arrived too, and they are right
        assert len(got[rid]) == at_failure[rid] + 1 and got[rid] == reference_greedy(model, p, len(got[rid])), rid


def test_speculation_with_async_scheduling_gives_the_synchronous_tokens(model, monkeypatch):
    """n-gram speculation under async scheduling: drafts are verified in synchronous steps and in steps run
    ahead; a request whose drafts keep failing pauses drafting. Drafts come from a proposer that knows the
    greedy requests' continuations and corrupts every other one (``helpers.oracle_proposer``). Greedy
    (drafting) tokens equal the model's own decoding; seeded requests with penalties (which never draft) in
    the same batches the synchronous engine's."""
    import kimik3.engine.spec.ngram as ngram
    vocab = model.config.text.vocab_size
    rng = random.Random(5)
    reqs = {}
    for i in range(2):
        p = [rng.randrange(5, vocab) for _ in range(6 + 8 * i)]
        reqs[f"g{i}"] = (p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        reqs[f"s{i}"] = (p, SamplingParams(temperature=0.9, seed=i, presence_penalty=0.3, max_tokens=24,
                                           ignore_eos=True))     # penalties: no drafts, samples fixed by seed
    futures = {tuple(p): reference_greedy(model, p, 24) for rid, (p, _) in reqs.items() if rid.startswith("g")}
    monkeypatch.setattr(ngram, "propose_ngram", oracle_proposer(futures, vocab))
    kw = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=48, extra_blocks=40,
              num_speculative_tokens=3, speculative_ngram_min=1, speculative_ngram_max=2)
    sync, asyn = make_engine(model, **kw), make_engine(model, async_scheduling=True, **kw)
    ahead = count_calls(asyn.scheduler, "schedule_ahead")
    a, b = run(sync, reqs), run(asyn, reqs)
    for rid, (p, params) in reqs.items():
        if rid.startswith("g"):
            assert b[rid][0][0] == reference_greedy(model, p, params.max_tokens), rid
        assert b[rid][0][0] == a[rid][0][0], rid
    assert asyn.num_draft_tokens > 0 and ahead.hits > 5        # drafts verified, and steps ran ahead
    assert not asyn.has_unfinished_requests() and asyn.kv.blocks.num_free == asyn.plan.num_usable_blocks


def record_drafted_ahead(engine) -> list:
    """Wraps ``engine.scheduler.schedule_ahead``; returns the list it fills with every chunk scheduled ahead
    with drafts (``Scheduler._draft_ahead``)."""
    drafted, schedule_ahead = [], engine.scheduler.schedule_ahead

    def record(prev):
        out = schedule_ahead(prev)
        drafted.extend(c for c in (out.chunks if out else []) if c.draft)
        return out
    engine.scheduler.schedule_ahead = record
    return drafted


def test_drafts_proposed_ahead_of_the_previous_token_keep_the_models_tokens(model, monkeypatch):
    """Under async scheduling a request due to draft drafts before its previous token reaches the host: the
    lookup on the tokens before it proposes its successor and the drafts after that (``Scheduler._draft_ahead``),
    and the step runs ahead verifying them. A proposer that knows each request's continuation gives right and
    wrong drafts, one wrong lookup in four (a miss makes the request watch its next predictions, so steps run
    ahead, and after two right ones it drafts ahead again); a stop token ends
    one request. Tokens equal the model's greedy decoding; drafts made ahead were accepted and rejected;
    every snapshot slot and block goes back."""
    import kimik3.engine.spec.ngram as ngram
    vocab = model.config.text.vocab_size
    rng = random.Random(11)
    reqs = {}
    for i in range(3):
        p = [rng.randrange(5, vocab) for _ in range(5 + i)]
        ref = reference_greedy(model, p, 24)
        stop = [ref[17]] if i == 1 and ref[17] not in ref[:17] else []
        reqs[f"g{i}"] = (p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=stop))
    futures = {tuple(p): reference_greedy(model, p, 24) for p, _ in reqs.values()}
    calls: dict[tuple[int, ...], int] = {}

    def propose(token_ids, k, min_n, max_n, data=None, follow=1):
        prompt = next(p for p in futures if tuple(token_ids[:len(p)]) == p)
        done = len(token_ids) - len(prompt)
        i = calls[prompt] = calls.get(prompt, -1) + 1
        right = i % 4 != 0                                  # wrong, right, right, right, wrong .. per request
        return [t if right else (t + 1) % vocab for t in futures[prompt][done:done + k]]
    monkeypatch.setattr(ngram, "propose_ngram", propose)
    kw = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, extra_blocks=40,
              num_speculative_tokens=3, async_scheduling=True, enable_prefix_caching=False)
    engine = make_engine(model, **kw)
    drafted_ahead = record_drafted_ahead(engine)
    out = run(engine, reqs)
    for rid, (p, params) in reqs.items():
        ref = futures[tuple(p)]
        stop = params.stop_token_ids
        assert out[rid][0][0] == (ref[:ref.index(stop[0]) + 1] if stop else ref), rid
    accepted = [c.num_accepted for c in drafted_ahead]
    assert any(accepted) and not all(accepted), accepted
    assert not engine.has_unfinished_requests() and engine.kv.blocks.num_free == engine.plan.num_usable_blocks
    assert len(engine.kv.free_spec_slots) == engine.plan.num_spec_slots


def test_constrained_requests_wait_for_the_previous_token_only_where_a_draft_could_follow(monkeypatch):
    """A request with a grammar cannot draft ahead (its matcher has not seen the previous token): its step
    waits for that token, unless no draft can follow whatever it is (``ngram.may_propose_after``), when
    the step runs ahead. More steps run ahead than with that check off; the tokens are the synchronous ones."""
    from kimik3.engine.spec import ngram
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "w": {"enum": ["a", "bb"]}},
              "required": ["n", "w"], "additionalProperties": False}
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema))
              for _ in range(4)]
    prompts_ = [f"give {i}" for i in range(4)]
    llm = kimik3.LLM(kimik3.DEFAULT_MODEL, max_num_seqs=8, max_model_len=256, num_speculative_tokens=2)
    sync = [o.outputs[0].token_ids for o in llm.generate(prompts_, params, use_tqdm=False)]
    turn_async(llm.engine)
    hits = []
    for check in (True, False):
        if not check:
            monkeypatch.setattr(ngram, "may_propose_after", lambda *a: True)
        ahead = count_calls(llm.engine.scheduler, "schedule_ahead")
        assert [o.outputs[0].token_ids for o in llm.generate(prompts_, params, use_tqdm=False)] == sync, check
        hits.append(ahead.hits)
    assert hits[0] > hits[1], hits


def test_a_watching_request_with_a_grammar_does_not_wait_for_the_previous_token(model, monkeypatch):
    """Drafting ahead, a request with a grammar waits for its previous token t (its matcher must see t before
    drafts); watching after a failed verify it drafts nothing, so it only records the lookup's guess of t as its
    prediction and its step runs ahead. Two right predictions end the watch: the next lookup waits for t again."""
    import kimik3.engine.spec.ngram as ngram
    from kimik3.engine.core.request import Request
    engine = make_engine(model, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64,
                         extra_blocks=8, num_speculative_tokens=2, async_scheduling=True)
    req = Request("r", [5, 6, 7, 5, 6], SamplingParams(temperature=0, max_tokens=20), arrival=0.0)
    req.matcher = object()                             # any grammar: only its presence matters here
    guesses = iter([9, 11, 12, 13])
    monkeypatch.setattr(ngram, "propose_ngram", lambda *a, **k: [next(guesses), 1, 2])
    draft_ahead = engine.scheduler._draft_ahead
    assert draft_ahead(req, 64) is None                # drafting: wait for t (min_n 1: a draft may follow)
    state = req.spec                                   # the n-gram drafter's state of the request
    state.misses = 1                                   # its last verify accepted nothing: watching
    assert draft_ahead(req, 64) == [] and state.watch == (5, 9)
    req.append_token(9)                                # t came as predicted: one hit
    assert draft_ahead(req, 64) == [] and state.watch == (6, 11) and state.streak == 1
    req.append_token(11)                               # a second hit ends the watch
    assert draft_ahead(req, 64) is None and state.misses == 0


@pytest.mark.parametrize("flags, device, expected", [
    ([], "cuda", True),                                     # vLLM's default: on where it works
    ([], "cpu", False),                                     # nothing to overlap on a CPU
    (["--num-speculative-tokens", "2"], "cuda", True),      # speculation runs async too
    (["-tp", "2"], "cuda", False),
    (["--enable-expert-parallel"], "cuda", False),
    (["--no-async-scheduling"], "cuda", False),
    (["--async-scheduling"], "cpu", True),
])
def test_async_scheduling_is_on_by_default_where_it_works(flags, device, expected):
    """The flag's default (None) resolves per device and setting; a given flag always wins."""
    import argparse

    from kimik3.engine.args import EngineArgs
    from kimik3.engine.flags import add_engine_args
    ns = add_engine_args(argparse.ArgumentParser()).parse_args(flags)
    args = EngineArgs(**{k: v for k, v in vars(ns).items() if k in EngineArgs.__dataclass_fields__})
    assert args.resolve_async_scheduling(torch.device(device)) is expected
    assert args.engine_config(64, torch.device(device)).async_scheduling is expected


@pytest.mark.parametrize("n", [1, 3], ids=["one_request", "three_requests"])
def test_steps_launched_past_an_expected_rejection_keep_the_models_tokens(model, monkeypatch, n):
    """A verify step whose drafts are expected to fail is followed at once by the step that assumes they fail
    (``Scheduler.schedule_past_rejection``): drafted ahead on a successor guess that proved wrong, or drafted
    after a miss. Drafts come from a proposer that knows each request's continuation and corrupts it on a
    pattern, the guess apart from the drafts: such steps meet rejections (the step kept), accepted drafts
    (dropped) and, with three requests, both at once (partly kept), after drafting ahead and after drafting
    on the host. Every token equals the model's own greedy decoding; every snapshot slot and block goes back."""
    import kimik3.engine.spec.ngram as ngram
    # one request: after a miss it watches until one prediction comes true, so plain steps run ahead after a
    # kept one, from its snapshot; three: no watching, so the requests draft in step, and on the host right
    # after a miss
    monkeypatch.setattr(ngram, "WATCH_HITS", 1 if n == 1 else 0)
    vocab = model.config.text.vocab_size
    rng = random.Random(7)
    reqs = {f"r{i}": ([rng.randrange(5, vocab) for _ in range(6 + i)],
                      SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)) for i in range(n)}
    futures = {tuple(p): reference_greedy(model, p, 40) for p, _ in reqs.values()}
    calls: dict[tuple[int, ...], int] = {}
    # per lookup: W all wrong; R all right; G the guess of a lookup ahead wrong, the drafts right; D the guess
    # right, the drafts wrong (no step past it; the next lookup, on the host after a miss, has one); M: G for
    # the second request, W for the others. One request: a lookup right after a right prediction (D, R) drafts
    pattern = "WGWDWMWDR" if n > 1 else "WDGWDWR"

    def propose(token_ids, k, min_n, max_n, data=None, follow=1):
        prompt = next(p for p in futures if tuple(token_ids[:len(p)]) == p)
        done = len(token_ids) - len(prompt)
        i = calls[prompt] = calls.get(prompt, -1) + 1
        kind = pattern[i % len(pattern)]
        if kind == "M":
            kind = "G" if list(futures).index(prompt) == 1 else "W"
        tokens = futures[prompt][done:done + k]
        right = [kind in "RG"] * len(tokens)
        if follow == 2 and kind in "GD":         # tokens[0] is the guess
            right[0] = kind == "D"
        return [t if ok else (t + 1) % vocab for t, ok in zip(tokens, right)]
    monkeypatch.setattr(ngram, "propose_ngram", propose)
    kw = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, extra_blocks=40,
              num_speculative_tokens=2, async_scheduling=True, enable_prefix_caching=False)   # (no draft cut at a checkpoint)
    engine = make_engine(model, **kw)
    outcomes = []
    verify_past = engine.pipeline._verify_past_rejection

    def record(verify, after, touched, logits=None):
        verify_past(verify, after, touched, logits)
        accepted = [c.num_accepted > 0 for c in verify.chunks]
        outcome = "kept" if not any(accepted) else "dropped" if all(accepted) else "partly"
        outcomes.append((outcome, "ahead" if logits is not None else "host"))
        assert (engine.pipeline.in_flight is not None) == (outcome == "kept")
    monkeypatch.setattr(engine.pipeline, "_verify_past_rejection", record)
    out = run(engine, reqs)
    for rid, (p, params) in reqs.items():
        assert out[rid][0][0] == futures[tuple(p)], rid
    want = {("kept", "ahead"), ("dropped", "ahead")} | ({("partly", "ahead"), ("kept", "host")} if n > 1 else set())
    assert want <= set(outcomes), outcomes
    assert not engine.has_unfinished_requests() and engine.kv.blocks.num_free == engine.plan.num_usable_blocks
    assert len(engine.kv.free_spec_slots) == engine.plan.num_spec_slots


def test_requests_ended_by_the_token_in_flight_give_back_their_drafted_ahead_slots(model, monkeypatch):
    """A step drafted ahead for a request that the in-flight step's token then ends (a stop token) is dropped
    for it; its snapshot slots go back (with other requests kept in the step, or none). Stop tokens swept
    over positions of one request among three, drafting every step (no watching, drafts always wrong, so steps
    past each rejection run and the next lookups are made ahead)."""
    import kimik3.engine.spec.ngram as ngram
    monkeypatch.setattr(ngram, "WATCH_HITS", 0)
    vocab = model.config.text.vocab_size
    rng = random.Random(3)
    prompts_ = [[rng.randrange(5, vocab) for _ in range(6 + i)] for i in range(3)]
    futures = {tuple(p): reference_greedy(model, p, 24) for p in prompts_}

    def propose(token_ids, k, min_n, max_n, data=None, follow=1):
        prompt = next(p for p in futures if tuple(token_ids[:len(p)]) == p)
        done = len(token_ids) - len(prompt)
        return [(t + 1) % vocab for t in futures[prompt][done:done + k]]
    monkeypatch.setattr(ngram, "propose_ngram", propose)
    kw = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, extra_blocks=40,
              num_speculative_tokens=2, async_scheduling=True, enable_prefix_caching=False)
    hits = 0
    first = futures[tuple(prompts_[0])]
    for pos in [i for i in range(4, 20) if first[i] not in first[:i]]:
        reqs = {f"r{i}": (p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                            stop_token_ids=[first[pos]] if i == 0 else []))
                for i, p in enumerate(prompts_)}
        engine = make_engine(model, **kw)
        drafted = record_drafted_ahead(engine)
        out = run(engine, reqs)
        for rid, (p, params) in reqs.items():
            want = futures[tuple(p)]
            assert out[rid][0][0] == (want[:pos + 1] if rid == "r0" else want), (pos, rid)
        hits += any(c.req.request_id == "r0" and c.start == len(prompts_[0]) + pos for c in drafted)
        assert not engine.has_unfinished_requests() and engine.kv.blocks.num_free == engine.plan.num_usable_blocks
        assert len(engine.kv.free_spec_slots) == engine.plan.num_spec_slots, pos
    assert hits, "no step was drafted ahead for a request its in-flight token ended"


@pytest.mark.parametrize("fail", ["after", "verify_sample"])
def test_a_failure_around_a_step_past_rejection_is_raised_next_and_frees_its_slots(model, monkeypatch, fail):
    """The step launched past an expected rejection, or the sampling of the verify step before it (drafted
    ahead), fails: the tokens committed in that call are delivered first, the StepError comes from the next
    ``step`` naming the request, and once it is aborted every snapshot slot and block is back."""
    import kimik3.engine.spec.ngram as ngram
    vocab = model.config.text.vocab_size
    p = random.Random(9).sample(range(5, vocab), 8)
    future = reference_greedy(model, p, 40)

    def propose(token_ids, k, min_n, max_n, data=None, follow=1):      # every token wrong, the guess too
        return [(t + 1) % vocab for t in future[len(token_ids) - len(p):len(token_ids) - len(p) + k]]
    monkeypatch.setattr(ngram, "propose_ngram", propose)
    engine = make_engine(model, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64,
                         extra_blocks=40, num_speculative_tokens=2, async_scheduling=True, enable_prefix_caching=False)
    failed = []
    if fail == "after":
        launch = engine.runner.launch

        def failing(out, input_ids=None):
            if not failed and any(c.state_slot is not None for c in out.chunks):
                failed.append(True)
                raise RuntimeError("boom")
            return launch(out, input_ids)
        monkeypatch.setattr(engine.runner, "launch", failing)
    else:
        sample = engine.runner.sample

        def failing(out, logits, greedy=None):
            if not failed and greedy is not None:
                failed.append(True)
                raise RuntimeError("boom")
            return sample(out, logits, greedy)
        monkeypatch.setattr(engine.runner, "sample", failing)
    engine.add_request("r0", {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    got = []
    with pytest.raises(StepError, match="boom") as err:
        for _ in range(100):
            for d in engine.step():
                got.extend(d.outputs[0].token_ids)
    assert failed and err.value.request_ids == ["r0"]
    assert got and got == future[:len(got)]                     # what came before the failure is right
    engine.abort_request("r0")
    assert [d.outputs[0].finish_reason for d in engine.step()] == ["abort"]
    assert not engine.has_unfinished_requests() and engine.kv.blocks.num_free == engine.plan.num_usable_blocks
    assert len(engine.kv.free_spec_slots) == engine.plan.num_spec_slots
