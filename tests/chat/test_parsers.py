"""K3 output parsing: fixed examples, then fuzzing (random, truncated, re-chunked inputs)."""

import json
import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kimik3.chat import K3OutputParser, ToolCall, parse_k3_output, render_k3

FULL = (
    "Need two lookups.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|>"
    "<|open|>tools<|sep|>"
    '<|open|>call tool="get_weather" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
    '<|open|>argument key="days" type="number"<|sep|>1e2<|close|>argument<|sep|><|close|>call<|sep|>'
    '<|open|>call tool="search" index="2"<|sep|>'
    '<|open|>argument key="q" type="string"<|sep|>a "quoted" <b><|close|>argument<|sep|>'
    '<|open|>argument key="opts" type="object"<|sep|>{"n": [1, true, null]}<|close|>argument<|sep|>'
    '<|open|>argument key="exact" type="boolean"<|sep|>false<|close|>argument<|sep|><|close|>call<|sep|>'
    '<|open|>call tool="raw" index="3"<|sep|><|open|>json type="object"<|sep|>{"v": [1, NaN], "w": -Infinity}'
    "<|close|>json<|sep|><|close|>call<|sep|>"
    "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
)
FULL_CALLS = [
    ToolCall("get_weather", '{"city": "Paris", "days": 1e2}', 0),
    ToolCall("search", '{"q": "a \\"quoted\\" <b>", "opts": {"n": [1, true, null]}, "exact": false}', 1),
    ToolCall("raw", '{"v": [1, null], "w": null}', 2),
]


def test_full_message():
    out = parse_k3_output(FULL)
    assert out.reasoning_content == "Need two lookups."
    assert out.content == "Checking."
    assert out.tool_calls == FULL_CALLS
    assert json.loads(out.tool_calls[1].arguments) == {"q": 'a "quoted" <b>', "opts": {"n": [1, True, None]},
                                                       "exact": False}


def test_plain_answer_and_non_thinking():
    out = parse_k3_output("hmm<|close|>think<|sep|><|open|>response<|sep|>Hi!<|close|>response<|sep|>"
                          "<|close|>message<|sep|>")
    assert (out.reasoning_content, out.content, out.tool_calls) == ("hmm", "Hi!", [])
    out = parse_k3_output("Hi!<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>", thinking=False)
    assert (out.reasoning_content, out.content, out.tool_calls) == (None, "Hi!", [])


def test_think_open_in_output_is_consumed():
    out = parse_k3_output("<|open|>think<|sep|>r<|close|>think<|sep|><|open|>response<|sep|>c")
    assert (out.reasoning_content, out.content) == ("r", "c")


def test_attribute_unescaping():
    text = ('<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
            '<|open|>call tool="a&quot;b&amp;c" index="1"<|sep|>'
            '<|open|>argument key="k&amp;&quot;" type="string"<|sep|>v<|close|>argument<|sep|><|close|>call<|sep|>')
    out = parse_k3_output(text, thinking=False)
    assert out.tool_calls == [ToolCall('a"b&c', '{"k&\\"": "v"}', 0)]


def test_streaming_deltas():
    p = K3OutputParser()
    assert p.feed("Let me").reasoning == "Let me"
    d = p.feed(" think<|clo")
    assert d.reasoning == " think" and not d.content  # "<|clo" held back: it may be a marker
    d = p.feed("se|>think<|sep|><|open|>resp")
    assert not d
    d = p.feed("onse<|sep|>Answer <|open|>x")  # "<|open|>x" cannot end the response, but may be an element
    assert d.content == "Answer "
    d = p.feed('<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>')
    assert not d.tool_calls and not d.content
    d = p.feed("<|close|>call<|sep|>")
    assert d.tool_calls == [ToolCall("f", "{}", 0)]
    assert not p.feed("<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>")
    assert p.finish().content == " x"      # the lone control token is a space, never text


BAD_JSON_CALL = (
    '<|open|>call tool="f" index="1"<|sep|><|open|>argument key="n" type="number"<|sep|>12a'
    "<|close|>argument<|sep|><|close|>call<|sep|>"
)
MISMATCH_CALL = (
    '<|open|>call tool="f"<|sep|><|open|>argument key="n" type="number"<|sep|>"1"<|close|>argument<|sep|>'
    "<|close|>call<|sep|>"
)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        # bad JSON in a typed argument: the call is dropped
        (BAD_JSON_CALL, "", []),
        # declared type does not match the value
        (MISMATCH_CALL, "", []),
        # unknown tool
        ('<|open|>call tool="nope"<|sep|><|close|>call<|sep|><|open|>call tool="f"<|sep|><|close|>call<|sep|>',
         "", [ToolCall("f", "{}", 0)]),
        # a json block that is not JSON, or not an object
        ('<|open|>call tool="f"<|sep|><|open|>json type="object"<|sep|>not json {<|close|>json<|sep|><|close|>call<|sep|>',
         "", []),
        ('<|open|>call tool="f"<|sep|><|open|>json type="object"<|sep|>[1]<|close|>json<|sep|><|close|>call<|sep|>',
         "", []),
        # garbage inside the tools section: text, its markup a space
        ("oops<|close|>tools<|sep|>", "oops ", []),
        # call without a name
        ('<|open|>call index="1"<|sep|><|close|>call<|sep|>', "", []),
    ],
    ids=["bad-json", "type-mismatch", "unknown-tool", "json-block-not-json", "json-block-not-object", "garbage",
         "no-name"],
)
def test_malformed_calls_are_dropped(caplog, text, content, calls):
    prefix = "<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
    with caplog.at_level(logging.WARNING, logger="kimik3.chat.parsers"):
        out = parse_k3_output(prefix + text, thinking=False, tools=["f"])
    assert out.content == content
    assert out.tool_calls == calls
    assert any(r.levelno == logging.WARNING for r in caplog.records)


@pytest.mark.parametrize("text", [
    '{"x": NaN, "y": [Infinity, -Infinity, 1.5]}',
    '<|open|>argument key="x" type="number"<|sep|>NaN<|close|>argument<|sep|>'
    '<|open|>argument key="y" type="array"<|sep|>[Infinity, -Infinity, 1.5]<|close|>argument<|sep|>',
], ids=["json-block", "typed-arguments"])
def test_non_finite_numbers_become_null(text):
    body = f'<|open|>json type="object"<|sep|>{text}<|close|>json<|sep|>' if text.startswith("{") else text
    out = parse_k3_output('<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
                          + body + "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>",
                          thinking=False, tools=["f"])
    (call,) = out.tool_calls
    strict = json.loads(call.arguments, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert strict == {"x": None, "y": [None, None, 1.5]}


CUT = ("Let me see.<|close|>think<|sep|><|open|>response<|sep|>On it.<|close|>response<|sep|><|open|>tools<|sep|>"
       '<|open|>call tool="calc" index="1"<|sep|><|open|>argument key="e" type="string"<|sep|>1+1'
       "<|close|>argument<|sep|><|close|>call<|sep|>"
       '<|open|>call tool="calc" index="2"<|sep|><|open|>argument key="e" type="string"<|sep|>2*3'
       "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>")


@pytest.mark.parametrize("thinking", [True, False], ids=["think", "no-think"])
def test_cut_output_never_shows_control_text(thinking):
    """Every cut of a message with calls, parsed one-shot and streamed in pieces: no content or
    reasoning ever holds a control token, and the finished calls are kept."""
    text = CUT if thinking else CUT[CUT.index("On it."):]
    full = _one_shot(text, thinking)
    assert [c.name for c in full[2]] == ["calc", "calc"]
    for n in range(len(text) + 1):
        reasoning, content, calls = _one_shot(text[:n], thinking)
        for part in (reasoning, content):
            assert not any(tok in part for tok in ("<|open|>", "<|close|>", "<|sep|>")), (n, part)
        assert calls == full[2][:len(calls)]
        assert _parse_chunked(text[:n], [n // 4, n // 2, max(0, n - 3)], thinking) == (reasoning, content, calls)


@pytest.mark.parametrize("cuts", [[], [5, 17], list(range(0, 60, 3))])
def test_response_closed_but_never_opened(cuts):
    text = "The answer is 42.<|close|>response<|sep|><|close|>message<|sep|>"
    assert _one_shot(text, True) == ("The answer is 42.", "The answer is 42.", [])
    assert _parse_chunked(text, cuts, True) == ("The answer is 42.", "The answer is 42.", [])


@pytest.mark.parametrize("cuts", [[], [9, 30, 31], list(range(0, 200, 7))])
def test_tools_inside_an_unclosed_think(cuts):
    text = ('Thinking<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|><|open|>argument key="a" '
            'type="number"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
            "<|close|>message<|sep|>")
    want = ("Thinking", "", [ToolCall("f", '{"a": 3}', 0)])
    assert _one_shot(text, True) == want and _parse_chunked(text, cuts, True) == want


def test_unclosed_think_is_reasoning(caplog):
    with caplog.at_level(logging.DEBUG, logger="kimik3.chat.parsers"):
        out = parse_k3_output("still thinking <|clo")
    assert (out.reasoning_content, out.content) == ("still thinking <|clo", "")
    # a length-cut answer: noted at debug level, never a warning
    assert [r.levelno for r in caplog.records if "never closed" in r.getMessage()] == [logging.DEBUG]


def test_text_after_end_is_content(caplog):
    with caplog.at_level(logging.WARNING, logger="kimik3.chat.parsers"):
        out = parse_k3_output("a<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|> more", thinking=False)
    assert out.content == "a more"
    assert "after the end" in caplog.text


def test_response_without_channel_markers(caplog):
    with caplog.at_level(logging.WARNING, logger="kimik3.chat.parsers"):
        out = parse_k3_output("r<|close|>think<|sep|>plain answer")
    assert (out.reasoning_content, out.content) == ("r", "plain answer")
    assert caplog.records


def test_feed_type_and_after_finish():
    p = K3OutputParser()
    with pytest.raises(TypeError, match="takes text"):
        p.feed(b"x")
    p.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        p.feed("x")


# ---- fuzzing --------------------------------------------------------------------------------------

PIECES = [
    "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "think", "response", "tools", "call", "argument",
    "json", "message", ' tool="f"', ' index="1"', ' key="k"', ' type="string"', ' type="number"', ' type="object"',
    "1", "{", "}", '"', "x", " ", "\n", "é", "😀", "<", "|", ">", "<|", "&quot;",
]
MARKUPISH = st.lists(st.sampled_from(PIECES), max_size=60).map("".join)


def _parse_chunked(text, cuts, thinking):
    p = K3OutputParser(thinking=thinking)
    reasoning, content, calls = "", "", []
    pos = 0
    for c in sorted(set(cuts)):
        c = min(c, len(text))
        d = p.feed(text[pos:c])
        reasoning, content, calls = reasoning + d.reasoning, content + d.content, calls + d.tool_calls
        pos = max(pos, c)
    for d in (p.feed(text[pos:]), p.finish()):
        reasoning, content, calls = reasoning + d.reasoning, content + d.content, calls + d.tool_calls
    return reasoning, content, calls


def _one_shot(text, thinking):
    out = parse_k3_output(text, thinking=thinking)
    return out.reasoning_content or "", out.content, out.tool_calls


@pytest.fixture(autouse=True)
def _quiet_parser_warnings():
    logging.getLogger("kimik3.chat.parsers").setLevel(logging.ERROR)
    yield
    logging.getLogger("kimik3.chat.parsers").setLevel(logging.NOTSET)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(MARKUPISH, st.text(max_size=80)), st.lists(st.integers(0, 200), max_size=8), st.booleans())
def test_fuzz_chunking_never_changes_the_result(text, cuts, thinking):
    assert _parse_chunked(text, cuts, thinking) == _one_shot(text, thinking)


@settings(max_examples=1500, deadline=None)
@given(MARKUPISH, st.booleans())
def test_fuzz_no_text_is_lost(text, thinking):
    # returned text never exceeds the input (reasoning and content each: a think channel that the
    # response close ends is both), and every call has a name and RFC 8259 JSON object arguments
    reasoning, content, calls = _one_shot(text, thinking)
    assert len(reasoning) <= len(text) and len(content) <= len(text)
    if "<|close|>response<|sep|>" not in text:
        assert len(reasoning) + len(content) <= len(text)
    assert all(call.name and isinstance(json.loads(call.arguments, parse_constant=lambda c: 1 / 0), dict)
               for call in calls)
    assert [call.index for call in calls] == list(range(len(calls)))


@pytest.mark.parametrize("thinking", [True, False], ids=["think", "no-think"])
def test_every_truncation_of_a_full_message(thinking):
    text = FULL if thinking else FULL[FULL.index("Checking."):]
    for n in range(len(text) + 1):
        reasoning, content, calls = _one_shot(text[:n], thinking)
        assert calls == FULL_CALLS[: len(calls)]  # calls appear whole and in order, never half-parsed
        assert _parse_chunked(text[:n], [n // 3, n // 2], thinking) == (reasoning, content, calls)
    assert _one_shot(text, thinking)[2] == FULL_CALLS


SAFE_TEXT = st.text(st.characters(blacklist_characters="<", blacklist_categories=("Cs",)), max_size=30)


@settings(max_examples=400, deadline=None)
@given(
    SAFE_TEXT, SAFE_TEXT,
    st.lists(st.tuples(st.sampled_from(["f", "g_2", 'we"ird&']),
                       st.dictionaries(st.text(min_size=1, max_size=5).filter(lambda s: "<" not in s),
                                       st.one_of(SAFE_TEXT, st.integers(), st.booleans(), st.none(),
                                                 st.lists(st.integers(), max_size=3)), max_size=3)), max_size=3),
    st.lists(st.integers(0, 400), max_size=5),
)
def test_render_then_parse_roundtrip(reasoning, content, calls, cuts):
    msg = {"role": "assistant", "reasoning_content": reasoning, "content": content,
           "tool_calls": [{"id": str(i), "function": {"name": n, "arguments": json.dumps(a)}}
                          for i, (n, a) in enumerate(calls)]}
    rendered = "".join(s.text for s in render_k3([msg], thinking_effort=None, add_generation_prompt=False))
    generated = rendered[len('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'):]
    r, c, got = _parse_chunked(generated, cuts, True)
    assert (r, c) == (reasoning, content)
    assert [(t.name, json.loads(t.arguments)) for t in got] == [(n, a) for n, a in calls]


CONTROL_TOKENS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
CALL = ('<|open|>call tool="{name}" index="1"<|sep|><|open|>argument key="k" type="string"<|sep|>v'
        '<|close|>argument<|sep|><|close|>call<|sep|>')
MESSAGES = st.builds(
    lambda think, answer, names, tail: (f"{think}<|close|>think<|sep|><|open|>response<|sep|>{answer}"
                                        f"<|close|>response<|sep|><|open|>tools<|sep|>"
                                        + "".join(CALL.format(name=n) for n in names)
                                        + f"<|close|>tools<|sep|><|close|>message<|sep|>{tail}"),
    st.text(max_size=10), st.text(max_size=10), st.lists(st.sampled_from(["f", "g", "nope"]), max_size=3),
    st.sampled_from(["", "<|end_of_msg|>", "junk<|open|>x<|sep|>"]))
FUZZED_OUTPUTS = st.one_of(MARKUPISH, MESSAGES, MESSAGES.flatmap(lambda m: st.integers(0, len(m)).map(lambda n: m[:n])),
                           st.tuples(MESSAGES, MARKUPISH).map("".join))


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(FUZZED_OUTPUTS, st.lists(st.integers(0, 200), max_size=6), st.booleans(),
       st.sampled_from([None, [], ["f"], ["f", "g"]]))
def test_fuzz_no_control_token_reaches_reasoning_or_content(text, cuts, thinking, tools):
    """0 raw XTML in what a user sees, with and without tools (``tools=[]``: none declared or
    tool_choice "none"), one-shot and streamed in pieces."""
    out = parse_k3_output(text, thinking=thinking, tools=tools)
    p = K3OutputParser(thinking=thinking, tools=tools)
    streamed, pos = [], 0
    for c in sorted(set(cuts)) + [len(text)]:
        streamed.append(p.feed(text[pos:max(pos, c)]))
        pos = max(pos, c)
    streamed.append(p.finish())
    for piece in [out.content, out.reasoning_content or ""] + [d.content + d.reasoning for d in streamed]:
        assert not any(t in piece for t in CONTROL_TOKENS), piece
    names = {t if isinstance(t, str) else t for t in tools} if tools is not None else None
    assert all(names is None or c.name in names for c in out.tool_calls)
    if tools == []:
        assert out.tool_calls == []
