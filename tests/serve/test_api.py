"""Endpoints through the official client: chat (plain, streamed, tools, reasoning), completions, models."""

from __future__ import annotations

import json

import httpx
import pytest

import kimik3
from tests.serve.conftest import END_OF_MSG, MODEL, start_fake_server

TOK = kimik3.load_tokenizer(kimik3.DEFAULT_MODEL)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"},
                                                                          "days": {"type": "integer"}}}}}]
TOOL_OUTPUT = ('I should call the tool.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|>'
               '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
               '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
               '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>'
               '<|close|>tools<|sep|><|close|>message<|sep|>')
ANSWER_OUTPUT = ('Two plus two.<|close|>think<|sep|><|open|>response<|sep|>It is 4.<|close|>response<|sep|>'
                 '<|close|>message<|sep|>')
PLAIN_OUTPUT = 'Just content.<|close|>response<|sep|><|close|>message<|sep|>'


def script(text: str) -> list[int]:
    return TOK.encode(text, allow_special=True) + [END_OF_MSG]


@pytest.fixture(scope="module")
def server():
    s = start_fake_server(scripts={"SCRIPT_TOOL": script(TOOL_OUTPUT), "SCRIPT_ANSWER": script(ANSWER_OUTPUT),
                                   "SCRIPT_PLAIN": script(PLAIN_OUTPUT)})
    yield s
    s.stop()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_chat_reasoning_separated(server):
    r = server.client().chat.completions.create(model=MODEL, messages=user("SCRIPT_ANSWER what is 2+2?"))
    m = r.choices[0].message
    assert m.reasoning_content == "Two plus two."
    assert m.content == "It is 4."
    assert not m.tool_calls
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(script(ANSWER_OUTPUT))
    assert r.usage.prompt_tokens == len(TOK.apply_chat_template(user("SCRIPT_ANSWER what is 2+2?"), tokenize=True))


def test_chat_streamed_matches_plain(server):
    c = server.client()
    msgs = user("SCRIPT_ANSWER streamed")
    plain = c.chat.completions.create(model=MODEL, messages=msgs)
    reasoning, content, reasons, roles = [], [], [], []
    usage = None
    for chunk in c.chat.completions.create(model=MODEL, messages=msgs, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            d = ch.delta
            roles.append(d.role)
            reasoning.append(getattr(d, "reasoning_content", None) or "")
            content.append(d.content or "")
            reasons.append(ch.finish_reason)
    assert roles[0] == "assistant" and roles[1:].count("assistant") == 0
    assert "".join(reasoning) == plain.choices[0].message.reasoning_content
    assert "".join(content) == plain.choices[0].message.content
    assert reasons[-1] == "stop" and reasons[:-1] == [None] * (len(reasons) - 1)
    assert usage.completion_tokens == plain.usage.completion_tokens
    assert usage.prompt_tokens == plain.usage.prompt_tokens
    # the same prompt again is served from the prefix cache
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_tool_calls_end_to_end(server):
    c = server.client()
    msgs = user("SCRIPT_TOOL weather in Paris?")
    r = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "I should call the tool."
    assert choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}

    streamed = []
    finish = None
    for chunk in c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, stream=True):
        for ch in chunk.choices:
            streamed.extend(ch.delta.tool_calls or [])
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in streamed] == \
        [(0, "get_weather", {"city": "Paris", "days": 3})]

    # The conversation continues with the tool result rendered back into the prompt.
    follow = msgs + [{"role": "assistant", "content": "Checking.", "reasoning_content": "I should call the tool.",
                      "tool_calls": [{"id": call.id, "type": "function",
                                      "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r2 = c.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, max_tokens=3)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens


def test_tool_calls_need_tools(server):
    """Without tools (or with tool_choice none) a call the model writes anyway (forced here by the script,
    past the logits mask) is dropped: no tool_calls, no markup in the content."""
    c = server.client()
    for kw in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        r = c.chat.completions.create(model=MODEL, messages=user("SCRIPT_TOOL no tools"), **kw)
        m = r.choices[0].message
        assert not m.tool_calls and m.content == "Checking." and r.choices[0].finish_reason == "stop"
        chunks = list(c.chat.completions.create(model=MODEL, messages=user("SCRIPT_TOOL no tools"), stream=True, **kw))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Checking."


def _opener_pairs(server, chat: bool = True, **kw) -> int:
    """Times the sampled tokens hold ``<|open|>`` then a token that starts ``tools``, over a few sampled
    answers restricted to those tokens and two others."""
    ids = {s: TOK.encode(s, allow_special=True) for s in ("<|open|>", "t", "to", "x", "y")}
    assert all(len(v) == 1 for v in ids.values())
    extra = {"allowed_token_ids": [v[0] for v in ids.values()], "ignore_eos": True}
    pairs = 0
    for seed in range(4):
        c = server.client()
        if chat:
            r = c.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=48, temperature=1.0, seed=seed,
                                          logprobs=True, extra_body=extra, **kw)
            toks = [e.token for e in r.choices[0].logprobs.content]
        else:
            r = c.completions.create(model=MODEL, prompt="hi", max_tokens=48, temperature=1.0, seed=seed, logprobs=0,
                                     extra_body={**extra, "skip_special_tokens": False})
            toks = r.choices[0].logprobs.tokens
        pairs += sum(a == "<|open|>" and b in ("t", "to") for a, b in zip(toks, toks[1:]))
    return pairs


def test_no_tools_masks_the_tool_section_opener(server):
    assert _opener_pairs(server) == 0
    assert _opener_pairs(server, tools=TOOLS, tool_choice="none") == 0
    assert _opener_pairs(server, chat=False) > 0     # unguarded (a plain completion), the same tokens pair up


def test_thinking_off(server):
    c = server.client()
    r = c.chat.completions.create(model=MODEL, messages=user("SCRIPT_PLAIN"),
                                  extra_body={"chat_template_kwargs": {"thinking": False}})
    assert r.choices[0].message.content == "Just content."
    assert r.choices[0].message.reasoning_content is None
    r2 = c.chat.completions.create(model=MODEL, messages=user("SCRIPT_PLAIN"), reasoning_effort="none")
    assert r2.choices[0].message.content == "Just content."
    on = TOK.apply_chat_template(user("SCRIPT_PLAIN"), tokenize=True)
    off = TOK.apply_chat_template(user("SCRIPT_PLAIN"), tokenize=True, thinking=False)
    assert (r.usage.prompt_tokens, r2.usage.prompt_tokens) == (len(off), len(off)) and len(on) != len(off)


def test_reasoning_effort_and_response_format(server):
    c = server.client()
    low = c.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2, reasoning_effort="low")
    assert low.usage.prompt_tokens == len(TOK.apply_chat_template(user("hi"), tokenize=True, thinking_effort="low"))
    js = c.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2,
                                   response_format={"type": "json_object"})
    assert js.usage.prompt_tokens == len(TOK.apply_chat_template(user("hi"), tokenize=True,
                                                                 response_format={"type": "json_object"}))


def test_chat_sampling_options(server):
    c = server.client()
    msgs = user("sampling")
    r = c.chat.completions.create(model=MODEL, messages=msgs, n=3, max_completion_tokens=5, temperature=0.8,
                                  top_p=0.9, seed=7, logprobs=True, top_logprobs=2,
                                  extra_body={"top_k": 5, "ignore_eos": True})
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 15
    for ch in r.choices:
        assert ch.finish_reason == "length" and len(ch.logprobs.content) == 5
        assert all(len(t.top_logprobs) == 2 for t in ch.logprobs.content)
    again = c.chat.completions.create(model=MODEL, messages=msgs, n=3, max_completion_tokens=5, temperature=0.8,
                                      top_p=0.9, seed=7, extra_body={"top_k": 5, "ignore_eos": True})
    assert [x.message.reasoning_content for x in again.choices] == [x.message.reasoning_content for x in r.choices]


def test_stop_string(server):
    c = server.client()
    r = c.chat.completions.create(model=MODEL, messages=user("SCRIPT_ANSWER stop"), stop=["plus"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.reasoning_content == "Two "


def test_completions(server):
    c = server.client()
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens == len(TOK.encode("Once upon a time"))
    ids = TOK.encode("Once upon a time")
    r_ids = c.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert r_ids.choices[0].text == r.choices[0].text
    text = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices)
    assert text == r.choices[0].text
    batch = c.completions.create(model=MODEL, prompt=["Once upon a time", "Hello"], max_tokens=3, n=2,
                                 temperature=0, logprobs=1, echo=True, extra_body={"ignore_eos": True})
    assert [ch.index for ch in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text.startswith("Once upon a time") and batch.choices[2].text.startswith("Hello")
    # echo with logprobs: the prompt's tokens first (the first one's logprob null), then the 3 generated
    lp = batch.choices[3].logprobs
    assert len(lp.tokens) == len(TOK.encode("Hello")) + 3 and lp.token_logprobs[0] is None


def test_models_health_metrics(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    text = httpx.get(server.url + "/metrics").text
    for name in ("kimik3:http_requests_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        assert name in text, name
    assert f'kimik3:http_requests_total{{model_name="{MODEL}",route="/v1/chat/completions",status="200"}}' in text
