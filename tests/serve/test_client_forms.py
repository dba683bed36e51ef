"""Every chat / completion form of the official ``openai`` client against ``kimik3 serve`` (issue #54 target):
each answer validated against the client's own types (pydantic validation of the raw JSON, not the client's
lenient construction), each streamed chunk too; every parameter of ``chat.completions.create`` and
``completions.create`` either served or refused with a 400 naming it and why; the parse and stream helpers;
models; the APIs kimik3 does not serve refused with a message that says why. (The Responses API's forms,
``client.responses.stream()`` and ``create()``, are in test_responses_api.py.)

Forms that need the model to follow a constraint (tool_choice required / named, json_schema, ``parse``) run
on the embedded tiny K3 with thinking off and bounded strings; the others on the scripted fake model."""

from __future__ import annotations

import argparse
import inspect
import json

import httpx
import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel, Field, ValidationError

from kimik3.serve import add_serve_arguments, build_app
from tests.serve.conftest import MODEL, LiveServer, start_fake_server
from tests.serve.test_api import ANSWER_OUTPUT, PLAIN_OUTPUT, TOK, TOOL_OUTPUT, TOOLS, script
from tests.serve.test_errors import png_data_url

OFF = {"chat_template_kwargs": {"thinking": False}}


@pytest.fixture(scope="module")
def fake():
    s = start_fake_server(scripts={"SCRIPT_TOOL": script(TOOL_OUTPUT), "SCRIPT_ANSWER": script(ANSWER_OUTPUT),
                                   "SCRIPT_PLAIN": script(PLAIN_OUTPUT)})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def real():
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(
        ["--max-model-len", "1024", "--max-num-seqs", "4", "--served-model-name", MODEL])
    s = LiveServer(build_app(args))
    yield s
    s.stop()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def sse(server, path: str, body: dict) -> list[dict]:
    """A stream as sent: every ``data:`` chunk parsed, ending with ``[DONE]``."""
    out = []
    with httpx.stream("POST", server.url + path, json={"model": MODEL, "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for line in lines[:-1]:
        out.append(json.loads(line))
    return out


def validated(cls, obj):
    """``obj`` (a client object) validated against ``cls`` from its JSON: raises on any field the type rejects."""
    return cls.model_validate(obj.model_dump(mode="json") if hasattr(obj, "model_dump") else obj)


def completion_chunk(obj) -> dict:
    """A streamed completion chunk against ``Completion``, the type the client reads chunks into. That type's
    ``finish_reason`` is never null, yet OpenAI's own stream (and vLLM's) sends null until the last chunk: that
    one field may be null, every other must validate. Returns the chunk's JSON."""
    raw = obj.model_dump(mode="json") if hasattr(obj, "model_dump") else obj
    known_gaps(Completion, raw, lambda loc, value: loc[-1] == "finish_reason" and value is None)
    return raw


def known_gaps(cls, raw: dict, allowed) -> None:
    """Validate ``raw`` against ``cls``; only the errors ``allowed(loc, input)`` accepts may remain."""
    try:
        cls.model_validate(raw)
    except ValidationError as e:
        bad = [x for x in e.errors() if not allowed(x["loc"], x["input"])]
        assert not bad, bad


# ---- chat: the documented forms -----------------------------------------------------------------------------

def test_chat_default(fake):
    r = fake.client().chat.completions.create(model=MODEL, messages=[{"role": "developer", "content": "Be brief."},
                                                                     *user("SCRIPT_ANSWER 2+2?")])
    v = validated(ChatCompletion, r)
    assert v.choices[0].message.content == "It is 4." and v.object == "chat.completion"
    raw = fake.client().chat.completions.with_raw_response.create(model=MODEL, messages=user("SCRIPT_PLAIN x"))
    assert ChatCompletion.model_validate(raw.http_response.json()).choices[0].message.content == "Just content."


def test_chat_streaming(fake):
    chunks = sse(fake, "/v1/chat/completions", {"messages": user("SCRIPT_ANSWER s"),
                                                "stream_options": {"include_usage": True}})
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert "".join(ch.delta.content or "" for p in parsed for ch in p.choices) == "It is 4."
    assert parsed[-1].usage.completion_tokens == len(script(ANSWER_OUTPUT))
    client_side = list(fake.client().chat.completions.create(model=MODEL, messages=user("SCRIPT_ANSWER s"),
                                                             stream=True))
    assert all(validated(ChatCompletionChunk, c) for c in client_side)


def test_chat_image_input(real):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is in this image?"},
                                         {"type": "image_url", "image_url": {"url": png_data_url(), "detail": "low"}}]}]
    r = real.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, extra_body=OFF)
    assert validated(ChatCompletion, r).usage.prompt_tokens > 2


def test_chat_functions_auto_and_none(fake):
    c = fake.client()
    r = validated(ChatCompletion, c.chat.completions.create(model=MODEL, messages=user("SCRIPT_TOOL Paris?"),
                                                            tools=TOOLS, tool_choice="auto"))
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and json.loads(call.function.arguments) == {"city": "Paris",
                                                                                                 "days": 3}
    chunks = [ChatCompletionChunk.model_validate(x) for x in sse(fake, "/v1/chat/completions", {
        "messages": user("SCRIPT_TOOL Paris?"), "tools": TOOLS})]
    assert [t.function.name for x in chunks for ch in x.choices for t in ch.delta.tool_calls or []] == ["get_weather"]
    none = validated(ChatCompletion, c.chat.completions.create(model=MODEL, messages=user("SCRIPT_TOOL Paris?"),
                                                               tools=TOOLS, tool_choice="none"))
    assert not none.choices[0].message.tool_calls


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_chat_forced_tool_choice(real, choice):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}]
    r = real.client().chat.completions.create(model=MODEL, messages=user("Weather?"), max_tokens=200, tools=tools,
                                              tool_choice=choice, parallel_tool_calls=False, extra_body=OFF, seed=1)
    v = validated(ChatCompletion, r)
    (call,) = v.choices[0].message.tool_calls
    assert v.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}


def test_chat_logprobs(fake):
    r = validated(ChatCompletion, fake.client().chat.completions.create(
        model=MODEL, messages=user("SCRIPT_PLAIN lp"), logprobs=True, top_logprobs=2))
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    chunks = [ChatCompletionChunk.model_validate(x) for x in sse(fake, "/v1/chat/completions", {
        "messages": user("SCRIPT_PLAIN lp"), "logprobs": True, "top_logprobs": 1})]
    assert sum(len(ch.logprobs.content) for x in chunks for ch in x.choices if ch.logprobs) == len(content)


def test_chat_response_format_json_schema(real):
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 6}}, "required": ["word"],
              "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "w", "strict": True, "schema": schema}}
    r = validated(ChatCompletion, real.client().chat.completions.create(
        model=MODEL, messages=user("JSON please"), max_tokens=200, response_format=rf, extra_body=OFF, seed=2))
    assert r.choices[0].finish_reason == "stop" and set(json.loads(r.choices[0].message.content)) == {"word"}
    obj = real.client().chat.completions.create(model=MODEL, messages=user("JSON"), max_tokens=3, extra_body=OFF,
                                                response_format={"type": "json_object"})
    assert validated(ChatCompletion, obj).choices[0].message.content.startswith("{")


class Answer(BaseModel):
    word: str = Field(max_length=6)
    n: int = Field(ge=0, le=99)


class GetWeather(BaseModel):
    city: str = Field(max_length=8)


@pytest.mark.parametrize("where", ["chat", "beta.chat"])
def test_chat_parse(real, where):
    c = real.client()
    completions = c.chat.completions if where == "chat" else c.beta.chat.completions
    r = completions.parse(model=MODEL, messages=user("Answer."), response_format=Answer, max_tokens=200,
                          extra_body=OFF, seed=3)
    assert isinstance(r.choices[0].message.parsed, Answer) and r.choices[0].finish_reason == "stop"
    r = completions.parse(model=MODEL, messages=user("Weather?"), tools=[openai.pydantic_function_tool(GetWeather)],
                          tool_choice="required", parallel_tool_calls=False, max_tokens=200, extra_body=OFF, seed=3)
    (call,) = r.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_chat_stream_helper(fake, real):
    with fake.client().chat.completions.stream(model=MODEL, messages=user("SCRIPT_ANSWER s")) as stream:
        kinds = {e.type for e in stream}
        final = stream.get_final_completion()
    assert {"chunk", "content.delta", "content.done"} <= kinds and final.choices[0].message.content == "It is 4."
    with real.client().chat.completions.stream(model=MODEL, messages=user("Answer."), response_format=Answer,
                                               max_tokens=200, extra_body=OFF, seed=4) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Answer)


def test_responses_parse(real):
    r = real.client().responses.parse(model=MODEL, input="Answer.", text_format=Answer, max_output_tokens=200,
                                      reasoning={"effort": "none"}, extra_body={"seed": 5})
    assert isinstance(r.output_parsed, Answer)


# ---- chat: every parameter of create() ------------------------------------------------------------------------

CHAT_PARAMS = {                 # name -> (value, None when served / a fragment of the refusal's reason)
    "audio": ({"voice": "alloy", "format": "wav"}, "no audio"), "frequency_penalty": (0.1, None),
    "function_call": ("auto", "use tool_choice"), "functions": ([{"name": "f", "parameters": {}}], "use tools"),
    "logit_bias": ({"5": 1.0}, None), "logprobs": (True, None), "max_completion_tokens": (4, None),
    "max_tokens": (4, None), "metadata": ({"k": "v"}, None), "modalities": (["text"], None),
    "moderation": ({"model": "omni-moderation-latest"}, "no moderation model"), "n": (2, None),
    "parallel_tool_calls": (False, None), "prediction": ({"type": "content", "content": "x"}, "predicted outputs"),
    "presence_penalty": (0.1, None), "prompt_cache_key": ("k", None),
    "prompt_cache_options": ({"ttl": "1h"}, "no per-request options"), "prompt_cache_retention": ("in_memory", None),
    "reasoning_effort": ("low", None), "response_format": ({"type": "text"}, None), "safety_identifier": ("u", None),
    "seed": (1, None), "service_tier": ("auto", None), "stop": (["zz"], None), "store": (False, None),
    "stream": (True, None), "stream_options": ({"include_usage": True}, None), "temperature": (0.5, None),
    "tool_choice": ("auto", None), "tools": (TOOLS, None), "top_logprobs": (2, None), "top_p": (0.9, None),
    "user": ("u", None), "verbosity": ("low", "no verbosity control"), "web_search_options": ({}, "no network"),
}
NEEDS = {"top_logprobs": {"logprobs": True}, "stream_options": {"stream": True}, "tool_choice": {"tools": TOOLS},
         "parallel_tool_calls": {"tools": TOOLS}}


def test_every_chat_create_parameter_is_listed():
    names = set(inspect.signature(openai.OpenAI(api_key="x").chat.completions.create).parameters)
    assert names - {"messages", "model", "extra_headers", "extra_query", "extra_body", "timeout"} == set(CHAT_PARAMS)


@pytest.mark.parametrize("name", sorted(CHAT_PARAMS))
def test_chat_create_parameter(fake, name):
    value, refused = CHAT_PARAMS[name]
    kw = {"max_tokens": 4, **NEEDS.get(name, {}), name: value}
    c = fake.client()
    if refused is None:
        r = c.chat.completions.create(model=MODEL, messages=user("SCRIPT_PLAIN p"), **kw)
        for obj in (r if kw.get("stream") else [r]):
            validated(ChatCompletionChunk if kw.get("stream") else ChatCompletion, obj)
        return
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=user("SCRIPT_PLAIN p"), **kw)
    assert name in e.value.body["message"] and refused in e.value.body["message"], e.value.body


# ---- completions ------------------------------------------------------------------------------------------------

def test_completions_default_batch_and_stream(fake):
    c = fake.client()
    r = validated(Completion, c.completions.create(model=MODEL, prompt=["SCRIPT_PLAIN a", "SCRIPT_PLAIN b"], n=2,
                                                   max_tokens=4))
    assert len(r.choices) == 4 and r.object == "text_completion"
    chunks = [completion_chunk(x) for x in sse(fake, "/v1/completions", {
        "prompt": "SCRIPT_PLAIN s", "max_tokens": 4, "stream_options": {"include_usage": True}})]
    assert "".join(ch["text"] for x in chunks for ch in x["choices"]) == c.completions.create(
        model=MODEL, prompt="SCRIPT_PLAIN s", max_tokens=4).choices[0].text
    assert chunks[-1]["usage"]["completion_tokens"] == 4


def test_completions_echo_and_logprobs(fake):
    """Echo with logprobs: the prompt's tokens open the logprobs (the first one's null), then the answer's."""
    prompt = "SCRIPT_PLAIN e"
    r = fake.client().completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=2)
    # the first prompt token's logprob and top_logprobs are null, as OpenAI's echo and vLLM's send them, though
    # the client's Logprobs type lists floats and dicts only: those two entries are the only errors
    known_gaps(Completion, r.model_dump(mode="json"), lambda loc, value: value is None and loc[-2:] in (
        ("token_logprobs", 0), ("top_logprobs", 0)))
    ch, n = r.choices[0], len(TOK.encode(prompt))
    lp = ch.logprobs
    assert ch.text.startswith(prompt) and len(lp.tokens) == n + r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(lp.top_logprobs)
    assert "".join(lp.tokens[:n]) == prompt and lp.text_offset[:2] == [0, len(lp.tokens[0])]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[n] == len(prompt)
    assert all(isinstance(v, float) and len(t) >= 1 for v, t in zip(lp.token_logprobs[1:n], lp.top_logprobs[1:n]))
    assert "prompt_logprobs" not in r.model_dump()["choices"][0]       # vLLM's field only when asked for
    with pytest.raises(openai.BadRequestError, match="stream=false"):
        fake.client().completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=1, stream=True)


COMPLETION_PARAMS = {
    "best_of": (1, None), "echo": (True, None), "frequency_penalty": (0.1, None), "logit_bias": ({"5": 1.0}, None),
    "logprobs": (2, None), "max_tokens": (3, None), "n": (2, None), "presence_penalty": (0.1, None),
    "seed": (1, None), "stop": ("zz", None), "stream": (True, None), "stream_options": ({"include_usage": True}, None),
    "suffix": ("end", "fill-in-the-middle"), "temperature": (0.5, None), "top_p": (0.9, None), "user": ("u", None),
}


def test_every_completion_create_parameter_is_listed():
    names = set(inspect.signature(openai.OpenAI(api_key="x").completions.create).parameters)
    assert names - {"model", "prompt", "extra_headers", "extra_query", "extra_body", "timeout"} == set(COMPLETION_PARAMS)


@pytest.mark.parametrize("name", sorted(COMPLETION_PARAMS))
def test_completion_create_parameter(fake, name):
    value, refused = COMPLETION_PARAMS[name]
    kw = {"max_tokens": 3, **({"stream": True} if name == "stream_options" else {}), name: value}
    c = fake.client()
    if refused is None:
        r = c.completions.create(model=MODEL, prompt="SCRIPT_PLAIN p", **kw)
        for obj in (r if kw.get("stream") else [r]):
            completion_chunk(obj) if kw.get("stream") else validated(Completion, obj)
        return
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="SCRIPT_PLAIN p", **kw)
    assert name in e.value.body["message"] and refused in e.value.body["message"], e.value.body


# ---- models, stored objects, APIs not served ----------------------------------------------------------------

def test_models_list_and_retrieve(fake):
    c = fake.client()
    (m,) = list(c.models.list())
    assert validated(Model, m).id == MODEL and validated(Model, c.models.retrieve(MODEL)).owned_by == "kimik3"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-9")


def test_stored_objects_are_refused_with_the_reason(fake):
    c = fake.client()
    calls = [lambda: c.chat.completions.retrieve("chatcmpl-1"), lambda: c.chat.completions.delete("chatcmpl-1"),
             lambda: c.chat.completions.update("chatcmpl-1", metadata={"a": "b"}),
             lambda: c.chat.completions.messages.list("chatcmpl-1"), lambda: c.responses.retrieve("resp_1"),
             lambda: c.responses.delete("resp_1"), lambda: c.responses.cancel("resp_1")]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert "nothing is stored here" in e.value.body["message"] and e.value.body["code"] == "not_served"
    with pytest.raises(openai.APIStatusError) as e:
        c.chat.completions.list()
    assert e.value.status_code == 405 and "listing stored chat completions is not served" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError, match="POST /tokenize"):
        c.responses.input_tokens.count(model=MODEL, input="hi")


def test_apis_not_served_say_why(fake):
    c = fake.client()
    cases = [(lambda: c.embeddings.create(model=MODEL, input="x"), "generative models only"),
             (lambda: c.moderations.create(input="x"), "no moderation model"),
             (lambda: c.images.generate(model=MODEL, prompt="x"), "does not generate"),
             (lambda: c.audio.speech.create(model=MODEL, voice="alloy", input="x"), "no audio"),
             (lambda: c.files.list(), "no file store"), (lambda: c.batches.list(), "no batch API"),
             (lambda: c.fine_tuning.jobs.list(), "inference only")]
    for call, why in cases:
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert why in e.value.body["message"] and "kimik3 serves POST /v1/chat/completions" in e.value.body["message"]
    r = httpx.get(fake.url + "/v1/nothing")
    assert r.status_code == 404 and "no such route" in r.json()["error"]["message"]
