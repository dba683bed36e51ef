"""Kimi-Linear-48B-A3B chat rendering: the Kimi-K2-style ``<|im_*|>`` format.

Each message is ``ROLE_TOKEN name <|im_middle|> body <|im_end|>`` with role tokens ``<|im_system|>``,
``<|im_user|>``, ``<|im_assistant|>`` (tool results use ``<|im_system|>``). A ``tool_declare`` system
turn lists the tools first; a default system turn is inserted when the conversation does not start with
one. Assistant tool calls follow the content inside ``<|tool_calls_section_begin|>`` ... ``_end|>``; a
tool result body starts with ``## Return of {tool_call_id}``. Generation prompt:
``<|im_assistant|>assistant<|im_middle|>``; the model stops on ``<|im_end|>``.

Kimi-Linear Instruct has no thinking channel, so ``thinking``/``thinking_effort`` are ignored;
``tool_choice`` other than None/"auto" and JSON ``response_format`` have no rendering here and are
rejected. Images are not supported (the model is text-only).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kimik3.chat.k3 import check_conversation
from kimik3.chat.segments import Segment

IM_SYSTEM, IM_USER, IM_ASSISTANT = "<|im_system|>", "<|im_user|>", "<|im_assistant|>"
IM_MIDDLE, IM_END = "<|im_middle|>", "<|im_end|>"
CALLS_BEGIN, CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, CALL_ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
STOP_TOKEN = IM_END
DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

_ROLE_TOKEN = {"system": IM_SYSTEM, "user": IM_USER, "assistant": IM_ASSISTANT, "tool": IM_SYSTEM}


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TypeError(f"{where}: content must be a str, a list of parts or None, got {type(content).__name__}")
    out = []
    for k, part in enumerate(content):
        if not isinstance(part, dict):
            raise TypeError(f"{where}: content part {k} must be a dict, got {type(part).__name__}")
        if part.get("type") != "text":
            raise ValueError(f"{where}: Kimi-Linear takes only text parts, got {part.get('type')!r}")
        if not isinstance(part.get("text"), str):
            raise TypeError(f"{where}: text part {k} needs a str 'text'")
        out.append(part["text"])
    return "".join(out)


def render_kimi_linear(
    conversation: Any,
    tools: list[dict] | None = None,
    *,
    add_generation_prompt: bool = True,
    thinking: bool = True,
    thinking_effort: str | None = None,
    tool_choice: Any = None,
    response_format: dict | None = None,
    images: Sequence[Any] | None = None,
    videos: Sequence[Any] | None = None,
) -> list[Segment]:
    """Render an OpenAI-style conversation in Kimi-Linear's format (see the module docstring)."""
    conversation = check_conversation(conversation)
    if not isinstance(thinking, bool):
        raise TypeError(f"thinking must be a bool, got {type(thinking).__name__}")
    if tool_choice not in (None, "auto"):
        raise ValueError(f"Kimi-Linear's chat format has no tool_choice instruction; got {tool_choice!r}")
    if response_format is not None and (not isinstance(response_format, dict) or response_format.get("type") != "text"):
        raise ValueError(f"Kimi-Linear's chat format has no response_format instruction; got {response_format!r}")
    if images or videos:
        raise ValueError("Kimi-Linear is a text-only model; images and videos cannot be rendered")
    if tools is not None and not isinstance(tools, list):
        raise TypeError(f"tools must be a list of tool dicts, got {type(tools).__name__}")

    segs: list[Segment] = []

    def turn(role_token: str, name: str, body: list[Segment]) -> None:
        segs.append(Segment(role_token, special=True))
        segs.append(Segment(name))
        segs.append(Segment(IM_MIDDLE, special=True))
        segs.extend(s for s in body if s.text)
        segs.append(Segment(IM_END, special=True))

    if tools:
        turn(IM_SYSTEM, "tool_declare", [Segment(json.dumps(tools, ensure_ascii=False, separators=(",", ":")))])
    for i, m in enumerate(conversation):
        role = m["role"]
        where = f"message {i} ({role})"
        if i == 0 and role != "system":
            turn(IM_SYSTEM, "system", [Segment(DEFAULT_SYSTEM_PROMPT)])
        name = m.get("name") or role
        text = _content_text(m.get("content"), where)
        body = [Segment(text)]
        if role == "tool":
            body = [Segment(f"## Return of {m.get('tool_call_id', '')}\n"), Segment(text)]
        elif role == "assistant" and m.get("tool_calls"):
            body.append(Segment(CALLS_BEGIN, special=True))
            for k, call in enumerate(m["tool_calls"]):
                fn = call.get("function", call)
                args = fn.get("arguments", "")
                if isinstance(args, dict):
                    args = json.dumps(args, ensure_ascii=False)
                elif not isinstance(args, str):
                    raise TypeError(f"{where}: tool_calls[{k}] arguments must be a str or dict")
                call_id = call.get("id") or f"functions.{fn['name']}:{k}"
                body += [
                    Segment(CALL_BEGIN, special=True),
                    Segment(str(call_id)),
                    Segment(CALL_ARGS, special=True),
                    Segment(args),
                    Segment(CALL_END, special=True),
                ]
            body.append(Segment(CALLS_END, special=True))
        turn(_ROLE_TOKEN[role], name, body)
    if add_generation_prompt:
        segs += [Segment(IM_ASSISTANT, special=True), Segment("assistant"), Segment(IM_MIDDLE, special=True)]
    return segs
