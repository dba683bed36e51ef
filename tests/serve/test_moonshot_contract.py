"""Moonshot's request contract on the server: the ``thinking`` object (type / keep / effort), every K3
``chat_template_kwargs`` key (unknown keys a 400 naming them), the efforts the K3 prompt lists (medium
included), OpenAI's ``developer`` role; each prompt compared with the tokenizer's own rendering."""

from __future__ import annotations

import openai
import pytest

from kimik3.serve.chat import build_chat_prompt
from kimik3.serve.protocol import APIError, ChatCompletionRequest
from tests.serve.conftest import MODEL, start_fake_server
from tests.serve.test_api import TOK

HISTORY = [{"role": "user", "content": "a"},
           {"role": "assistant", "reasoning_content": "old thought", "content": "b"},
           {"role": "user", "content": "c"},
           {"role": "assistant", "reasoning_content": "loop thought", "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
DROPPED = [HISTORY[0], {"role": "assistant", "content": "b"}, *HISTORY[2:]]


def ids(**body):
    req = ChatCompletionRequest.model_validate({"messages": HISTORY, **body})
    return build_chat_prompt(req, TOK, None, False).token_ids


def render(messages=HISTORY, **kw):
    return TOK.apply_chat_template(messages, tokenize=True, **kw)


@pytest.mark.parametrize("body,want", [
    ({}, {}),
    ({"thinking": {"type": "disabled"}}, {"thinking": False}),
    ({"thinking": {"type": "enabled", "keep": "all", "effort": "high"}}, {"thinking_effort": "high"}),
    ({"thinking": {"type": "enabled", "effort": "medium"}}, {"thinking_effort": "medium"}),
    ({"reasoning_effort": "medium"}, {"thinking_effort": "medium"}),
    ({"reasoning_effort": "low"}, {"thinking_effort": "low"}),
    ({"reasoning_effort": "none"}, {"thinking": False}),
    ({"chat_template_kwargs": {"enable_thinking": False}}, {"thinking": False}),
    ({"chat_template_kwargs": {"thinking": True, "thinking_effort": None}}, {"thinking_effort": None}),
    ({"chat_template_kwargs": {"preserve_thinking": True}}, {}),
], ids=["default", "type-disabled", "object", "object-medium", "effort-medium", "effort-low", "effort-none",
        "enable-thinking", "no-effort-message", "preserve"])
def test_thinking_controls_render_as_the_tokenizer_does(body, want):
    assert ids(**body) == render(**want)


@pytest.mark.parametrize("body", [{"thinking": {"type": "enabled", "keep": None}},
                                  {"chat_template_kwargs": {"preserve_thinking": False}}],
                         ids=["keep-null", "preserve-false"])
def test_not_preserved_drops_the_reasoning_of_earlier_turns_only(body):
    got = ids(**body)
    assert got == render(DROPPED) != render()
    assert "loop thought" in TOK.decode(got) and "old thought" not in TOK.decode(got)


def test_developer_role_is_the_system_prompt():
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    req = ChatCompletionRequest.model_validate({"messages": msgs})
    assert build_chat_prompt(req, TOK, None, False).token_ids == render([{**msgs[0], "role": "system"}, msgs[1]])


@pytest.mark.parametrize("body,param", [
    ({"chat_template_kwargs": {"preserve_thinking": True, "magic": 1}}, "chat_template_kwargs.magic"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs.enable_thinking"),
    ({"chat_template_kwargs": {"thinking_effort": "huge"}}, "chat_template_kwargs.thinking_effort"),
    ({"thinking": {"type": "maybe"}}, "thinking.type"),
    ({"thinking": {"type": "enabled", "keep": "some"}}, "thinking.keep"),
    ({"thinking": {"type": "enabled", "budget": 5}}, "thinking.budget"),
    ({"thinking": {"type": "disabled"}, "chat_template_kwargs": {"thinking": True}}, "thinking.type"),
    ({"thinking": {"effort": "low"}, "reasoning_effort": "high"}, "reasoning_effort"),
    ({"reasoning_effort": "minimal"}, "reasoning_effort"),
], ids=["unknown-key", "not-bool", "bad-effort", "bad-type", "bad-keep", "unknown-thinking-key", "conflict",
        "conflicting-effort", "minimal"])
def test_bad_or_unknown_options_are_400_naming_them(body, param):
    with pytest.raises(APIError) as e:
        ids(**body)
    assert e.value.status == 400 and e.value.param == param and param.split(".")[-1] in e.value.message


@pytest.fixture(scope="module")
def server():
    s = start_fake_server()
    yield s
    s.stop()


def test_through_the_openai_client(server):
    c = server.client()
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, reasoning_effort="medium",
                                  extra_body={"thinking": {"type": "enabled", "keep": "all"},
                                              "chat_template_kwargs": {"preserve_thinking": True}})
    want = render([{**msgs[0], "role": "system"}, msgs[1]], thinking_effort="medium")
    assert r.usage.prompt_tokens == len(want)
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs.magic") as e:
        c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                  extra_body={"chat_template_kwargs": {"magic": True}})
    assert e.value.body["param"] == "chat_template_kwargs.magic"
