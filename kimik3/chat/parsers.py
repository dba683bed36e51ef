"""Parse what K3 generates after the generation prompt into reasoning, content and tool calls.

Expected shape (thinking mode; the prompt already opened ``<|open|>think<|sep|>``)::

    REASONING<|close|>think<|sep|><|open|>response<|sep|>CONTENT<|close|>response<|sep|>
    [<|open|>tools<|sep|>CALL...<|close|>tools<|sep|>]<|close|>message<|sep|>[<|end_of_msg|>]

with each CALL ``<|open|>call tool="NAME" index="n"<|sep|>`` + ``<|open|>argument key="K" type="T"<|sep|>
VALUE<|close|>argument<|sep|>``... (or one ``<|open|>json type="object"<|sep|>RAW<|close|>json<|sep|>``)
+ ``<|close|>call<|sep|>``. Non-thinking mode starts inside the response channel. Decode generated ids
with special tokens kept: the markers are needed here.

One streaming state machine does all the work: ``K3OutputParser.feed(delta)`` returns the reasoning /
content / tool calls that became certain; ``finish()`` flushes; ``parse_k3_output`` is feed-all + finish,
so streamed and one-shot parses agree for any chunking. Text that could still turn into a marker is held
back. A tool call is emitted whole when its ``<|close|>call<|sep|>`` arrives.

Malformed output never raises, and no control token (``<|open|>``, ``<|close|>``, ``<|sep|>``,
``<|end_of_msg|>``) ever reaches the reasoning or the content. Choices (the official release ships no
parser): an unterminated think channel stays reasoning (as vLLM does); a call with a bad argument
(unparseable JSON, type mismatch, unknown type, a ``json`` block that is not a JSON object), no tool
name, or a name outside the given ``tools`` (``tools=[]``: every call) is dropped with a logged warning;
text that breaks the structure after the response channel is returned as content, with a warning.
Stray markup inside text (``MarkupFilter``): each XTML element (``<|open|>NAME ATTRS<|sep|>``,
``<|close|>NAME<|sep|>``) and each lone control token is replaced by one space. A control token has no
space, so no deletion can join two pieces into one; the serving layer also masks the tool-section
opener in the logits when no tools are declared (serve/chat.py), so such a call cannot start.

Tool-call arguments are always RFC 8259 JSON objects: non-string values keep their generated literal
text (the inverse of the renderer's one-level split), a ``json`` block its raw text, except that a value
holding ``NaN``, ``Infinity`` or ``-Infinity`` (which K3 may write, and which JSON has no spelling for)
is re-serialised with each of them as ``null`` (JavaScript's ``JSON.stringify`` rule).

Recovery rules for what deployed models emit:
- an output cut (max_tokens, a stop string) inside a structural marker (``<|open|>tools``,
  ``<|open|>call tool="f" index="1"``) or inside an unterminated tool call drops that unfinished part:
  text a user sees never holds control-token text from a cut (a bare prefix such as ``<|clo`` is text);
- with thinking on, a response close marker inside the think channel (the model answered without
  closing its thinking or opening the response) returns the think channel's text as the content too
  (it stays the reasoning, as it was streamed, so streamed and one-shot parses agree);
- a tools section opened inside the think channel ends the reasoning and its calls are parsed.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kimik3.chat.k3 import CLOSE, END_OF_MSG, OPEN, SEP, json_type

logger = logging.getLogger(__name__)

THINK_OPEN, THINK_CLOSE = f"{OPEN}think{SEP}", f"{CLOSE}think{SEP}"
RESPONSE_OPEN, RESPONSE_CLOSE = f"{OPEN}response{SEP}", f"{CLOSE}response{SEP}"
TOOLS_OPEN, TOOLS_CLOSE = f"{OPEN}tools{SEP}", f"{CLOSE}tools{SEP}"
MESSAGE_CLOSE = f"{CLOSE}message{SEP}"
CALL_OPEN, CALL_CLOSE = f"{OPEN}call", f"{CLOSE}call{SEP}"
ARG_OPEN, ARG_CLOSE = f"{OPEN}argument", f"{CLOSE}argument{SEP}"
JSON_OPEN, JSON_CLOSE = f"{OPEN}json", f"{CLOSE}json{SEP}"

_WS = " \t\r\n"
_CONTROL = (OPEN, CLOSE, SEP, END_OF_MSG)
_ATTRS = re.compile(r'((?: [^\s="<>|]+="[^"]*")*)' + re.escape(SEP))
_ATTR = re.compile(r' ([^\s="<>|]+)="([^"]*)"')


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object as text
    index: int  # 0-based position among the calls of this message


@dataclass
class ParseDelta:
    """What one ``feed``/``finish`` call made certain."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass
class ParsedOutput:
    reasoning_content: str | None  # None when thinking is off
    content: str
    tool_calls: list[ToolCall]


def _unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def _attrs(text: str, start: int) -> tuple[dict[str, str], int] | None:
    """Attributes from ``text[start:]`` up to and including ``<|sep|>``; None if malformed."""
    m = _ATTRS.match(text, start)
    if m is None:
        return None
    return {k: _unescape(v) for k, v in _ATTR.findall(m.group(1))}, m.end()


def _tool_names(tools: Iterable[Any] | None) -> set[str] | None:
    if tools is None:
        return None
    names = set()
    for t in tools:
        if isinstance(t, str):
            names.add(t)
        elif isinstance(t, dict):
            fn = t.get("function", t)
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                names.add(fn["name"])
    return names


def _finite(value: Any) -> Any:
    """``value`` with every NaN / Infinity / -Infinity replaced by None."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _rfc8259(text: str) -> tuple[Any, str]:
    """(decoded value, JSON text without NaN/Infinity): ``text`` itself when it has none. Raises ValueError."""
    hits = []

    def constant(name: str) -> float:
        hits.append(name)
        return float(name.replace("Infinity", "inf").replace("NaN", "nan"))

    decoded = json.loads(text, parse_constant=constant)
    return decoded, (json.dumps(_finite(decoded), ensure_ascii=False) if hits else text)


def parse_call_block(block: str, tool_names: set[str] | None = None) -> tuple[str, str] | str:
    """``<|open|>call ...<|close|>call<|sep|>`` -> (name, arguments JSON), or a reason it is malformed."""
    head = _attrs(block, len(CALL_OPEN))
    if head is None:
        return "bad call tag"
    attrs, i = head
    name = attrs.get("tool")
    if not name:
        return "call without a tool name"
    if tool_names is not None and name not in tool_names:
        return f"call to unknown tool {name!r}"
    end = len(block) - len(CALL_CLOSE)
    pieces: list[str] = []
    raw_json: str | None = None
    while True:
        while i < end and block[i] in _WS:
            i += 1
        if i >= end:
            break
        if raw_json is not None:
            return "text after a json argument block"
        if block.startswith(ARG_OPEN, i):
            got = _argument_element(block, i, end)
            if isinstance(got, str):
                return got
            piece, i = got
            pieces.append(piece)
        elif block.startswith(JSON_OPEN, i) and not pieces:
            got = _json_element(block, i, end)
            if isinstance(got, str):
                return got
            raw_json, i = got
        else:
            return "unexpected text inside a call"
    return name, raw_json if raw_json is not None else "{" + ", ".join(pieces) + "}"


def _argument_element(block: str, i: int, end: int) -> tuple[str, int] | str:
    """The argument element at ``i`` as ('"key": literal', index after it), or a reason it is malformed: a
    string argument is quoted, any other kind must be RFC 8259 JSON of its declared type."""
    head = _attrs(block, i + len(ARG_OPEN))
    close = block.find(ARG_CLOSE, head[1]) if head else -1
    if head is None or close < 0 or close > end:
        return "bad argument element"
    a, start = head
    key, kind, value = a.get("key"), a.get("type"), block[start:close]
    if key is None or kind is None:
        return "argument without key or type"
    if kind == "string":
        literal = json.dumps(value, ensure_ascii=False)
    else:
        try:
            decoded, literal = _rfc8259(value)
        except ValueError:
            return f"argument {key!r} is not valid JSON"
        if json_type(decoded) != kind:
            return f"argument {key!r} declared {kind!r} but holds {json_type(decoded)!r}"
    return json.dumps(key, ensure_ascii=False) + ": " + literal, close + len(ARG_CLOSE)


def _json_element(block: str, i: int, end: int) -> tuple[str, int] | str:
    """The json block at ``i`` as (its JSON object text, index after it), or a reason it is malformed."""
    head = _attrs(block, i + len(JSON_OPEN))
    close = block.find(JSON_CLOSE, head[1]) if head else -1
    if head is None or close < 0 or close > end:
        return "bad json element"
    try:
        decoded, raw_json = _rfc8259(block[head[1] : close])
    except ValueError:
        return "the json block is not valid JSON"
    if not isinstance(decoded, dict):
        return "the json block is not a JSON object"
    return raw_json, close + len(JSON_CLOSE)


def _held_back(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of one of ``markers``."""
    longest = max(len(m) for m in markers) - 1
    for k in range(min(longest, len(buf)), 0, -1):
        tail = buf[-k:]
        if tail[0] == "<" and any(m.startswith(tail) for m in markers):
            return k
    return 0


def _earliest(buf: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    best = None
    for m in markers:
        i = buf.find(m)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, m)
    return best


_TAG_LIMIT = 256       # the longest element head (``<|open|>call tool="..." index=".."<|sep|>``) dropped whole


class MarkupFilter:
    """A streaming filter over one channel's text: each XTML element and each lone control token becomes
    one space (see the module docstring). Its decisions depend only on the text, not on how it is cut:
    text that could still be (the start of) an element is held until it is decided or ``final``."""

    def __init__(self):
        self.buf = ""

    def push(self, text: str, final: bool = False) -> str:
        self.buf += text
        out: list[str] = []
        while True:
            i = self.buf.find("<|")
            if i < 0:
                keep = 1 if self.buf.endswith("<") and not final else 0
                out.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            out.append(self.buf[:i])
            self.buf = self.buf[i:]
            n = self._markup_length(final)
            if n is None:                    # undecided: wait for more text
                break
            if n == 0:                       # "<|" that starts no control token: text
                out.append("<|")
                self.buf = self.buf[2:]
            else:
                out.append(" ")
                self.buf = self.buf[n:]
        return "".join(out)

    def _markup_length(self, final: bool) -> int | None:
        """Length of the markup at the start of ``buf`` (which starts with "<|"), 0 if none, None if undecided."""
        b = self.buf
        for token in (OPEN, CLOSE, SEP, END_OF_MSG):
            if b.startswith(token):
                if token in (SEP, END_OF_MSG):
                    return len(token)
                sep = b.find(SEP, len(token))
                nxt = b.find("<|", len(token))
                if sep >= 0 and (nxt < 0 or nxt >= sep) and sep <= _TAG_LIMIT:
                    return sep + len(SEP)    # the whole element
                if sep < 0 and nxt >= 0 and not final and SEP.startswith(b[nxt:]) and len(b) <= _TAG_LIMIT:
                    return None              # the "<|" may still become the element's <|sep|>
                if (nxt >= 0 and (sep < 0 or nxt < sep)) or len(b) > _TAG_LIMIT or final:
                    return len(token)        # a lone control token
                return None
            if token.startswith(b) and not final:
                return None
        return 0


_THINK_ENDS = (THINK_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE, TOOLS_OPEN)
_RESPONSE_ENDS = (RESPONSE_CLOSE, TOOLS_OPEN, MESSAGE_CLOSE, END_OF_MSG)


class K3OutputParser:
    """Incremental parser: ``feed(text_delta) -> ParseDelta``; call ``finish()`` once at the end."""

    def __init__(self, thinking: bool = True, tools: Iterable[Any] | None = None):
        self.thinking = thinking
        self.tool_names = _tool_names(tools)
        self.state = "think_start" if thinking else "response_start"
        self.buf = ""
        self.num_calls = 0
        self.finished = False
        self.think_text = ""   # the think channel so far (returned as content too if a response close ends it)
        self.filters = {"reasoning": MarkupFilter(), "content": MarkupFilter()}

    def feed(self, text: str) -> ParseDelta:
        if not isinstance(text, str):
            raise TypeError(f"feed() takes text, got {type(text).__name__}")
        if self.finished:
            raise RuntimeError("feed() after finish()")
        self.buf += text
        out = ParseDelta()
        self._run(out, final=False)
        return self._filtered(out, final=False)

    def finish(self) -> ParseDelta:
        if self.finished:
            return ParseDelta()
        self.finished = True
        out = ParseDelta()
        self._run(out, final=True)
        return self._filtered(out, final=True)

    def _filtered(self, out: ParseDelta, final: bool) -> ParseDelta:
        return ParseDelta(self.filters["reasoning"].push(out.reasoning, final),
                          self.filters["content"].push(out.content, final), out.tool_calls)

    # Each state handler consumes from self.buf and returns False when it needs more text.
    def _run(self, out: ParseDelta, final: bool) -> None:
        while getattr(self, "_" + self.state)(out, final):
            pass

    def _warn_raw(self, why: str) -> bool:
        logger.warning("K3 output: %s; returning the rest as plain content", why)
        self.state = "raw"
        return True

    def _opening(self, marker: str, nxt: str, final: bool) -> bool:
        if self.buf.startswith(marker):
            self.buf = self.buf[len(marker) :]
        elif marker.startswith(self.buf) and not final:
            return False  # could still become the marker
        self.state = nxt
        return True

    def _think_start(self, out: ParseDelta, final: bool) -> bool:
        return self._opening(THINK_OPEN, "think", final)

    def _response_start(self, out: ParseDelta, final: bool) -> bool:
        return self._opening(RESPONSE_OPEN, "response", final)

    def _text(self, out: ParseDelta, final: bool, ends: tuple[str, ...], attr: str) -> str | None:
        """Move text up to the first of ``ends`` into ``out.<attr>``; return that marker (consumed) or None."""
        hit = _earliest(self.buf, ends)
        if hit is None:
            keep = _held_back(self.buf, ends)
            cut = len(self.buf) - keep
            setattr(out, attr, getattr(out, attr) + self.buf[:cut])
            self.buf = self.buf[cut:]
            if final:
                self._drop_cut_marker(out, attr)
            return None
        i, marker = hit
        setattr(out, attr, getattr(out, attr) + self.buf[:i])
        self.buf = self.buf[i + len(marker) :]
        return marker

    def _drop_cut_marker(self, out: ParseDelta, attr: str) -> None:
        """At the end: a held-back tail that starts with a control token is a cut marker (dropped);
        one that is only a prefix of a control token is text."""
        if self.buf.startswith(_CONTROL):
            logger.debug("K3 output: dropping the cut marker %r at the end", self.buf[:40])
        else:
            setattr(out, attr, getattr(out, attr) + self.buf)
        self.buf = ""

    def _think(self, out: ParseDelta, final: bool) -> bool:
        before = len(out.reasoning)
        marker = self._text(out, final, _THINK_ENDS, "reasoning")
        self.think_text += out.reasoning[before:]
        if marker is None:
            if final:
                # the usual end of a length-cut answer, not malformed output: no warning
                logger.debug("K3 output: think channel never closed; all of it is reasoning")
            return False
        if marker == RESPONSE_OPEN:
            logger.warning("K3 output: response channel opened without closing the think channel")
            self.state = "response"
        elif marker == RESPONSE_CLOSE:
            logger.warning("K3 output: response closed but never opened; the think channel is the answer")
            out.content += self.think_text
            self.state = "after_response"
        elif marker == TOOLS_OPEN:
            logger.warning("K3 output: tools section inside the think channel; parsing its calls")
            self.state = "tools"
        else:
            self.state = "after_think"
        return True

    def _response(self, out: ParseDelta, final: bool) -> bool:
        marker = self._text(out, final, _RESPONSE_ENDS, "content")
        if marker is None:
            return False
        if marker != RESPONSE_CLOSE:
            logger.warning("K3 output: response channel not closed before %r", marker)
        self.state = {
            RESPONSE_CLOSE: "after_response",
            TOOLS_OPEN: "tools",
            MESSAGE_CLOSE: "end",
            END_OF_MSG: "done",
        }[marker]
        return True

    def _structural(self, out: ParseDelta, final: bool, nexts: dict[str, str]) -> bool:
        """Between channels: skip whitespace, then expect one of ``nexts``' markers."""
        s = self.buf.lstrip(_WS)
        for marker, nxt in nexts.items():
            if s.startswith(marker):
                self.buf = s[len(marker) :]
                self.state = nxt
                return True
        if not s:
            if final:
                self.buf = ""
            return False
        if any(m.startswith(s) for m in nexts):
            if final and s.startswith(_CONTROL):     # cut inside the next marker: drop it
                self.buf = ""
                return False
            if not final:
                return False
        return self._warn_raw(f"expected one of {list(nexts)} in {self.state}, got {s[:40]!r}")

    def _after_think(self, out: ParseDelta, final: bool) -> bool:
        s = self.buf.lstrip(_WS)
        if s and not RESPONSE_OPEN.startswith(s[: len(RESPONSE_OPEN)]):
            logger.warning("K3 output: text after the think channel without a response channel")
            self.state = "response"
            return True
        return self._structural(out, final, {RESPONSE_OPEN: "response"})

    def _after_response(self, out: ParseDelta, final: bool) -> bool:
        return self._structural(out, final, {TOOLS_OPEN: "tools", MESSAGE_CLOSE: "end", END_OF_MSG: "done"})

    def _after_tools(self, out: ParseDelta, final: bool) -> bool:
        return self._structural(out, final, {MESSAGE_CLOSE: "end", END_OF_MSG: "done"})

    def _end(self, out: ParseDelta, final: bool) -> bool:
        return self._structural(out, final, {END_OF_MSG: "done"})

    def _done(self, out: ParseDelta, final: bool) -> bool:
        if self.buf.strip(_WS):
            return self._warn_raw("text after the end of the message")
        if final:
            self.buf = ""
        return False

    def _tools(self, out: ParseDelta, final: bool) -> bool:
        s = self.buf.lstrip(_WS)
        if s.startswith(CALL_OPEN):
            close = s.find(CALL_CLOSE)
            if close < 0:
                if final:       # cut inside the call (max_tokens, a stop string): nothing of it is shown
                    logger.warning("K3 output: tool call cut before its end; dropped: %r", s[:60])
                    self.buf = ""
                return False
            block = s[: close + len(CALL_CLOSE)]
            parsed = parse_call_block(block, self.tool_names)
            if isinstance(parsed, str):
                logger.warning("K3 output: %s; the call is dropped: %r", parsed, block[:120])
            else:
                out.tool_calls.append(ToolCall(parsed[0], parsed[1], self.num_calls))
                self.num_calls += 1
            self.buf = s[len(block) :]
            return True
        if s.startswith(TOOLS_CLOSE):
            self.buf = s[len(TOOLS_CLOSE) :]
            self.state = "after_tools"
            return True
        if not final and (not s or CALL_OPEN.startswith(s) or TOOLS_CLOSE.startswith(s)):
            return False
        if final and s and (CALL_OPEN.startswith(s) or TOOLS_CLOSE.startswith(s)) and s.startswith(_CONTROL):
            self.buf = ""       # cut inside a marker
            return False
        if not s:
            logger.warning("K3 output: tools section never closed")
            self.buf = ""
            return False
        return self._warn_raw(f"unexpected text in the tools section: {s[:40]!r}")

    def _raw(self, out: ParseDelta, final: bool) -> bool:
        out.content += self.buf
        self.buf = ""
        return False


def parse_k3_output(text: str, *, thinking: bool = True, tools: Iterable[Any] | None = None) -> ParsedOutput:
    """Parse one finished generation (text after the generation prompt; see the module docstring)."""
    parser = K3OutputParser(thinking=thinking, tools=tools)
    reasoning, content, calls = [], [], []
    for delta in (parser.feed(text), parser.finish()):
        reasoning.append(delta.reasoning)
        content.append(delta.content)
        calls.extend(delta.tool_calls)
    return ParsedOutput("".join(reasoning) if thinking else None, "".join(content), calls)
