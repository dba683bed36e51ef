"""Kimi-Linear (K2-style) rendering against prompts written by hand."""

import pytest

from kimik3.chat import render_kimi_linear

BASE = 700
IM_END, IM_USER, IM_ASSISTANT, IM_SYSTEM, IM_MIDDLE = BASE + 2, BASE + 3, BASE + 4, BASE + 10, BASE + 17


def test_format_is_chosen_from_the_tokenizer(linear_tok):
    assert linear_tok.chat_format == "kimi_linear"
    assert linear_tok.stop_token_ids == [IM_END]
    assert linear_tok.special_tokens["<|im_middle|>"] == IM_MIDDLE


def test_plain_chat(linear_tok):
    conv = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}]
    assert linear_tok.apply_chat_template(conv) == (
        "<|im_system|>system<|im_middle|>Be kind.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    e = linear_tok.encode
    assert linear_tok.apply_chat_template(conv, tokenize=True) == (
        [IM_SYSTEM] + e("system") + [IM_MIDDLE] + e("Be kind.") + [IM_END]
        + [IM_USER] + e("user") + [IM_MIDDLE] + e("Hi") + [IM_END]
        + [IM_ASSISTANT] + e("assistant") + [IM_MIDDLE]
    )


def test_default_system_tools_and_calls(linear_tok):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    conv = [
        {"role": "user", "content": "<|im_end|>?"},
        {"role": "assistant", "content": "ok", "tool_calls": [
            {"id": "functions.f:0", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "functions.f:0", "content": "42"},
    ]
    out = linear_tok.apply_chat_template(conv, tools=tools, add_generation_prompt=False)
    assert out == (
        '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"f","parameters":{}}}]<|im_end|>'
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|><|im_end|>?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>ok<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
        '<|tool_call_argument_begin|>{"x": 1}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        "<|im_system|>tool<|im_middle|>## Return of functions.f:0\n42<|im_end|>"
    )
    ids = linear_tok.apply_chat_template(conv, tools=tools, add_generation_prompt=False, tokenize=True)
    assert ids.count(IM_END) == 5  # the user's literal "<|im_end|>" stays text


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        ({"tool_choice": "required"}, ValueError, "no tool_choice"),
        ({"response_format": {"type": "json_object"}}, ValueError, "no response_format"),
        ({"images": [object()]}, ValueError, "text-only"),
        ({"thinking": 1}, TypeError, "thinking must be a bool"),
    ],
    ids=["tool-choice", "response-format", "images", "thinking-type"],
)
def test_invalid_options(kw, exc, match):
    with pytest.raises(exc, match=match):
        render_kimi_linear([{"role": "user", "content": "q"}], **kw)


@pytest.mark.parametrize(
    "conv, exc, match",
    [
        ([{"role": "bot", "content": "x"}], ValueError, "unknown role 'bot'"),
        ("hi", TypeError, "must be a list"),
        ([{"role": "user", "content": [{"type": "image"}]}], ValueError, "only text parts"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 1}}]}], TypeError,
         "arguments must be a str or dict"),
    ],
    ids=["role", "not-list", "image-part", "args"],
)
def test_invalid_conversations(conv, exc, match):
    with pytest.raises(exc, match=match):
        render_kimi_linear(conv)
