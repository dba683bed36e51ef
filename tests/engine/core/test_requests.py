"""Bad requests fail at add time with clear errors and leave running requests alone; text, stop
strings and stop tokens; SamplingParams validation."""

from __future__ import annotations

import pytest

from kimik3.engine import SamplingParams
from tests.engine.fake_model import FakeModel, reference_greedy
from tests.engine.helpers import make_engine, run

FIRST = ord("A")


class CharTokenizer:
    """Token i <-> chr(65 + i); a streaming detokenizer like the real tokenizer's."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) - FIRST for c in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(FIRST + i) for i in ids)

    def detokenizer(self, skip_special_tokens: bool = False):
        tok = self

        class Stream:
            def feed(self, ids):
                return tok.decode(ids)

            def finish(self):
                return ""
        return Stream()


@pytest.mark.parametrize("prompt,params,match", [
    ({"prompt_token_ids": []}, SamplingParams(), "prompt is empty"),
    ({"prompt_token_ids": list(range(21))}, SamplingParams(), "more than max_model_len=20"),
    ({"prompt_token_ids": [1, 99]}, SamplingParams(), r"outside the vocabulary \[0, 61\)"),
    ({"prompt_token_ids": [1, 2]}, SamplingParams(stop_token_ids=[3, 61]), r"stop_token_ids \[61\]"),
    ({"prompt_token_ids": "abc"}, SamplingParams(), "must be a list of ints"),
    ([1, 2, 3], SamplingParams(), "a prompt is a string or"),
    ({"prompt_token_ids": [1]}, SamplingParams(stop=["x"], detokenize=False), "need detokenize=True"),
], ids=["empty", "too-long", "bad-token", "bad-stop-id", "ids-not-list", "bare-list", "stop-no-detok"])
def test_bad_requests_leave_running_requests_alone(prompt, params, match):
    model = FakeModel()
    engine = make_engine(model, max_model_len=20, extra_blocks=4, tokenizer=CharTokenizer())
    good = SamplingParams(temperature=0, max_tokens=6)
    engine.add_request("ok", {"prompt_token_ids": [3, 4, 5]}, good)
    tokens = engine.step()[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, params)
    while engine.has_unfinished_requests():
        for d in engine.step():
            assert d.request_id == "ok"
            tokens += d.outputs[0].token_ids
    assert engine.scheduler.waiting == type(engine.scheduler.waiting)()
    assert tokens == reference_greedy(model, [3, 4, 5], 6)


def test_duplicate_request_id():
    engine = make_engine(FakeModel(), max_model_len=20, extra_blocks=4)
    engine.add_request("a", {"prompt_token_ids": [1]})
    with pytest.raises(ValueError, match="'a' is already in use"):
        engine.add_request("a", {"prompt_token_ids": [1]})


def test_no_tokenizer_string_prompt_error():
    engine = make_engine(FakeModel(), max_model_len=20, extra_blocks=4)
    engine._tokenizer_path = "/nonexistent"
    with pytest.raises(ValueError, match="needs a tokenizer"):
        engine.add_request("a", "hello")
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(max_tokens=-3), "max_tokens must be an integer >= 1"),
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must lie in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must lie in \(0, 1\]"),
    (dict(top_k=-2), "top_k must be -1, 0 or a positive integer"),
    (dict(min_p=1.5), r"min_p must lie in \[0, 1\]"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(n=0), "n must be an integer >= 1"),
    (dict(logprobs=-1), "logprobs must be None or an integer >= 0"),
    (dict(stop=["ok", ""]), "stop must hold non-empty strings"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be non-negative"),
    (dict(seed="x"), "seed must be an integer"),
])
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_text_and_stop_string():
    model = FakeModel()
    tok = CharTokenizer()
    prompt = [3, 4, 5]
    ref = reference_greedy(model, prompt, 12)
    text = tok.decode(ref)
    stop = text[4:6]
    cut = text.find(stop)
    engine = make_engine(model, max_model_len=32, extra_blocks=4, tokenizer=tok)
    engine.add_request("s", tok.decode(prompt), SamplingParams(temperature=0, max_tokens=12, stop=[stop, "~~~"]))
    engine.add_request("t", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[ref[3]]))
    got = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            acc = got.setdefault(d.request_id, {"text": "", "ids": []})
            c = d.outputs[0]
            acc["text"] += c.text
            acc["ids"] += c.token_ids
            acc["reason"], acc["stop_reason"] = c.finish_reason, c.stop_reason
    assert got["s"]["text"] == text[:cut] and got["s"]["reason"] == "stop" and got["s"]["stop_reason"] == stop
    assert got["s"]["ids"] == ref[:cut + len(stop)]
    first = ref.index(ref[3])
    assert got["t"]["ids"] == ref[:first + 1] and got["t"]["stop_reason"] == ref[3]
    assert got["t"]["text"] == text[:first]        # a stop token is kept in token_ids, not in the text (vLLM)


def test_eos_stops_unless_ignored():
    model = FakeModel()
    ref = reference_greedy(model, [1, 2], 10)
    eos = ref[2]
    model = FakeModel(eos_token_id=eos)
    out = run(make_engine(model, max_model_len=32, extra_blocks=2), {
        "stop": ([1, 2], SamplingParams(temperature=0, max_tokens=10)),
        "go": ([1, 2], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))})
    assert out["stop"][0][0] == ref[:ref.index(eos) + 1] and out["stop"][0][1] == "stop"
    assert out["go"][0][0] == ref and out["go"][0][1] == "length"


def test_a_failed_step_returns_its_checkpoint_slots():
    """If the model raises, the KDA checkpoint slots taken for that step go back to the pool."""
    model = FakeModel()
    engine = make_engine(model, max_model_len=40, block_size=2, max_num_seqs=2, extra_blocks=8)
    free_before = len(engine.kv.free_checkpoint_slots)
    engine.add_request("a", {"prompt_token_ids": list(range(1, 12))}, SamplingParams(max_tokens=2))
    real = engine.runner.execute

    def boom(out):
        assert out.checkpoints, "the step should ask for checkpoints"
        raise RuntimeError("device fault")
    engine.runner.execute = boom
    with pytest.raises(RuntimeError, match="device fault"):
        engine.step()
    assert len(engine.kv.free_checkpoint_slots) == free_before
    engine.runner.execute = real
    engine.abort_request("a")
    engine.step()
    assert not engine.has_unfinished_requests()


def _collect(engine, got: dict) -> None:
    for d in engine.step():
        for c in d.outputs:
            got.setdefault((d.request_id, c.index), []).extend(c.token_ids)


def _solo(model, requests: dict) -> dict:
    engine = make_engine(model, max_model_len=40, max_num_seqs=4, extra_blocks=12)
    for rid, (ids, p) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": ids}, p)
    got: dict = {}
    while engine.has_unfinished_requests():
        _collect(engine, got)
    return got


RUNNING = {"greedy": ([3, 4, 5], SamplingParams(temperature=0, max_tokens=8)),
           "seeded": ([6, 7], SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=8))}


@pytest.mark.parametrize("how", ["seed-overflow", "seed-mutated", "late-failure"])
def test_failed_add_leaves_nothing_and_running_requests_match_a_solo_run(how, monkeypatch):
    """n=2 with seed 2^64 - 1 overflows at sample 1: nothing of the request may stay queued (it used to
    leave sample 0 orphaned, and every later step raised KeyError)."""
    model = FakeModel()
    want = _solo(model, RUNNING)
    engine = make_engine(model, max_model_len=40, max_num_seqs=4, extra_blocks=12)
    for rid, (ids, p) in RUNNING.items():
        engine.add_request(rid, {"prompt_token_ids": ids}, p)
    got: dict = {}
    _collect(engine, got)
    waiting, running, groups = list(engine.scheduler.waiting), list(engine.scheduler.running), dict(engine.groups)
    if how == "seed-overflow":
        with pytest.raises(ValueError, match=r"seed must lie in \[0, 2\^64 - n\]"):
            engine.add_request("bad", {"prompt_token_ids": [1, 2]}, SamplingParams(n=2, seed=2**64 - 1))
    elif how == "seed-mutated":               # fields changed after the params were validated
        p = SamplingParams(n=2, seed=1)
        p.seed = 2**64 - 1
        with pytest.raises(ValueError, match="seed must lie in"):
            engine.add_request("bad", {"prompt_token_ids": [1, 2]}, p)
    else:                                     # any failure while building sample 1
        import kimik3.engine.core.input_processor as ip
        calls = []

        def failing(*a, **kw):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("boom")
            return real(*a, **kw)
        real = ip.OutputText
        monkeypatch.setattr(ip, "OutputText", failing)
        engine.inputs._tokenizer = CharTokenizer()
        with pytest.raises(RuntimeError, match="boom"):
            engine.add_request("bad", {"prompt_token_ids": [1, 2]}, SamplingParams(n=2))
    assert list(engine.scheduler.waiting) == waiting and list(engine.scheduler.running) == running
    assert engine.groups == groups
    while engine.has_unfinished_requests():
        _collect(engine, got)
    assert got == want and all(len(v) == 8 for v in got.values())


def test_seed_range_edges():
    SamplingParams(n=2, seed=2**64 - 2)
    SamplingParams(seed=0)
    for n, seed in [(1, 2**64), (2, 2**64 - 1), (1, -1)]:
        with pytest.raises(ValueError, match="seed must lie in"):
            SamplingParams(n=n, seed=seed)


def test_a_sequence_without_a_group_never_fails_a_step():
    from kimik3.engine.core.request import Request
    model = FakeModel()
    want = _solo(model, RUNNING)
    engine = make_engine(model, max_model_len=40, max_num_seqs=4, extra_blocks=12)
    for rid, (ids, p) in RUNNING.items():
        engine.add_request(rid, {"prompt_token_ids": ids}, p)
    ghost = Request("ghost", [1, 2, 3], SamplingParams(temperature=0, max_tokens=50), 0.0, block_size=4,
                    group_id="ghost")
    engine.scheduler.add(ghost)
    got: dict = {}
    while engine.has_unfinished_requests():
        _collect(engine, got)
    assert got == want and ghost.is_finished
    assert engine.kv.blocks.num_free == engine.kv.plan.num_usable_blocks


def test_a_failed_step_names_the_requests_of_its_batch():
    from kimik3.engine.core.llm_engine import StepError
    engine = make_engine(FakeModel(), max_model_len=40, max_num_seqs=1, extra_blocks=8)
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4))
    engine.add_request("b", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, n=2))
    real = engine.runner.execute
    engine.runner.execute = lambda out: (_ for _ in ()).throw(RuntimeError("device fault"))
    with pytest.raises(StepError) as e:
        engine.step()
    assert e.value.request_ids == ["a"]          # max_num_seqs=1: only "a" was in the batch
    engine.runner.execute = real
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("stop", [None, ["vD"]], ids=["no-stop-string", "stop-string"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_final_only_gives_one_delta_equal_to_the_streamed_ones(stop, async_scheduling):
    """A ``final_only`` request (as LLM.generate adds them) gets no delta until it finishes, then one holding
    every sample's tokens, text, finish and stop reasons: what the deltas of the same request streamed add up to
    (n = 2 samples, a stop token for one, a stop string or the length limit)."""
    from tests.engine.helpers import turn_async
    prompt = [3, 4, 5, 6, 7]
    # sampled, seeded: sample 0 "ZbUvDlUSl" (ends on the stop string, or its length), sample 1 "[nhy{J..." (stop id 9)
    params = SamplingParams(temperature=1.0, max_tokens=9, n=2, seed=1, stop=stop, stop_token_ids=[9])
    got = {}
    for final_only in (False, True):
        engine = make_engine(FakeModel(), max_model_len=32, extra_blocks=8, tokenizer=CharTokenizer())
        if async_scheduling:
            turn_async(engine)
        engine.add_request("r", {"prompt_token_ids": prompt}, params, final_only=final_only)
        deltas = []
        while engine.has_unfinished_requests():
            deltas += engine.step()
        got[final_only] = deltas
    streamed, final = got[False], got[True]
    assert len(final) == 1 and final[0].finished and len(streamed) > 1
    for i in range(2):
        pieces = [c for d in streamed for c in d.outputs if c.index == i]
        (one,) = [c for c in final[0].outputs if c.index == i]
        assert one.token_ids == [t for c in pieces for t in c.token_ids]
        assert one.text == "".join(c.text for c in pieces)
        assert (one.finish_reason, one.stop_reason) == (pieces[-1].finish_reason, pieces[-1].stop_reason)
    ends = {c.index: (c.finish_reason, c.stop_reason, c.text) for c in final[0].outputs}
    assert ends == {0: ("stop", "vD", "ZbU") if stop else ("length", None, "ZbUvDlUSl"), 1: ("stop", 9, "[nhy{")}
    assert final[0].metrics.keys() == streamed[-1].metrics.keys()


def test_decode_chunk_is_the_dataclass_chunk():
    """``ScheduledChunk.decode`` (built field by field for speed) equals the dataclass's own construction."""
    from kimik3.engine.core.request import Request
    from kimik3.engine.core.scheduler_output import ScheduledChunk
    req = Request("r", [1, 2, 3], SamplingParams(), 0.0)
    for start in (3, 2):         # its pending token (samples) / a chunk short of it (does not)
        assert ScheduledChunk.decode(req, start) == ScheduledChunk(req, 1, start, input_pending=True)
