"""Chat requests -> prompt ids (+ images), and generated text -> reasoning, content and tool calls.

Prompts are rendered with the checkpoint tokenizer's chat template and tokenised segment by segment,
so message text never becomes special ids. Images and videos (``serve/media.py``) are preprocessed here
and rendered as their K3 prompts (an image's, each video chunk's with its timestamp) with one
``<|media_pad|>`` per encoder row. Output is parsed by ``K3OutputParser`` per choice, fed
the streamed text deltas, so streamed and non-streamed answers agree.
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass, field
from typing import Any

from kimik3.chat import K3OutputParser, ParseDelta
from kimik3.chat.options import ChatOptionError, ThinkingOptions, drop_past_reasoning, thinking_options
from kimik3.engine.sample.sampling_params import StructuredOutputsParams
from kimik3.serve.limits import check_text_fits, message_text_chars
from kimik3.serve.media import MediaOptions, check_media_counts, collect_media, load_media, media_io_sampling
from kimik3.serve.protocol import ChatCompletionRequest, bad_request, context_exceeded
from kimik3.serve.structured import MAX_PARALLEL_CALLS, k3_answer_grammar, request_constraint, response_format_constraint
from kimik3.tokenizer import TooManyTokens



@dataclass
class ChatPrompt:
    token_ids: list[int]
    images: Any                      # VisionInputs or None
    thinking: bool
    parse_tools: list[dict] | None   # tools whose calls become tool_calls ([] = none; calls stay content)
    constraint: StructuredOutputsParams | None = None   # what decoding is held to (serve/structured.py)
    bad_token_sequences: list[list[int]] | None = None  # never generated: the tool-section guard


@functools.lru_cache(maxsize=8)
def tool_section_guard(tokenizer) -> tuple[tuple[int, int], ...]:
    """The token pairs that every spelling of the K3 tools-section opener ``<|open|>tools<|sep|>`` begins with:
    the ``<|open|>`` token, then a token whose bytes start the word ``tools`` (``t``, ``to``, ..., ``tools``,
    ``tools...``). Banning the second after the first (a bad word of two tokens) leaves no way to open the
    section, whatever the tokenization, and costs one lookup a step; ``<|open|>`` is not otherwise followed
    by ``t`` in an answer (``response``, and ``tools`` only when calls may be made). An opener spelt with
    plain characters is not masked; the parser drops its calls (``tools=[]``)."""
    open_id = tokenizer.convert_tokens_to_ids("<|open|>")
    word = b"tools"
    seconds = [t for t in range(tokenizer.num_base_tokens)
               if (b := tokenizer.token_bytes(t)) and (word.startswith(b) or b.startswith(word))]
    return tuple((open_id, t) for t in seconds)


def _thinking_options(req: ChatCompletionRequest) -> ThinkingOptions:
    try:
        return thinking_options(req.chat_template_kwargs, req.thinking, req.reasoning_effort)
    except ChatOptionError as e:
        raise bad_request(str(e), e.param) from None


def _messages(req: ChatCompletionRequest, preserve: bool) -> list[dict]:
    """The conversation to render: OpenAI's ``developer`` role is a system message (K3's format has no
    developer role; OpenAI's own models read it as the system prompt), and without ``preserve`` the
    reasoning of earlier turns is dropped."""
    msgs = [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m
            for m in req.messages]
    return msgs if preserve else drop_past_reasoning(msgs)


def _tool_options(req: ChatCompletionRequest) -> tuple[Any, list[dict] | None, str | None, list[dict]]:
    """(tool_choice for the template, tools to parse calls against, the tool constraint: None, "auto"
    or "required", the tools it allows)."""
    tc = req.tool_choice
    for k, t in enumerate(req.tools or []):
        fn = t.get("function")
        if t.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"tools[{k}] must be {{'type': 'function', 'function': {{'name': str, ...}}}}",
                              f"tools[{k}]")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(f"tools[{k}].function.parameters must be a JSON schema object",
                              f"tools[{k}].function.parameters")
    if isinstance(tc, dict):
        fn = tc.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tc.get("type", "function") != "function" or not isinstance(name, str):
            raise bad_request("a named tool_choice is {'type': 'function', 'function': {'name': str}}", "tool_choice")
        chosen = [t for t in req.tools or [] if t["function"]["name"] == name]
        if not chosen:
            raise bad_request(f"tool_choice names {name!r}, which is not in 'tools'", "tool_choice")
        return tc, req.tools, "required", chosen[:1]
    if tc not in (None, "auto", "none", "required"):
        raise bad_request(f"tool_choice must be 'auto', 'none', 'required' or a named function, got {tc!r}",
                          "tool_choice")
    if tc == "required" and not req.tools:
        raise bad_request("tool_choice='required' needs a non-empty 'tools' list", "tool_choice")
    parse_tools = req.tools if req.tools and tc != "none" else []
    mode = None if not parse_tools else ("required" if tc == "required" else "auto")
    return (tc if tc in ("none", "required") else None), parse_tools, mode, parse_tools


def _response_format(req: ChatCompletionRequest) -> dict | None:
    """The response_format for the chat template's note (checked), or None for none / text."""
    return None if response_format_constraint(req.response_format) is None else req.response_format


def _constraint(req: ChatCompletionRequest, k3: bool, thinking: bool, tool_mode: str | None,
                tools: list[dict]) -> StructuredOutputsParams | None:
    content = request_constraint(req)
    if not k3:                       # Kimi-Linear: no channels to wrap; tool calls stay unconstrained
        if tool_mode == "required":
            raise bad_request("tool_choice 'required' or a named function needs the K3 chat format", "tool_choice")
        return content
    if content is None and tool_mode is None:
        return None
    calls = 1 if req.parallel_tool_calls is False or isinstance(req.tool_choice, dict) else MAX_PARALLEL_CALLS
    try:
        grammar = k3_answer_grammar(thinking=thinking, content=content, tools=tools, tool_mode=tool_mode,
                                    max_calls=calls)
    except ValueError as e:         # a schema nested too deeply, a malformed JSON grammar
        raise bad_request(str(e), "tools" if content is None else None, "invalid_constraint") from None
    return StructuredOutputsParams(grammar=grammar)


def build_chat_prompt(req: ChatCompletionRequest, tokenizer, processor_cfg, has_vision: bool,
                      max_image_tokens: int | None = None, media: MediaOptions | None = None,
                      limit_mm_per_prompt: dict | None = None, param: str = "messages",
                      max_prompt_tokens: int | None = None) -> ChatPrompt:
    """``max_image_tokens``: the most image and video tokens a prompt can hold (checked from the headers,
    before any image or video is decoded); ``media``: where media may come from and what a video may cost
    (``serve/media.py``); ``limit_mm_per_prompt``: the most images / videos a request may hold;
    ``max_prompt_tokens``: a longer prompt is refused as soon as its tokens pass it (the context)."""
    opts = _thinking_options(req)
    thinking, effort = opts.thinking, opts.effort
    if not req.add_generation_prompt:
        raise bad_request("add_generation_prompt=false is not supported: the answer always starts a new assistant "
                          "message", "add_generation_prompt", "unsupported_field")
    if req.continue_final_message:
        raise bad_request("continue_final_message=true is not supported: the answer always starts a new assistant "
                          "message", "continue_final_message", "unsupported_field")
    tool_choice, parse_tools, tool_mode, constrained_tools = _tool_options(req)
    response_format = _response_format(req)
    try:
        sampling = media_io_sampling(req.media_io_kwargs)
    except ValueError as e:
        raise bad_request(str(e), "media_io_kwargs") from None
    refs = collect_media(req.messages, media)
    check_media_counts(refs, limit_mm_per_prompt, param)
    loaded = load_media(refs, processor_cfg, media, sampling, max_image_tokens, has_vision, param) if refs else None
    kwargs = {"tools": req.tools, "tokenize": True, "add_generation_prompt": True, "thinking": thinking,
              "thinking_effort": effort if thinking else None, "tool_choice": tool_choice,
              "response_format": response_format, "images": loaded and loaded.images,
              "videos": loaded and loaded.videos}
    if tokenizer.chat_format != "k3":   # Kimi-Linear: no thinking channel, tool choice or response format notes
        kwargs.update(thinking_effort=None, tool_choice=None, response_format=None)
    try:
        ids = tokenizer.apply_chat_template(_messages(req, opts.preserve), **kwargs, limit=max_prompt_tokens)
    except TooManyTokens:
        raise context_exceeded(max_prompt_tokens, param) from None
    except (ValueError, TypeError, KeyError) as e:
        raise bad_request(f"cannot render the conversation: {e}", "messages") from None
    k3 = tokenizer.chat_format == "k3"
    constraint = _constraint(req, k3, thinking, tool_mode, constrained_tools)
    if not k3:
        thinking, parse_tools = False, None
    guard = [list(p) for p in tool_section_guard(tokenizer)] if k3 and not parse_tools else None
    return ChatPrompt(ids, loaded and loaded.vision, thinking, parse_tools, constraint, guard)


async def chat_prompt(state, req: ChatCompletionRequest, param: str = "messages") -> ChatPrompt:
    """``build_chat_prompt`` with the server's options, on its CPU pool (a text that cannot fit the context is
    refused before)."""
    o = state.options
    check_text_fits(state.tokenizer, message_text_chars(req.messages), state.max_model_len, param)
    return await state.cpu(build_chat_prompt, req, state.tokenizer, o.processor_config, state.has_vision,
                           max_image_tokens=state.max_model_len - 1, media=o.media,
                           limit_mm_per_prompt=o.limit_mm_per_prompt, param=param,
                           max_prompt_tokens=state.max_model_len)


@dataclass
class ChoiceParse:
    """Per-choice parse state: what has been sent, for the final message and finish reason."""

    parser: K3OutputParser | None
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)
    role_sent: bool = False
    reasoning_tokens: int = 0        # tokens fed while the parser was in the think channel

    def in_thinking(self) -> bool:
        return self.parser is not None and self.parser.state.startswith("think")

    def feed(self, text: str, final: bool) -> ParseDelta:
        if self.parser is None:
            d = ParseDelta(content=text)
        else:
            d = self.parser.feed(text) if text else ParseDelta()
            if final:
                tail = self.parser.finish()
                d = ParseDelta(d.reasoning + tail.reasoning, d.content + tail.content, d.tool_calls + tail.tool_calls)
        self.reasoning.append(d.reasoning)
        self.content.append(d.content)
        return d

    def calls_json(self, delta: ParseDelta, streaming: bool) -> list[dict]:
        out = []
        for call in delta.tool_calls:
            entry = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}
            self.tool_calls.append(entry)
            out.append({"index": call.index, **entry} if streaming else entry)
        return out


def make_parse(prompt: ChatPrompt) -> ChoiceParse:
    if prompt.parse_tools is None:
        return ChoiceParse(None)
    return ChoiceParse(K3OutputParser(thinking=prompt.thinking, tools=prompt.parse_tools))


def chat_finish_reason(reason: str | None, parse: ChoiceParse) -> str | None:
    if reason == "stop" and parse.tool_calls:
        return "tool_calls"
    return reason
