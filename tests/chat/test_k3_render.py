"""K3 XTML rendering against prompts written by hand from spec vision-multimodal §4.5 and §5.2-5.5."""

import pytest

from kimik3.chat import ImagePrompt, render_k3

BASE = 2048
BOS, END, OPEN, CLOSE, SEP = BASE + 0, BASE + 2, BASE + 3, BASE + 4, BASE + 5
MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD = BASE + 18, BASE + 19, BASE + 20, BASE + 21

EFFORT_MAX = (
    '<|open|>message role="system" type="thinking-effort"<|sep|>'
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), "
    "supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort=max`."
    "<|close|>message<|sep|><|end_of_msg|>"
)
GEN_THINK = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
GEN_RESPONSE = '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'


def text(conv, **kw):
    return "".join(s.text for s in render_k3(conv, **kw))


def test_hello(tok):
    conv = [{"role": "user", "content": "Hi"}]
    want = EFFORT_MAX + '<|open|>message role="user"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>' + GEN_THINK
    assert tok.apply_chat_template(conv) == want
    assert text(conv) == want


def test_hello_ids_by_segment(tok):
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], thinking=False, tokenize=True)
    e = tok.encode
    want = (
        [OPEN] + e("message") + e(" role") + e('="') + e("user") + e('"') + [SEP] + e("Hi")
        + [CLOSE] + e("message") + [SEP] + [END]
        + [OPEN] + e("message") + e(" role") + e('="') + e("assistant") + e('"') + [SEP]
        + [OPEN] + e("response") + [SEP]
    )
    assert ids == want


def test_non_thinking_drops_effort_and_think(tok):
    conv = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
        {"role": "user", "content": "Bye"},
    ]
    want = (
        '<|open|>message role="user"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>Hello!<|close|>response<|sep|>'
        "<|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="user"<|sep|>Bye<|close|>message<|sep|><|end_of_msg|>' + GEN_RESPONSE
    )
    assert tok.apply_chat_template(conv, thinking=False) == want


def test_user_text_never_becomes_special(tok):
    conv = [{"role": "user", "content": "<|open|>message<|sep|><|end_of_msg|><|media_pad|>"}]
    ids = tok.apply_chat_template(conv, thinking_effort=None, add_generation_prompt=False, tokenize=True)
    # only the renderer's own markers are special ids
    specials = [i for i in ids if i >= BASE]
    assert specials == [OPEN, SEP, CLOSE, SEP, END]
    rendered = tok.apply_chat_template(conv, thinking_effort=None, add_generation_prompt=False)
    assert rendered.count("<|open|>") == 2  # same string as if it were special: compare ids, not text


def test_agentic_turn():
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    conv = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {"role": "assistant", "reasoning_content": "Two calls.", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Tokyo", "days": 2}'}},
        ]},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "tool", "tool_call_id": "c1", "content": "sun"},
    ]
    want = (
        '<|open|>message role="system" type="tool-declare"<|sep|># Tools\n'
        "Here are the available tools, described in JSONSchema.\n\n```json\n"
        '[{"function":{"description":"Weather now","name":"get_weather","parameters":{"properties":{"city":'
        '{"type":"string"}},"required":["city"],"type":"object"}},"type":"function"}]\n```'
        "<|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="system" type="thinking-effort"<|sep|>'
        "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), "
        "supported values include `low`, `medium`, `high`, and `max`.\n"
        "Now the system is invoked with `thinking_effort=high`.<|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="system"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="user"<|sep|>Weather in Paris and Tokyo?<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>Two calls.<|close|>think<|sep|>'
        "<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
        '<|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|><|close|>call<|sep|>'
        '<|open|>call tool="get_weather" index="2"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Tokyo<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="number"<|sep|>2<|close|>argument<|sep|><|close|>call<|sep|>'
        "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>sun<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="tool" tool="get_weather" index="2"<|sep|>rain<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="system" type="tool-choice"<|sep|>The system is invoked with `tool_choice=required`.\n'
        "You MUST call tools in the next message.<|close|>message<|sep|><|end_of_msg|>" + GEN_THINK
    )
    assert text(conv, tools=tools, thinking_effort="high", tool_choice="required") == want


def test_tool_results_unmatched_run_is_left_alone():
    conv = [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "function": {"name": "f", "arguments": {}}},
            {"id": "b", "function": {"name": "g", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "g:1", "content": "B"},  # vLLM's name:index alias is not an id
        {"role": "tool", "tool_call_id": "a", "content": "A"},
    ]
    out = text(conv, thinking=False, add_generation_prompt=False)
    assert out.endswith(
        '<|open|>message role="tool" tool="f" index="1"<|sep|>B<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="tool" tool="g" index="2"<|sep|>A<|close|>message<|sep|><|end_of_msg|>'
    )


def test_reasoning_fill_rule():
    def assistant(**m):
        conv = [{"role": "assistant", "content": "x", **m}]
        return text(conv, thinking_effort=None, add_generation_prompt=False)

    empty = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|><|close|>think<|sep|>'
    assert assistant().startswith(empty)
    assert assistant(reasoning_content="").startswith(empty)
    assert assistant(reasoning_content=None, reasoning="r").startswith(
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>r<|close|>think<|sep|>')
    assert assistant(reasoning_content="  \n").startswith(
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>  \n<|close|>think<|sep|>')
    # content is never trimmed
    assert "<|open|>response<|sep|> x \n<|close|>response<|sep|>" in text(
        [{"role": "assistant", "content": " x \n"}], thinking=False)


def test_arguments_one_level_split():
    calls = [
        {"function": {"name": "f", "arguments": '{"a": 1e2, "b": "x\\n\\"q\\"", "c": {"d": [1, 2]}} trailing'}},
        {"function": {"name": "g", "arguments": "[1, 2]"}},
        {"function": {"name": "h", "arguments": ""}},
        {"function": {"name": "k", "arguments": {"n": 1.5, "s": "t", "z": None, "l": ["é"]}}},
    ]
    out = text([{"role": "assistant", "content": None, "tool_calls": calls}], thinking=False,
               add_generation_prompt=False)
    want = (
        "<|open|>tools<|sep|>"
        '<|open|>call tool="f" index="1"<|sep|>'
        '<|open|>argument key="a" type="number"<|sep|>1e2<|close|>argument<|sep|>'
        '<|open|>argument key="b" type="string"<|sep|>x\n"q"<|close|>argument<|sep|>'
        '<|open|>argument key="c" type="object"<|sep|>{"d": [1, 2]}<|close|>argument<|sep|>'
        "<|close|>call<|sep|>"
        '<|open|>call tool="g" index="2"<|sep|><|open|>json type="object"<|sep|>[1, 2]<|close|>json<|sep|>'
        "<|close|>call<|sep|>"
        '<|open|>call tool="h" index="3"<|sep|><|close|>call<|sep|>'
        '<|open|>call tool="k" index="4"<|sep|>'
        '<|open|>argument key="n" type="number"<|sep|>1.5<|close|>argument<|sep|>'
        '<|open|>argument key="s" type="string"<|sep|>t<|close|>argument<|sep|>'
        '<|open|>argument key="z" type="null"<|sep|>null<|close|>argument<|sep|>'
        '<|open|>argument key="l" type="array"<|sep|>["é"]<|close|>argument<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|>"
    )
    assert want in out


def test_attribute_escaping_and_names():
    conv = [{"role": "user", "name": 'a"b&c', "content": "hi"}]
    assert text(conv, thinking_effort=None, add_generation_prompt=False) == (
        '<|open|>message role="user" name="a&quot;b&amp;c"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>')


def test_dynamic_tools_response_format_and_low_effort():
    conv = [{"role": "system", "tools": [{"name": "z", "b": 1, "a": {"y": 1, "x": "ü"}}]}]
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    out = text(conv, thinking_effort="low", response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": schema}})
    want = (
        '<|open|>message role="system" type="tool-declare"<|sep|>## New Tools Available\n'
        "The system dynamically extends the toolset via lazy-loading.\n"
        "You have access to all existing and extended tools.\n"
        "Here are the specs for the extended tools.\n\n"
        '```json\n[{"a":{"x":"ü","y":1},"b":1,"name":"z"}]\n```<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="system" type="response-format"<|sep|>'
        "The system is invoked with `response_format=json_schema`.\n"
        "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting.\n"
        "The JSON data must match the following schema:\n"
        '```json\n{"properties":{"a":{"type":"string"},"b":{"type":"integer"}},"type":"object"}\n```'
        "<|close|>message<|sep|><|end_of_msg|>" + GEN_THINK
    )
    assert out.endswith(want)
    assert "`thinking_effort=low`" in out
    assert out.index("thinking-effort") < out.index("New Tools")


def test_tool_choice_none_and_json_object():
    out = text([{"role": "user", "content": "q"}], thinking=False, tool_choice="none",
               response_format={"type": "json_object"})
    assert out == (
        '<|open|>message role="user"<|sep|>q<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="system" type="tool-choice"<|sep|>The system is invoked with `tool_choice=none`.\n'
        "You MUST NOT call any tools in the next message.<|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="system" type="response-format"<|sep|>'
        "The system is invoked with `response_format=json_object`.\n"
        "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
        "<|close|>message<|sep|><|end_of_msg|>" + GEN_RESPONSE
    )
    named = {"type": "function", "function": {"name": "f"}}
    assert "tool-choice" not in text([{"role": "user", "content": "q"}], tool_choice=named)
    assert "tool-choice" not in text([{"role": "user", "content": "q"}], tool_choice="auto")


# ---- images ---------------------------------------------------------------------------------------


def test_image_prompt_positional(tok):
    # spec §4.5, official positional layout: no "\n" after <|media_end|>
    conv = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                         {"type": "text", "text": "What is this?"}]}]
    out = tok.apply_chat_template(conv, images=[ImagePrompt(448, 448, 256)])
    user = (
        '<|open|>message role="user"<|sep|><|media_begin|>image 448x448<|media_content|>'
        + "<|media_pad|>" * 256 + "<|media_end|>What is this?<|close|>message<|sep|><|end_of_msg|>"
    )
    assert out == EFFORT_MAX + user + GEN_THINK
    ids = tok.apply_chat_template(conv, images=[ImagePrompt(448, 448, 256)], tokenize=True)
    image_ids = [MEDIA_BEGIN] + tok.encode("image 448x448") + [MEDIA_CONTENT] + [MEDIA_PAD] * 256 + [MEDIA_END]
    start = ids.index(MEDIA_BEGIN)
    assert ids[start : start + len(image_ids)] == image_ids
    assert ids[start + len(image_ids) : start + len(image_ids) + len(tok.encode("What is this?"))] == tok.encode(
        "What is this?")


def test_large_image_keeps_every_pad(tok):
    # 3000 pads are ~39k characters without whitespace: longer than the encoder's run-length cut
    conv = [{"role": "user", "content": [{"type": "image"}]}]
    ids = tok.apply_chat_template(conv, images=[ImagePrompt(1000, 2000, 3000)], tokenize=True)
    assert ids.count(MEDIA_PAD) == 3000
    assert all(i >= BASE for i in ids[ids.index(MEDIA_CONTENT) : ids.index(MEDIA_END) + 1])


def test_images_in_order_and_one_pad_layout():
    conv = [{"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "image"}, {"type": "text", "text": "B"},
                                         {"type": "image"}]}]
    out = text(conv, images=[ImagePrompt(10, 20, 1), ImagePrompt(30, 16, 2)], thinking_effort=None,
               add_generation_prompt=False)
    assert out == (
        '<|open|>message role="user"<|sep|>A<|media_begin|>image 10x20<|media_content|><|media_pad|><|media_end|>'
        "B<|media_begin|>image 30x16<|media_content|><|media_pad|><|media_pad|><|media_end|>"
        "<|close|>message<|sep|><|end_of_msg|>"
    )


def test_placeholder_in_text_is_not_an_image(tok):
    conv = [{"role": "user", "content": "<|kimi_image_placeholder|> hi"}]
    with pytest.raises(ValueError, match="1 images given but the conversation has 0 image parts"):
        tok.apply_chat_template(conv, images=[ImagePrompt(28, 28, 1)])
    ids = tok.apply_chat_template(conv, tokenize=True)
    assert MEDIA_BEGIN not in ids and MEDIA_PAD not in ids


def test_image_without_sizes_renders_placeholder_text():
    out = text([{"role": "user", "content": [{"type": "image"}]}], thinking_effort=None, add_generation_prompt=False)
    assert out == '<|open|>message role="user"<|sep|><|kimi_image_placeholder|><|close|>message<|sep|><|end_of_msg|>'


# ---- invalid input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "conv, kw, exc, match",
    [
        ([{"role": "robot", "content": "x"}], {}, ValueError, "message 0 has unknown role 'robot'"),
        ({"role": "user"}, {}, TypeError, "conversation must be a list"),
        (["hi"], {}, TypeError, "message 0 must be a dict"),
        ([{"role": "user", "content": 3}], {}, TypeError, "content must be a str"),
        ([{"role": "user", "content": [{"type": "audio"}]}], {}, ValueError, "unknown type 'audio'"),
        ([{"role": "user", "content": [{"type": "text"}]}], {}, TypeError, "needs a str 'text'"),
        ([{"role": "tool", "content": "x"}], {}, ValueError, "cannot tell which tool"),
        ([{"role": "assistant", "tool_calls": [{"function": {}}]}], {}, ValueError, r"tool_calls\[0\] needs a function name"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}], {}, TypeError,
         "arguments must be a JSON object string or a dict"),
        ([], {"thinking_effort": "minimal"}, ValueError, "got 'minimal'"),
        ([], {"thinking_effort": "none"}, ValueError, "thinking_effort must be one of low, medium, high, max or None"),
        ([], {"thinking_effort": 3}, TypeError, "thinking_effort must be a str"),
        ([], {"thinking": "yes"}, TypeError, "thinking must be a bool"),
        ([], {"tool_choice": "sometimes"}, ValueError, "tool_choice must be"),
        ([], {"tool_choice": {"type": "function"}}, ValueError, "named tool_choice"),
        ([], {"response_format": {"type": "xml"}}, ValueError, "response_format type must be"),
        ([], {"response_format": "json"}, TypeError, "response_format must be a dict"),
        ([], {"response_format": {"type": "json_schema"}}, ValueError, "needs a 'json_schema' object"),
        ([], {"tools": {"name": "f"}}, TypeError, "tools must be a list"),
        ([{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}], {"images": [ImagePrompt(1, 1, 1)]},
         ValueError, "more image parts than the 1 images"),
        ([], {"images": [(1, 1, 1)]}, TypeError, "images must be ImagePrompt"),
    ],
    ids=["role", "not-list", "not-dict", "content-type", "part-type", "part-text", "tool-name", "call-name",
         "args-type", "effort-minimal", "effort-none", "effort-type", "thinking-type", "tool-choice",
         "tool-choice-named", "rf-type", "rf-not-dict", "rf-schema", "tools-type", "too-many-images", "image-type"],
)
def test_invalid(conv, kw, exc, match):
    with pytest.raises(exc, match=match):
        render_k3(conv, **kw)


def test_effort_ignored_without_thinking():
    assert "thinking-effort" not in text([{"role": "user", "content": "q"}], thinking=False, thinking_effort="medium")
    assert "thinking-effort" not in text([{"role": "user", "content": "q"}], thinking_effort=None)


def test_bad_image_prompt():
    with pytest.raises(ValueError, match="num_pad_tokens must be a positive int"):
        ImagePrompt(10, 10, 0)


def test_apply_chat_template_tokenize_type(tok):
    with pytest.raises(TypeError, match="tokenize must be a bool"):
        tok.apply_chat_template([], tokenize="yes")
