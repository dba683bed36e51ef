"""Structured outputs and honest request fields on the server, with the ``openai`` client and raw httpx,
on the embedded tiny K3 (random weights): every structured mode returns schema-valid output."""

from __future__ import annotations

import argparse
import json
import re

import httpx
import jsonschema
import openai
import pytest

import kimik3
from kimik3.engine.sample.sampling_params import StructuredOutputsParams as SO
from kimik3.engine.sample.structured import GrammarCompiler
from kimik3.serve import add_serve_arguments, build_app
from kimik3.serve.structured import closed_schema, k3_answer_grammar
from tests.serve.conftest import LiveServer

M = "tiny-k3"
OFF = {"chat_template_kwargs": {"thinking": False}}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "s": {"type": "string", "maxLength": 6},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["n", "s"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                              "days": {"type": "integer", "minimum": 1, "maximum": 7}},
             "required": ["city", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "toggle", "parameters": {
             "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
             "additionalProperties": False}}}]
MSGS = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def real():
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(
        ["--max-model-len", "1024", "--max-num-seqs", "8", "--served-model-name", M])
    s = LiveServer(build_app(args))
    yield s
    s.stop()


def _post(real, path, body):
    return httpx.post(real.url + path, json=body, timeout=60)


def _chat(real, **kw):
    return real.client().chat.completions.create(model=M, messages=MSGS, max_tokens=300, temperature=1.0, **kw)


# ---- never accept and ignore ---------------------------------------------------------------------

UNSUPPORTED = {
    "use_beam_search": True, "best_of": 3, "length_penalty": 0.5, "priority": 1, "vllm_xargs": {"a": 1},
    "chat_template": "{{ x }}", "continue_final_message": True, "add_generation_prompt": False,
    "thinking_token_budget": 100, "guided_decoding_backend": "xgrammar", "early_stopping": True,
    "echo": True, "logits_processors": ["x"], "truncate_prompt_tokens": 5, "made_up_field": 1,
}


CASES = [("chat", f) for f in UNSUPPORTED] + [("completions", f) for f in UNSUPPORTED if f != "echo"]


@pytest.mark.parametrize("route,field", CASES, ids=[f"{r}-{f}" for r, f in CASES])
def test_unsupported_fields_are_400_naming_them(real, route, field):
    field_value = UNSUPPORTED[field]
    base = ({"model": M, "messages": MSGS, "max_tokens": 2} if route == "chat"
            else {"model": M, "prompt": "Hi", "max_tokens": 2, "n": 1})
    r = _post(real, "/v1/chat/completions" if route == "chat" else "/v1/completions", {**base, field: field_value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err
    # the same through the openai client's extra_body
    c = real.client()
    with pytest.raises(openai.BadRequestError, match=field):
        if route == "chat":
            c.chat.completions.create(model=M, messages=MSGS, max_tokens=2, extra_body={field: field_value})
        else:
            c.completions.create(model=M, prompt="Hi", max_tokens=2, extra_body={field: field_value})


def test_accepted_no_ops_and_nested_unknowns(real):
    ok = _post(real, "/v1/completions", {"model": M, "prompt": "Hi", "max_tokens": 2, "n": 2, "best_of": 2,
                                         "user": "u1"})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
    r = _post(real, "/v1/chat/completions", {"model": M, "messages": MSGS, "max_tokens": 2,
                                             "stream": True, "stream_options": {"include_obfuscation": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.include_obfuscation"
    r = _post(real, "/v1/chat/completions", {"model": M, "messages": MSGS, "guided_regex": "a+",
                                             "guided_choice": ["x"]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "conflicting_constraints"
    r = _post(real, "/v1/completions", {"model": M, "prompt": "Hi", "structured_outputs": {"regex": "a",
                                                                                          "structural_tag": "x"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.structural_tag"
    r = _post(real, "/v1/completions", {"model": M, "prompt": "Hi", "guided_regex": "(unclosed"})
    assert r.status_code == 400 and "structured_outputs" in r.json()["error"]["message"]


# ---- structured modes -----------------------------------------------------------------------------

def _valid(text, schema=SCHEMA):
    jsonschema.validate(json.loads(text), schema)
    return True


@pytest.mark.parametrize("kw", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": SCHEMA}}},
    {"extra_body": {"guided_json": SCHEMA}},
    {"extra_body": {"structured_outputs": {"json": SCHEMA}}},
], ids=["response_format", "guided_json", "structured_outputs"])
def test_chat_json_schema_modes(real, kw):
    extra = {**OFF, **kw.pop("extra_body", {})}
    for seed in range(3):
        r = _chat(real, seed=seed, extra_body=extra, **kw)
        assert r.choices[0].finish_reason == "stop" and _valid(r.choices[0].message.content)


def test_chat_streamed_matches_plain_under_a_schema(real):
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    plain = _chat(real, seed=4, extra_body=OFF, response_format=rf).choices[0].message.content
    parts = [ch.delta.content or "" for chunk in _chat(real, seed=4, extra_body=OFF, response_format=rf, stream=True)
             for ch in chunk.choices]
    assert "".join(parts) == plain and _valid(plain)


def test_responses_text_format_is_enforced(real):
    for seed in range(2):
        r = real.client().responses.create(model=M, input="Answer in JSON.", max_output_tokens=300, temperature=1.0,
                                           reasoning={"effort": "none"}, extra_body={"seed": seed},
                                           text={"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}})
        assert r.status == "completed" and _valid(r.output_text)


def test_responses_named_tool_choice_is_enforced(real):
    fn = TOOLS[0]["function"]
    flat = [{"type": "function", "name": fn["name"], "parameters": fn["parameters"]}]
    r = real.client().responses.create(model=M, input="Weather?", max_output_tokens=300, temperature=1.0, tools=flat,
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       reasoning={"effort": "none"})
    (call,) = [i for i in r.output if i.type == "function_call"]
    assert call.name == "get_weather" and _valid(call.arguments, fn["parameters"])


def test_other_modes_on_both_routes(real):
    c = real.client()
    tok = real.state.tokenizer
    small = [t for t in range(tok.num_base_tokens) if tok.decode([t]) in set('{}":1a')] + tok.stop_token_ids
    cases = [({"guided_regex": r"[a-c]{2,4}-\d{2}"}, lambda t: re.fullmatch(r"[a-c]{2,4}-\d{2}", t)),
             ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
             ({"guided_grammar": 'start: "v" /[0-9]/ ("." /[0-9]/)?'}, lambda t: re.fullmatch(r"v[0-9](\.[0-9])?", t)),
             ({"response_format": {"type": "json_object"}, "allowed_token_ids": small},
              lambda t: isinstance(json.loads(t), dict))]
    for extra, check in cases:
        for seed in range(2):
            r = c.completions.create(model=M, prompt="Q:", max_tokens=300, temperature=1.0, seed=seed,
                                     extra_body=extra)
            assert r.choices[0].finish_reason == "stop" and check(r.choices[0].text), (extra, r.choices[0].text)
            r = c.chat.completions.create(model=M, messages=MSGS, max_tokens=300, temperature=1.0, seed=seed,
                                          extra_body={**OFF, **extra})
            assert r.choices[0].finish_reason == "stop" and check(r.choices[0].message.content), extra


def test_named_and_required_tool_choice(real):
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(3):
        r = _chat(real, seed=seed, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  extra_body=OFF)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        _valid(call.function.arguments, by_name["get_weather"])
        r = _chat(real, seed=seed, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, extra_body=OFF)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
        _valid(calls[0].function.arguments, by_name[calls[0].function.name])
        assert not r.choices[0].message.content


def test_forced_calls_with_open_schemas_finish(real):
    """A named tool_choice whose schema does not say additionalProperties (nested objects too): the
    objects are closed, so the call ends with the declared keys only."""
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                "opts": {"type": "object", "properties": {"n": {"type": "integer",
                                                                                                 "minimum": 0,
                                                                                                 "maximum": 9}}}},
              "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": params}}]
    closed = closed_schema(params)
    for seed in range(3):
        r = _chat(real, seed=seed, tools=tools, tool_choice={"type": "function", "function": {"name": "lookup"}},
                  extra_body=OFF)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and _valid(call.function.arguments, closed)


def test_closed_schema():
    open_ = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}},
                                              "free": {"type": "object"}, "keep": {"type": "object", "properties": {},
                                                                                   "additionalProperties": True},
                                              "arr": {"type": "array", "items": {"properties": {"c": {}}}},
                                              "alt": {"anyOf": [{"properties": {"d": {}}}, {"type": "null"}]},
                                              "both": {"allOf": [{"properties": {"e": {}}}]}}}
    want = {"type": "object", "additionalProperties": False, "properties": {
        "a": {"type": "object", "properties": {"b": {}}, "additionalProperties": False},
        "free": {"type": "object"}, "keep": {"type": "object", "properties": {}, "additionalProperties": True},
        "arr": {"type": "array", "items": {"properties": {"c": {}}, "additionalProperties": False}},
        "alt": {"anyOf": [{"properties": {"d": {}}, "additionalProperties": False}, {"type": "null"}]},
        "both": {"allOf": [{"properties": {"e": {}}}]}}}
    assert closed_schema(open_) == want
    assert open_["properties"]["a"] == {"type": "object", "properties": {"b": {}}}     # the input is not changed


def test_logit_bias_and_controls_on_the_routes(real):
    c = real.client()
    tok = real.state.tokenizer
    r = c.completions.create(model=M, prompt="Hi", max_tokens=5, temperature=1.0, logit_bias={"77": 100})
    assert r.choices[0].text == tok.decode([77] * 5)
    r = c.chat.completions.create(model=M, messages=MSGS, max_tokens=5, logit_bias={"77": 100}, extra_body=OFF)
    assert r.choices[0].message.content == tok.decode([77] * 5)
    r = c.completions.create(model=M, prompt="Hi", max_tokens=6, temperature=0, logit_bias={str(tok.stop_token_ids[0]): 40},
                             extra_body={"min_tokens": 4})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "stop"
    r = _post(real, "/v1/completions", {"model": M, "prompt": "Hello there", "max_tokens": 2, "prompt_logprobs": 2})
    lps = r.json()["choices"][0]["prompt_logprobs"]
    assert lps[0] is None and len(lps) == len(tok.encode("Hello there"))
    assert all(str(t) in d for t, d in zip(tok.encode("Hello there")[1:], lps[1:]))
    r = _post(real, "/v1/completions", {"model": M, "prompt": "Hi", "max_tokens": 2, "logit_bias": {"x": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    r = _post(real, "/v1/completions", {"model": M, "prompt": "Hi", "max_tokens": 2, "logit_bias": {"5": 101}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


# ---- the K3 answer grammar (reasoning first) --------------------------------------------------------

def test_reasoning_comes_before_the_constraint():
    tok = kimik3.load_tokenizer(kimik3.DEFAULT_MODEL)
    grammar = k3_answer_grammar(thinking=True, content=SO(json=SCHEMA), tools=None, tool_mode=None, max_calls=1)
    compiler = GrammarCompiler(tok, tok.vocab_size, tok.stop_token_ids)

    def accepts(text: str) -> int:
        m = compiler.matcher(grammar)
        ids = tok.encode(text, allow_special=True)
        return m.valid_prefix(ids) == len(ids)

    answer = '{"n": 5, "s": "hi"}<|close|>response<|sep|><|close|>message<|sep|>'
    assert accepts("Let me think: not JSON at all {[<|close|>think<|sep|><|open|>response<|sep|>" + answer)
    assert accepts("Free reasoning text")
    assert not accepts("hmm<|close|>think<|sep|><|open|>response<|sep|>not json")
    assert not accepts("hmm<|close|>think<|sep|><|open|>response<|sep|>{\"n\": 5000, \"s\": \"\"}")
    m = compiler.matcher(grammar)
    m.m.consume_tokens(tok.encode("x<|close|>think<|sep|><|open|>response<|sep|>" + answer, allow_special=True))
    assert m.m.is_accepting()
