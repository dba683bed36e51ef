"""Malformed input is a 4xx, never a 5xx: the classes the outside fuzz rounds found (each was a 500), then
seeded random mutations of a valid body for every route (fields, and nodes at any depth such as a tool schema's
``required``, replaced by values of every JSON type, deep nesting, Unicode digits, removed or unknown fields,
truncated bytes)."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from tests.serve.conftest import MODEL, start_fake_server

MSGS = [{"role": "user", "content": "hi"}]
DEEP_SCHEMA = '{"type":"object","properties":{"a":' * 700 + "{}" + "}}" * 700
DEEP_LIST = "[" * 5000 + "]" * 5000


def _chat(**kw):
    return {"model": MODEL, "messages": MSGS, "max_tokens": 2, **kw}


def _completion(**kw):
    return {"model": MODEL, "prompt": "x", "max_tokens": 2, **kw}


def _tool_chat(parameters: dict) -> dict:
    tools = [{"type": "function", "function": {"name": "get", "parameters": parameters}}]
    return _chat(tools=tools, tool_choice={"type": "function", "function": {"name": "get"}})


def _responses_part(part):
    return {"model": MODEL, "max_output_tokens": 2, "input": [{"role": "user", "content": [part]}]}


# (route, body, the param the 400 names or None): each was a 500 before
KNOWN = [
    ("/v1/chat/completions", _chat(logit_bias={"²": 1}), "logit_bias"),
    ("/v1/completions", _completion(logit_bias={"٣": 1}), "logit_bias"),       # int("٣") == 3: was accepted
    ("/tokenize", {"messages": []}, "messages"),
    ("/v1/responses", _responses_part({"type": "input_text", "text": 5}), "input[0].content[0].text"),
    ("/v1/responses", _responses_part({"type": "input_text", "text": [1]}), "input[0].content[0].text"),
    ("/v1/responses", _responses_part({"type": "input_text", "text": {"a": 1}}), "input[0].content[0].text"),
    ("/v1/responses", {"model": MODEL, "input": [{"type": "message", "role": "assistant",
                                                  "content": [{"type": "output_text", "text": {"x": 1}}]}]},
     "input[0].content[0].text"),
    ("/v1/completions", _completion(guided_json=DEEP_SCHEMA), None),
    ("/v1/chat/completions", _chat(guided_json=DEEP_SCHEMA), None),
    ("/v1/chat/completions", _chat(structured_outputs={"json": DEEP_SCHEMA}), None),
    ("/v1/completions", _completion(structured_outputs={"json": DEEP_LIST}), None),
    ("/v1/chat/completions", _chat(guided_grammar='{"grammars": ' + DEEP_LIST + "}"), None),
    ("/v1/chat/completions", _chat(allowed_token_ids=[65], bad_words=["A"]), None),      # emitted token 0
    ("/v1/completions", _completion(allowed_token_ids=[65], bad_words=["A"]), None),
    ("/v1/completions", _completion(allowed_token_ids=[65], guided_regex="[0-9]+"), None),   # emitted digits
    # found by the deep fuzz below (a node anywhere in the body replaced): tool schemas read for K3's argument form
    ("/v1/chat/completions", _tool_chat({"type": "object", "properties": {"a": {"type": "string"}}, "required": 1}),
     None),
    ("/v1/chat/completions", _tool_chat({"type": "object", "properties": {"a": {}}, "required": [{"a": 1}]}), None),
    ("/v1/chat/completions", _tool_chat({"type": "object", "properties": {"a": {"type": {"x": 1}}}}), None),
    ("/v1/chat/completions", _tool_chat({"type": "object", "properties": {"a": {"type": ["string", {}]}}}), None),
    ("/v1/responses", {"model": MODEL, "input": [{"role": ["user"], "content": "hi"}]}, "input[0].role"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "reasoning": {"effort": {"x": 1}}}, "reasoning.effort"),
    ("/v1/responses", {"model": MODEL, "input": [{"type": "reasoning", "content": 5}]}, "input[0].content"),
]

VALID = {
    "/v1/chat/completions": _chat(temperature=0.5, stop=["x"], logprobs=True, top_logprobs=2, n=2, seed=1,
                                  response_format={"type": "json_object"}, logit_bias={"5": 1.0}),
    "/v1/completions": _completion(prompt=["a", "b"], echo=True, logprobs=1, guided_regex="[a-z]{1,3}",
                                   stop_token_ids=[3]),
    "/v1/responses": {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
                      "max_output_tokens": 2, "instructions": "be brief", "text": {"format": {"type": "text"}}},
    "/tokenize": {"model": MODEL, "messages": MSGS, "return_token_strs": True},
    "/detokenize": {"model": MODEL, "tokens": [1, 2, 3]},
    "/v1/chat/completions tools": _chat(
        tools=[{"type": "function", "function": {"name": "get", "description": "d", "parameters": {
            "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a"]}}}],
        tool_choice={"type": "function", "function": {"name": "get"}}, parallel_tool_calls=False,
        messages=[{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        thinking={"type": "enabled", "keep": "all", "effort": "high"}),
}


def _value(rng: random.Random, depth: int = 0):
    kinds = ["int", "neg", "big", "float", "str", "digits", "bool", "null", "list", "dict", "deep"]
    kind = rng.choice(kinds if depth < 2 else kinds[:8])
    if kind == "int":
        return rng.randint(0, 5)
    if kind == "neg":
        return -rng.randint(1, 10**6)
    if kind == "big":
        return rng.choice([2**63, 2**64 + 1, 10**30, -(2**63) - 1])
    if kind == "float":
        return rng.choice([0.5, -1e308, 1e308, 3.0])
    if kind == "str":
        return rng.choice(["", "x", "²", "٣", "\u0000", "a" * 3000, "{", "[1]", "null", "\ud800"])
    if kind == "digits":
        return {rng.choice(["²", "٣", "-1", "1e3", " 1", "99999999999"]): rng.choice([1, 1e9, "x"])}
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "dict":
        return {rng.choice(["type", "text", "role", "content", "x"]): _value(rng, depth + 1) for _ in range(2)}
    return json.loads("[" * 300 + "]" * 300) if rng.random() < 0.5 else {"a": [[[[[{"b": [[[]]]}]]]]]}


def _nodes(value, path=()) -> list[tuple]:
    """The path of every node under the top level of a JSON value."""
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    out = [path] if path else []
    for key, child in children:
        out += _nodes(child, path + (key,))
    return out


def _replace_deep(rng: random.Random, body: dict) -> None:
    """A node anywhere in the body (a tool schema's ``required``, a message part's ``type``) replaced or removed."""
    path = rng.choice([p for p in _nodes(body) if len(p) > 1] or [None])
    if path is None:
        return
    parent = body
    for key in path[:-1]:
        parent = parent[key]
    if isinstance(parent, dict) and rng.random() < 0.2:
        del parent[path[-1]]
    else:
        parent[path[-1]] = _value(rng)


def _mutate(rng: random.Random, body: dict) -> bytes:
    body = json.loads(json.dumps(body))
    for _ in range(rng.randint(1, 3)):
        op = rng.random()
        keys = list(body)
        if op < 0.3:
            _replace_deep(rng, body)
        elif op < 0.55 and keys:
            body[rng.choice(keys)] = _value(rng)
        elif op < 0.7 and keys:
            del body[rng.choice(keys)]
        elif op < 0.8:
            body[rng.choice(["extra", "n", "max_tokens", "stream", "tools", "tool_choice", "prompt_logprobs",
                             "guided_choice", "structured_outputs", "chat_template_kwargs"])] = _value(rng)
        elif op < 0.9 and "messages" in body:
            body["messages"] = [{"role": rng.choice(["user", "system", "tool", "x", 5]), "content": _value(rng)}]
        elif "input" in body:
            body["input"] = [{"type": rng.choice(["message", "reasoning", "function_call", "function_call_output"]),
                              "role": "user", "content": _value(rng), "output": _value(rng)}]
    raw = json.dumps(body, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
    if rng.random() < 0.1:
        raw = raw[: rng.randint(0, len(raw))]
    return raw


@pytest.fixture(scope="module")
def server():
    s = start_fake_server(engine_kw={"max_model_len": 512})
    yield s
    s.stop()


def _post(client, server, route: str, raw: bytes) -> httpx.Response:
    return client.post(server.url + route, content=raw, headers={"content-type": "application/json"})


def test_known_500s_are_400s(server):
    with httpx.Client(timeout=60) as c:
        for route, body, param in KNOWN:
            r = _post(c, server, route, json.dumps(body).encode())
            assert r.status_code == 400, (route, r.text[:300])
            if param is not None:
                assert r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("name", list(VALID))
def test_random_malformed_bodies_are_never_5xx(server, name):
    rng = random.Random(f"kimik3-fuzz-{name}")
    route = name.split()[0]
    with httpx.Client(timeout=60) as c:
        assert _post(c, server, route, json.dumps(VALID[name]).encode()).status_code == 200
        for i in range(60):
            raw = _mutate(rng, VALID[name])
            r = _post(c, server, route, raw)
            assert r.status_code < 500, (i, raw[:400], r.text[:400])
    assert server.state.loop.alive
