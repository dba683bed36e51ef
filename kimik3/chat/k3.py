"""Kimi-K3 chat rendering ("XTML"): conversation -> prompt segments (spec vision-multimodal §5.2-5.5).

Structure: ``<|open|>tag attrs<|sep|> ... <|close|>tag<|sep|>``; every message is
``<|open|>message role="..."<|sep|>BODY<|close|>message<|sep|><|end_of_msg|>``. Markers are control
segments; tag names, attribute text and all message text are plain-text segments.

Prompt order: tool declaration, thinking effort, the messages (tool results re-sorted into call order,
matched by opaque call id only, D12), tool choice, response format, generation prompt. The model stops
on ``<|end_of_msg|>``.

Images: an image content part (``{"type": "image"}`` / ``{"type": "image_url", ...}``) becomes, with
``images=[ImagePrompt(w, h, n), ...]`` given (one per image part, in order), the control segment
``<|media_begin|>image {w}x{h}<|media_content|>`` + n x ``<|media_pad|>`` + ``<|media_end|>`` at the
part's position, with no separators (official positional layout, D11). Without ``images`` it renders
the plain-text placeholder ``IMAGE_PLACEHOLDER``, for display only. A literal placeholder typed in any
text stays plain text and is never replaced by an image (our deviation from the official encoder, D25).

Videos: a video part (``{"type": "video_url", ...}`` / ``{"type": "video"}``) takes the next of
``videos=[VideoPrompt(chunks), ...]`` and becomes, per chunk, the control segment
``{timestamp}<|media_begin|>video<|media_content|>`` + n x ``<|media_pad|>`` + ``<|media_end|>``, the chunks
back to back (Moonshot's Kimi-K2.5 video prompt, which vLLM's K3 video branch keeps; ``kimik3.vision.video``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kimik3.chat.segments import ImagePrompt, Segment, VideoPrompt

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD = "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
STOP_TOKEN = END_OF_MSG

THINKING_EFFORTS = ("low", "medium", "high", "max")   # as the effort message lists them (D27: rendered)
ROLES = ("system", "user", "assistant", "tool")
FENCE = "`" * 3

# Model-facing instruction texts: the model was trained on these exact bytes.
_TOOLS_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
_DYNAMIC_TOOLS_HEADER = (
    "## New Tools Available\n"
    "The system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\n"
    "Here are the specs for the extended tools.\n\n"
)
_EFFORT_BODY = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
    "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`."
)
_TOOL_CHOICE_BODY = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
_RAW_JSON = "Your response must be raw JSON data without markdown code blocks (" + FENCE + "json) or any additional formatting."
_JSON_OBJECT_BODY = "The system is invoked with `response_format=json_object`.\n" + _RAW_JSON
_JSON_SCHEMA_BODY = (
    "The system is invoked with `response_format=json_schema`.\n" + _RAW_JSON + "\n"
    "The JSON data must match the following schema:\n" + FENCE + "json\n{schema}\n" + FENCE
)


# ---- small helpers ---------------------------------------------------------------------------------


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def sort_keys_deep(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: sort_keys_deep(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [sort_keys_deep(v) for v in value]
    return value


def json_type(value: Any) -> str:
    """XTML argument type of a decoded JSON value."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    return "array"


def escape_attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


_WS = " \t\n\r"
_DECODER = json.JSONDecoder(strict=False)


def split_json_object(text: str) -> list[tuple[str, str, str]]:
    """Split a JSON object string one level deep into (key, type, text) triples (D13).

    String values give their decoded text; any other value keeps its exact JSON literal (``1e2``
    stays ``1e2``, nested objects keep their bytes). Text after the closing brace is ignored.
    Raises ValueError unless ``text`` starts with a well-formed JSON object.
    """
    n = len(text)

    def skip(i: int) -> int:
        while i < n and text[i] in _WS:
            i += 1
        return i

    def value_at(i: int) -> tuple[Any, int]:
        try:
            return _DECODER.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise ValueError(str(e)) from None

    i = skip(0)
    if i >= n or text[i] != "{":
        raise ValueError("arguments are not a JSON object")
    i = skip(i + 1)
    if i >= n:
        raise ValueError("unterminated JSON object")
    out: list[tuple[str, str, str]] = []
    if text[i] == "}":
        return out
    while True:
        key, i = value_at(i)
        if not isinstance(key, str):
            raise ValueError(f"JSON object key must be a string, got {key!r}")
        i = skip(i)
        if i >= n or text[i] != ":":
            raise ValueError(f"expected ':' after key {key!r}")
        i = skip(i + 1)
        start = i
        value, i = value_at(i)
        out.append((key, json_type(value), value if isinstance(value, str) else text[start:i]))
        i = skip(i)
        if i >= n:
            raise ValueError("unterminated JSON object")
        ch = text[i]
        i = skip(i + 1)
        if ch == "}":
            return out
        if ch != ",":
            raise ValueError(f"expected ',' or '}}' in JSON object, got {ch!r}")


def normalize_arguments(arguments: Any) -> tuple[list[tuple[str, str, str]], str | None]:
    """Tool-call arguments -> ((key, type, text) triples, raw json block or None) (D13)."""
    if arguments is None or arguments == "":
        return [], None
    if isinstance(arguments, dict):
        return [
            (str(k), json_type(v), v if isinstance(v, str) else json.dumps(v, ensure_ascii=False))
            for k, v in arguments.items()
        ], None
    if isinstance(arguments, str):
        try:
            return split_json_object(arguments), None
        except ValueError:
            return [], arguments  # not a JSON object: rendered verbatim in a json block
    raise TypeError(f"tool call arguments must be a JSON object string or a dict, got {type(arguments).__name__}")


# ---- the writer ------------------------------------------------------------------------------------


class _Writer:
    def __init__(self, images: Sequence[ImagePrompt] | None, videos: Sequence[VideoPrompt] | None = None):
        self.segments: list[Segment] = []
        self.images = images
        self.next_image = 0
        self.videos = videos
        self.next_video = 0

    def control(self, text: str) -> None:
        self.segments.append(Segment(text, special=True))

    def text(self, text: str) -> None:
        if text:
            self.segments.append(Segment(text, special=False))

    def open(self, tag: str, *attrs: tuple[str, Any]) -> None:
        self.control(OPEN)
        self.text(tag)
        for key, value in attrs:
            self.text(f" {key}")
            self.text('="')
            self.text(escape_attr(str(value)))
            self.text('"')
        self.control(SEP)

    def close(self, tag: str) -> None:
        self.control(CLOSE)
        self.text(tag)
        self.control(SEP)

    def end_message(self) -> None:
        self.close("message")
        self.control(END_OF_MSG)

    def system_note(self, kind: str, body: str) -> None:
        self.open("message", ("role", "system"), ("type", kind))
        self.text(body.strip())
        self.end_message()

    def image(self) -> None:
        if self.images is None:
            self.text(IMAGE_PLACEHOLDER)
            return
        if self.next_image >= len(self.images):
            raise ValueError(f"the conversation has more image parts than the {len(self.images)} images given")
        img = self.images[self.next_image]
        self.next_image += 1
        self.control(
            f"{MEDIA_BEGIN}image {img.width}x{img.height}{MEDIA_CONTENT}" + MEDIA_PAD * img.num_pad_tokens + MEDIA_END
        )

    def video(self) -> None:
        if self.videos is None or self.next_video >= len(self.videos):
            raise ValueError(f"the conversation has more video parts than the {len(self.videos or [])} videos given")
        for stamp, pads in self.videos[self.next_video].chunks:
            self.control(f"{stamp}{MEDIA_BEGIN}video{MEDIA_CONTENT}" + MEDIA_PAD * pads + MEDIA_END)
        self.next_video += 1

    def content(self, content: Any, where: str) -> None:
        if content is None:
            return
        if isinstance(content, str):
            self.text(content)
            return
        if not isinstance(content, list):
            raise TypeError(f"{where}: content must be a str, a list of parts or None, got {type(content).__name__}")
        for k, part in enumerate(content):
            if not isinstance(part, dict):
                raise TypeError(f"{where}: content part {k} must be a dict, got {type(part).__name__}")
            kind = part.get("type")
            if kind in ("image", "image_url"):
                self.image()
            elif kind in ("video", "video_url"):
                self.video()
            elif kind == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise TypeError(f"{where}: text part {k} needs a str 'text', got {type(text).__name__}")
                self.text(text)
            else:
                raise ValueError(f"{where}: content part {k} has unknown type {kind!r} (expected text, image, image_url, video_url)")


# ---- validation ------------------------------------------------------------------------------------


def check_conversation(messages: Any) -> list[dict]:
    """Shape checks shared by both chat formats (message dicts, roles, names, tool-call names)."""
    if not isinstance(messages, list):
        raise TypeError(f"conversation must be a list of message dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(f"message {i} must be a dict, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"message {i} has unknown role {role!r}; expected one of {', '.join(ROLES)}")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"message {i}: name must be a str, got {type(name).__name__}")
        for key in ("reasoning_content", "reasoning"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise TypeError(f"message {i}: {key} must be a str or None, got {type(m[key]).__name__}")
        calls = m.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise TypeError(f"message {i}: tool_calls must be a list, got {type(calls).__name__}")
        for k, call in enumerate(calls or []):
            fn = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(f"message {i}: tool_calls[{k}] needs a function name (str)")
    return messages


def _check_options(thinking: Any, thinking_effort: Any, tool_choice: Any, response_format: Any, tools: Any) -> None:
    if not isinstance(thinking, bool):
        raise TypeError(f"thinking must be a bool, got {type(thinking).__name__}")
    if thinking_effort is not None and not isinstance(thinking_effort, str):
        raise TypeError(f"thinking_effort must be a str or None, got {type(thinking_effort).__name__}")
    if thinking and thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise ValueError(
            f"thinking_effort must be one of {', '.join(THINKING_EFFORTS)} or None, got {thinking_effort!r}"
        )
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"a named tool_choice must be {{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}")
    elif tool_choice not in (None, "auto", "required", "none"):
        raise ValueError(f"tool_choice must be None, 'auto', 'required', 'none' or a named function, got {tool_choice!r}")
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise TypeError(f"response_format must be a dict like {{'type': 'json_object'}}, got {type(response_format).__name__}")
        kind = response_format.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")
        if kind == "json_schema" and not isinstance(response_format.get("json_schema"), dict):
            raise ValueError("response_format json_schema needs a 'json_schema' object holding the 'schema'")
    if tools is not None and not isinstance(tools, list):
        raise TypeError(f"tools must be a list of tool dicts, got {type(tools).__name__}")


def _response_schema(response_format: dict) -> Any:
    spec = response_format["json_schema"]
    return spec.get("schema", spec)


# ---- tool-result ordering (D12) --------------------------------------------------------------------


def order_tool_results(messages: list[dict]) -> list[dict]:
    """Re-sort each run of tool messages into the call order of the assistant message before it.

    A tool message matches a call when its ``tool_call_id`` (or ``id``) equals the call's ``id``;
    a run with any unmatched message is left as it is. Matched messages get ``tool`` (and ``name``,
    if present) set to the call's function name. Copies messages; the input is not modified.
    """
    out: list[dict] = []
    calls_by_id: dict[str, tuple[int, str]] = {}
    i = 0
    while i < len(messages):
        m = messages[i]
        if m.get("role") != "tool":
            if m.get("role") == "assistant":
                calls_by_id = {}
                for pos, call in enumerate(m.get("tool_calls") or [], start=1):
                    cid = call.get("id")
                    if cid is not None and str(cid) not in calls_by_id:
                        calls_by_id[str(cid)] = (pos, call.get("function", call)["name"])
            out.append(m)
            i += 1
            continue
        j = i
        while j < len(messages) and messages[j].get("role") == "tool":
            j += 1
        run = messages[i:j]
        keyed = []
        for offset, t in enumerate(run):
            cid = t.get("tool_call_id", t.get("id"))
            hit = calls_by_id.get(str(cid)) if cid is not None else None
            keyed.append((hit, offset, t))
        if all(hit is not None for hit, _, _ in keyed):
            keyed.sort(key=lambda x: (x[0][0], x[1]))
            for (pos, name), _, t in keyed:
                t = dict(t, tool=name)
                if "name" in t:
                    t["name"] = name
                out.append(t)
        else:
            out.extend(run)
        i = j
    return out


# ---- rendering -------------------------------------------------------------------------------------


def _render_tools_declare(w: _Writer, tools: Any, dynamic: bool) -> None:
    header = _DYNAMIC_TOOLS_HEADER if dynamic else _TOOLS_HEADER
    body = header + FENCE + "json\n" + compact_json(sort_keys_deep(tools)) + "\n" + FENCE
    w.open("message", ("role", "system"), ("type", "tool-declare"))
    w.text(body)
    w.end_message()


def _render_assistant(w: _Writer, m: dict, where: str, thinking: bool) -> None:
    if thinking:
        reasoning = m.get("reasoning_content")
        if reasoning is None or reasoning == "":
            reasoning = m.get("reasoning")
        w.open("think")
        if reasoning:  # None and "" leave the channel empty; whitespace is kept (D26)
            w.text(reasoning)
        w.close("think")
    w.open("response")
    w.content(m.get("content"), where)
    w.close("response")
    calls = m.get("tool_calls")
    if not calls:
        return
    w.open("tools")
    for n, call in enumerate(calls, start=1):
        fn = call.get("function", call)
        args, raw = normalize_arguments(fn.get("arguments"))
        w.open("call", ("tool", fn["name"]), ("index", n))
        if raw is not None:
            w.open("json", ("type", "object"))
            w.text(raw)
            w.close("json")
        for key, kind, text in args:
            w.open("argument", ("key", key), ("type", kind))
            w.text(text)
            w.close("argument")
        w.close("call")
    w.close("tools")


def render_k3(
    conversation: Any,
    tools: list[dict] | None = None,
    *,
    add_generation_prompt: bool = True,
    thinking: bool = True,
    thinking_effort: str | None = "max",
    tool_choice: Any = None,
    response_format: dict | None = None,
    images: Sequence[ImagePrompt] | None = None,
    videos: Sequence[VideoPrompt] | None = None,
) -> list[Segment]:
    """Render an OpenAI-style conversation as K3 XTML segments.

    Messages: ``role`` in system/user/assistant/tool; ``content`` a str, None or a list of
    ``{"type": "text", "text": ...}`` / image parts; optional ``name``; assistant ``reasoning_content``
    (or ``reasoning``) and ``tool_calls`` (``{"id", "function": {"name", "arguments"}}``); tool
    ``tool_call_id`` and optionally ``tool``/``name``; a system message with a ``tools`` list declares
    more tools mid-conversation. ``thinking_effort`` in low/medium/high/max (None: no effort message);
    ``tool_choice`` None/"auto"/"required"/"none"/named (named adds no message);
    ``response_format`` ``{"type": "text"|"json_object"|"json_schema", "json_schema": {"schema": ...}}``.
    ``images``, ``videos``: see the module docstring. Raises ValueError/TypeError on invalid input.
    """
    messages = check_conversation(conversation)
    _check_options(thinking, thinking_effort, tool_choice, response_format, tools)
    images = _checked(images, ImagePrompt, "images")
    videos = _checked(videos, VideoPrompt, "videos")
    messages = order_tool_results(messages)
    w = _Writer(images, videos)

    if tools:
        _render_tools_declare(w, tools, dynamic=False)
    if thinking and thinking_effort is not None:
        w.system_note("thinking-effort", _EFFORT_BODY.format(effort=thinking_effort))

    _render_messages(w, messages, thinking)
    _render_request_notes(w, tool_choice, response_format)

    if add_generation_prompt:
        w.open("message", ("role", "assistant"))
        w.open("think" if thinking else "response")
    if images is not None and w.next_image != len(images):
        raise ValueError(f"{len(images)} images given but the conversation has {w.next_image} image parts")
    if videos is not None and w.next_video != len(videos):
        raise ValueError(f"{len(videos)} videos given but the conversation has {w.next_video} video parts")
    return w.segments


def fill_image_placeholders(text: str, sizes: Sequence[tuple[int, int]], source: str = "multi_modal_data") -> str:
    """vLLM's and TensorRT-LLM's raw K3 prompt form: each ``<|kimi_image_placeholder|>`` becomes the K3 image
    prompt of the next image (its original size and one pad, expanded later), as the official encoder does
    (spec D25; only where the caller wrote the whole prompt, never in chat text). ``source`` names where the
    images came from, for the count error."""
    n = text.count(IMAGE_PLACEHOLDER)
    if n == 0:
        return text
    if n != len(sizes):
        raise ValueError(f"the prompt holds {n} {IMAGE_PLACEHOLDER} but {source} gives {len(sizes)} image(s) / video "
                         f"chunk(s); give one placeholder per item")
    pieces = text.split(IMAGE_PLACEHOLDER)
    out = [pieces[0]]
    for (w, h), rest in zip(sizes, pieces[1:]):
        out.append(f"{MEDIA_BEGIN}image {w}x{h}{MEDIA_CONTENT}{MEDIA_PAD}{MEDIA_END}" + rest)
    return "".join(out)


def _checked(items, kind: type, name: str) -> list | None:
    if items is None:
        return None
    items = list(items)
    for item in items:
        if not isinstance(item, kind):
            raise TypeError(f"{name} must be {kind.__name__} objects, got {type(item).__name__}")
    return items


def _render_messages(w: _Writer, messages: list[dict], thinking: bool) -> None:
    """Each message in order: a system message with ``tools`` declares them; a tool result names its tool
    (given, or the assistant call it answers, by position) and its index."""
    last_calls: list = []
    tool_index = 0
    for i, m in enumerate(messages):
        role, where = m["role"], f"message {i} ({m['role']})"
        if role == "system" and m.get("tools"):
            _render_tools_declare(w, m["tools"], dynamic=True)
            continue
        attrs = [("role", role), ("name", m["name"])] if m.get("name") else [("role", role)]
        if role == "tool":
            tool_index += 1
            attrs = [("role", "tool"), ("tool", _result_tool_name(m, where, tool_index, last_calls)),
                     ("index", tool_index)]
        elif role == "assistant":
            last_calls = m.get("tool_calls") or []
            tool_index = 0
        w.open("message", *attrs)
        if role == "assistant":
            _render_assistant(w, m, where, thinking)
        else:
            w.content(m.get("content"), where)
        w.end_message()


def _result_tool_name(m: dict, where: str, tool_index: int, last_calls: list) -> str:
    tool_name = m.get("tool", m.get("name"))
    if tool_name is None and tool_index <= len(last_calls):
        tool_name = last_calls[tool_index - 1].get("function", last_calls[tool_index - 1])["name"]
    if tool_name is None:
        raise ValueError(
            f"{where}: cannot tell which tool this result is for: give it 'tool' or 'name', or put it "
            "after the assistant message whose tool_calls it answers"
        )
    return tool_name


def _render_request_notes(w: _Writer, tool_choice: Any, response_format: dict | None) -> None:
    """The system notes after the conversation: the tool choice, the response format."""
    if isinstance(tool_choice, str) and tool_choice in _TOOL_CHOICE_BODY:
        w.system_note("tool-choice", _TOOL_CHOICE_BODY[tool_choice])
    if response_format is not None and response_format["type"] == "json_object":
        w.system_note("response-format", _JSON_OBJECT_BODY)
    elif response_format is not None and response_format["type"] == "json_schema":
        schema = compact_json(sort_keys_deep(_response_schema(response_format)))
        w.system_note("response-format", _JSON_SCHEMA_BODY.format(schema=schema))
