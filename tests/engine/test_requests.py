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
