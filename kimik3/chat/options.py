"""Request-level chat options -> render options, one reading for the server and ``LLM.chat``.

Moonshot's and vLLM's ways of asking for thinking, each honoured:

- ``chat_template_kwargs`` keys (the only ones taken; any other is an error naming it):
  ``thinking`` / ``enable_thinking`` (bool), ``thinking_effort`` (low / medium / high / max, or None for
  no effort message), ``preserve_thinking`` (bool, default true: the reasoning of earlier assistant turns
  is rendered, as the K3 encoder always does; false drops it before the last user message, keeping the
  reasoning of the current turn's tool loop);
- Moonshot's ``thinking`` object ``{"type": "enabled" | "disabled", "keep": "all" | null, "effort": ...}``:
  ``keep: "all"`` preserves earlier reasoning, an explicit ``keep: null`` drops it (Moonshot's "not
  kept"), no ``keep`` leaves the template's rule;
- OpenAI's ``reasoning_effort``: ``none`` turns thinking off, low / medium / high / max set the effort.

``medium`` is rendered as given: the K3 effort message lists low, medium, high and max (the official
encoder only asserts against it, spec D27). Settings that disagree (thinking on in one place, off in
another; two different efforts) are an error naming both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TEMPLATE_KWARGS = ("thinking", "enable_thinking", "thinking_effort", "preserve_thinking")
EFFORTS = ("low", "medium", "high", "max")
THINKING_KEYS = ("type", "keep", "effort")


class ChatOptionError(ValueError):
    """A bad chat option; ``param`` names the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ThinkingOptions:
    thinking: bool = True
    effort: str | None = "max"       # None: no effort message
    preserve: bool = True            # render the reasoning of earlier turns


def _set(found: dict[str, tuple[Any, str]], key: str, value: Any, where: str) -> None:
    if key in found and found[key][0] != value:
        raise ChatOptionError(f"{where}={value!r} disagrees with {found[key][1]}={found[key][0]!r}; give one", where)
    found[key] = (value, where)


def _effort(value: Any, where: str) -> str:
    if value not in EFFORTS:
        raise ChatOptionError(f"{where} must be one of {', '.join(EFFORTS)}, got {value!r}", where)
    return value


def _from_template_kwargs(kwargs: dict, found: dict, prefix: str) -> None:
    unknown = sorted(set(kwargs) - set(TEMPLATE_KWARGS))
    if unknown:
        raise ChatOptionError(f"{prefix}{unknown[0]} is not a K3 chat template option (unknown: {unknown}); the "
                              f"options are {', '.join(TEMPLATE_KWARGS)}", f"{prefix}{unknown[0]}")
    for key in ("thinking", "enable_thinking", "preserve_thinking"):
        if key in kwargs:
            if not isinstance(kwargs[key], bool):
                raise ChatOptionError(f"{prefix}{key} must be a bool, got {kwargs[key]!r}", f"{prefix}{key}")
            _set(found, "preserve" if key == "preserve_thinking" else "thinking", kwargs[key], f"{prefix}{key}")
    if "thinking_effort" in kwargs:
        value = kwargs["thinking_effort"]
        _set(found, "effort", None if value is None else _effort(value, f"{prefix}thinking_effort"),
             f"{prefix}thinking_effort")


def _from_thinking_object(obj: Any, found: dict) -> None:
    if not isinstance(obj, dict):
        raise ChatOptionError(f"thinking must be an object like {{'type': 'enabled'}}, got {obj!r}", "thinking")
    unknown = sorted(set(obj) - set(THINKING_KEYS))
    if unknown:
        raise ChatOptionError(f"thinking.{unknown[0]} is not supported; thinking takes type, keep and effort",
                              f"thinking.{unknown[0]}")
    if "type" in obj:
        if obj["type"] not in ("enabled", "disabled"):
            raise ChatOptionError(f"thinking.type must be 'enabled' or 'disabled', got {obj['type']!r}", "thinking.type")
        _set(found, "thinking", obj["type"] == "enabled", "thinking.type")
    if "keep" in obj:
        if obj["keep"] not in ("all", None):
            raise ChatOptionError(f"thinking.keep must be 'all' or null, got {obj['keep']!r}", "thinking.keep")
        _set(found, "preserve", obj["keep"] == "all", "thinking.keep")
    if obj.get("effort") is not None:
        _set(found, "effort", _effort(obj["effort"], "thinking.effort"), "thinking.effort")


def thinking_options(template_kwargs: dict | None = None, thinking: Any = None, reasoning_effort: str | None = None,
                     kwargs_name: str = "chat_template_kwargs") -> ThinkingOptions:
    """The render options a request asks for (ChatOptionError naming the field otherwise)."""
    found: dict[str, tuple[Any, str]] = {}
    if template_kwargs:
        _from_template_kwargs(template_kwargs, found, f"{kwargs_name}.")
    if thinking is not None:
        _from_thinking_object(thinking, found)
    if reasoning_effort is not None:
        if reasoning_effort == "none":
            _set(found, "thinking", False, "reasoning_effort")
        else:
            if reasoning_effort not in EFFORTS:
                raise ChatOptionError(f"reasoning_effort must be one of none, {', '.join(EFFORTS)}, got "
                                      f"{reasoning_effort!r}", "reasoning_effort")
            _set(found, "effort", reasoning_effort, "reasoning_effort")
    get = {k: v[0] for k, v in found.items()}
    return ThinkingOptions(get.get("thinking", True), get.get("effort", "max"), get.get("preserve", True))


def drop_past_reasoning(messages: list) -> list:
    """The conversation without the reasoning of assistant turns before the last user message (the
    current turn's tool loop keeps its reasoning)."""
    last_user = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"),
                    default=-1)
    out = []
    for i, m in enumerate(messages):
        if i < last_user and isinstance(m, dict) and m.get("role") == "assistant":
            m = {k: v for k, v in m.items() if k not in ("reasoning_content", "reasoning")}
        out.append(m)
    return out
