"""OpenAI's Responses API, ``POST /v1/responses``: text and function calls, non-streaming and streaming.

A request is turned into the chat request it means (``input`` items -> messages, flat function tools ->
chat tools, ``max_output_tokens`` -> ``max_tokens``, ``reasoning.effort`` -> ``reasoning_effort``) and runs
through the chat path (same rendering, K3 output parser, admission and cleanup). The parsed reasoning,
text and tool calls come back as ``reasoning``, ``message`` and ``function_call`` output items; streamed,
as the Responses events (``response.created`` ... ``response.output_text.delta`` ...
``response.completed``), each an SSE ``event:`` + ``data:`` pair; every event carries a snapshot
taken when it is made (the official client's ``responses.stream()`` accumulates them).

Request fields: ``text.format`` (text / json_object / json_schema) is the chat ``response_format``;
``truncation: "disabled"``, ``background: false``, ``store: false``, ``include: []`` are what kimik3
does; ``prompt_cache_key`` and ``safety_identifier`` are accepted no-ops (the prefix cache is keyed by
content; no per-user state), ``service_tier`` is echoed (one local tier). Refused, with the reason:
``store: true``, ``previous_response_id``, ``background: true`` (nothing is stored to poll),
``truncation: "auto"`` (prompts are never truncated), ``include`` entries (no encrypted reasoning; the
reasoning text is in the output; logprobs are served by /v1/chat/completions), ``top_logprobs``,
``max_tool_calls``, ``text.verbosity``, ``stream_options.include_obfuscation: true``.
"""

from __future__ import annotations

import copy
import json
import re
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from pydantic import ValidationError

from kimik3.serve.chat import chat_prompt
from kimik3.serve.engine_loop import ChoiceDelta, PromptInput
from kimik3.serve.exchange import check_model, max_tokens_for, parse_body, run_job, sampling_params
from kimik3.serve.protocol import APIError, ChatCompletionRequest, _Body, bad_request, validation_error
from kimik3.serve.responses import ChatFormatter

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_EFFORTS = {"none": "none", "minimal": "low", "low": "low", "medium": "medium", "high": "high", "max": "max"}


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: str | None = None
    background: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None          # accepted no-op: the prefix cache is keyed by content
    safety_identifier: str | None = None         # accepted no-op, like user
    stream_options: dict[str, Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None


def _content(parts: Any, where: str) -> Any:
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts", f"{where}.content")
    out = []
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            text = part.get("text", "")
            if not isinstance(text, str):
                raise bad_request(f"{where}.content[{k}].text must be a string, got {type(text).__name__}",
                                  f"{where}.content[{k}].text")
            out.append({"type": "text", "text": text})
        elif kind == "input_image":
            url = part.get("image_url")
            out.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise bad_request(f"{where}.content[{k}]: unsupported content part type {kind!r} (kimik3 takes "
                              f"input_text, output_text and input_image)", f"{where}.content[{k}]")
    return out


def to_messages(req: ResponsesRequest, origins: list[str] | None = None) -> list[dict[str, Any]]:
    """``instructions`` + ``input`` -> chat messages (function calls and their outputs included). ``origins``, if
    given, gets the request field each message came from (``instructions``, ``input``, ``input[i]``)."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions, "_from": "instructions"})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input, "_from": "input"})
        return _origins(messages, origins)
    pending_reasoning: str | None = None

    def assistant() -> dict[str, Any]:
        nonlocal pending_reasoning
        last = messages[-1] if messages else None
        if last is None or last.get("role") != "assistant" or last.get("_closed"):
            last = {"role": "assistant", "content": "", "_from": where}
            messages.append(last)
        if pending_reasoning is not None:
            last["reasoning_content"] = pending_reasoning
            pending_reasoning = None
        return last

    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role")) if isinstance(item.get("role"), str) else None
            if role is None:
                raise bad_request(f"{where}.role must be user, assistant, system or developer, got "
                                  f"{item.get('role')!r}", f"{where}.role")
            content = _content(item.get("content", ""), where)
            if role == "assistant":
                msg = assistant()
                text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
                msg["content"] = (msg.get("content") or "") + text
            else:
                messages.append({"role": role, "content": content, "_from": where})
        elif kind == "function_call":
            msg = assistant()
            msg.setdefault("tool_calls", []).append(
                {"id": item.get("call_id"), "type": "function",
                 "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = json.dumps(output)
            if messages and messages[-1].get("role") == "assistant":
                messages[-1]["_closed"] = True
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output, "_from": where})
        elif kind == "reasoning":
            parts = item.get("content") or []
            if not isinstance(parts, list):
                raise bad_request(f"{where}.content: a reasoning item's content is a list of reasoning_text parts",
                                  f"{where}.content")
            texts = [c.get("text", "") for c in parts if isinstance(c, dict)]
            if not all(isinstance(t, str) for t in texts):
                raise bad_request(f"{where}.content: reasoning text must be a string", f"{where}.content")
            pending_reasoning = "".join(texts)
        else:
            raise bad_request(f"{where}: unsupported input item type {kind!r} (kimik3 takes message, "
                              f"function_call, function_call_output and reasoning)", f"{where}.type")
    for m in messages:
        m.pop("_closed", None)
    return _origins(messages, origins)


def _origins(messages: list[dict[str, Any]], origins: list[str] | None) -> list[dict[str, Any]]:
    found = [m.pop("_from") for m in messages]
    if origins is not None:
        origins[:] = found
    return messages


def renamed(e: APIError, origins: list[str]) -> APIError:
    """An error of the chat path about ``messages[i]`` (a bad image part, ...) naming the request field that
    message came from instead (``input[j]``, ``instructions``)."""
    m = re.match(r"messages\[(\d+)\]", e.param or "")
    if m is None or int(m[1]) >= len(origins):
        return e
    old, new = m[0], origins[int(m[1])]
    return APIError(e.status, e.message.replace(old, new), new + e.param[len(old):], e.code, e.headers)


SERVICE_TIERS = ("auto", "default")


def check_service_tier(tier: str | None) -> None:
    """``service_tier``: one local tier, so ``auto`` and ``default`` are echoed; the cloud tiers are a 400."""
    if tier is not None and tier not in SERVICE_TIERS:
        raise bad_request(f"service_tier {tier!r}: this server has one tier; send 'auto' or 'default' (or leave it "
                          f"out)", "service_tier")


def _text_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` -> the chat ``response_format`` (None: plain text)."""
    if text is None:
        return None
    extra = sorted(set(text) - {"format", "verbosity"})
    if extra:
        raise bad_request(f"text.{extra[0]}: kimik3 does not support this field; remove it", f"text.{extra[0]}",
                          "unsupported_field")
    if text.get("verbosity") is not None:
        raise bad_request("text.verbosity: K3 has no verbosity control; ask for brevity in the instructions",
                          "text.verbosity", "unsupported_field")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object with a 'type'", "text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        if len(fmt) > 1:
            raise bad_request(f"text.format of type {kind!r} takes no other fields", "text.format")
        return None if kind == "text" else {"type": "json_object"}
    if kind == "json_schema":
        extra = sorted(set(fmt) - {"type", "name", "schema", "strict", "description"})
        if extra:
            raise bad_request(f"text.format.{extra[0]} is not supported (json_schema takes name, schema, strict, "
                              f"description)", f"text.format.{extra[0]}", "unsupported_field")
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format.schema must be a JSON schema object", "text.format.schema")
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    raise bad_request(f"text.format.type must be text, json_object or json_schema, got {kind!r}", "text.format.type")


def _refuse_unserved(req: ResponsesRequest) -> None:
    if req.store:
        raise bad_request("this server stores no responses; send store=false (or leave it out)", "store")
    if req.previous_response_id is not None:
        raise bad_request("previous_response_id needs stored responses, which this server does not keep; "
                          "send the whole conversation as input", "previous_response_id")
    if req.background:
        raise bad_request("background responses are stored to be polled, and this server stores none; send "
                          "background=false and wait for (or stream) the response", "background")
    if req.truncation not in (None, "disabled"):
        raise bad_request(f"truncation {req.truncation!r}: prompts are never truncated; send 'disabled' (or leave it "
                          f"out) and shorten the input", "truncation")
    if req.include:
        raise bad_request(f"include {req.include[0]!r} is not supported: reasoning is returned as plain text in the "
                          f"output (nothing is encrypted) and per-token logprobs are served by /v1/chat/completions; "
                          f"send include=[]", "include")
    if req.top_logprobs is not None:
        raise bad_request("top_logprobs is not supported on /v1/responses; /v1/chat/completions serves logprobs",
                          "top_logprobs", "unsupported_field")
    if req.max_tool_calls is not None:
        raise bad_request("max_tool_calls is not supported; use parallel_tool_calls=false for at most one call",
                          "max_tool_calls", "unsupported_field")
    opts = req.stream_options or {}
    extra = sorted(set(opts) - {"include_obfuscation"})
    if extra:
        raise bad_request(f"stream_options.{extra[0]}: kimik3 does not support this field", f"stream_options.{extra[0]}",
                          "unsupported_field")
    if opts.get("include_obfuscation"):
        raise bad_request("stream_options.include_obfuscation=true is not supported: events carry no padding; send "
                          "false", "stream_options.include_obfuscation", "unsupported_field")
    check_service_tier(req.service_tier)


def to_chat_request(req: ResponsesRequest, origins: list[str] | None = None) -> ChatCompletionRequest:
    """The chat request ``req`` means; ``origins``: as ``to_messages``'."""
    _refuse_unserved(req)
    tools = None
    if req.tools is not None:
        tools = []
        for k, t in enumerate(req.tools):
            if t.get("type") != "function" or not isinstance(t.get("name"), str):
                raise bad_request(f"tools[{k}] must be {{'type': 'function', 'name': str, 'parameters': {{...}}}} "
                                  f"(kimik3 serves function tools only)", f"tools[{k}]")
            fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
            if t.get("description"):
                fn["description"] = t["description"]
            tools.append({"type": "function", "function": fn})
    tool_choice = req.tool_choice
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        tool_choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
    effort = None
    if req.reasoning is not None:
        raw = req.reasoning.get("effort")
        if raw is not None and not isinstance(raw, str):
            raise bad_request(f"reasoning.effort must be a string, got {type(raw).__name__}", "reasoning.effort")
        if raw is not None:
            effort = _EFFORTS.get(raw, raw)
    body = {"model": req.model, "messages": to_messages(req, origins), "max_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed,
            "stream": req.stream, "tools": tools, "tool_choice": tool_choice,
            "parallel_tool_calls": req.parallel_tool_calls, "reasoning_effort": effort,
            "response_format": _text_format(req.text)}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        raise validation_error(e) from None


class ResponsesFormatter:
    """Feeds a ``ChatFormatter`` (one choice) and speaks the Responses API: the final ``response`` object,
    or the stream of events. ``cache_unit``: the token granularity at which the prefix cache keeps a prompt
    (0: prefix caching off), for ``usage.input_tokens_details.cache_write_tokens``."""

    def __init__(self, request_id: str, model: str, prompt, tokenizer, req: ResponsesRequest, cache_unit: int = 0):
        self.id = request_id
        self.chat = ChatFormatter(request_id, model, prompt, 1, None, tokenizer, False)
        self.model = model
        self.req = req
        self.cache_unit = cache_unit
        self.created = int(time.time())
        self.seq = 0
        self.items: list[dict[str, Any]] = []      # output items, in order
        self.open: dict[str, Any] | None = None    # the reasoning or message item being streamed
        self.finish: str | None = None
        self.started = False

    # ---- the response object ----------------------------------------------------------------------
    def _usage(self, usage: dict) -> dict[str, Any]:
        prompt, cached = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
        kept = prompt // self.cache_unit * self.cache_unit if self.cache_unit else 0
        return {"input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": max(0, kept - cached)},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self.chat.parses[0].reasoning_tokens},
                "total_tokens": usage["total_tokens"]}

    def _response(self, status: str, usage: dict | None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        fmt = (self.req.text or {}).get("format") or {"type": "text"}
        body = {"id": self.id, "object": "response", "created_at": self.created, "model": self.model,
                "status": status, "error": None, "incomplete_details": incomplete,
                "instructions": self.req.instructions, "max_output_tokens": self.req.max_output_tokens,
                "output": self.items if status != "in_progress" else [],
                "parallel_tool_calls": self.req.parallel_tool_calls is not False,
                "temperature": self.req.temperature, "top_p": self.req.top_p,
                "tool_choice": self.req.tool_choice or "auto", "tools": self.req.tools or [], "store": False,
                "background": False, "truncation": "disabled", "text": {"format": fmt},
                "metadata": self.req.metadata or {}, "service_tier": self.req.service_tier or "default"}
        if self.req.reasoning is not None:
            body["reasoning"] = {"effort": self.req.reasoning.get("effort"), "summary": None}
        if usage is not None:
            body["usage"] = self._usage(usage)
        return body

    def _status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    def final(self, usage: dict) -> dict[str, Any]:
        chat = self.chat.final(usage)
        choice = chat["choices"][0]
        msg = choice["message"]
        self.finish = choice["finish_reason"]
        if msg.get("reasoning_content"):
            self.items.append(_reasoning_item(f"rs_{uuid.uuid4().hex}", msg["reasoning_content"], "completed"))
        if msg.get("content"):
            self.items.append(_message_item(f"msg_{uuid.uuid4().hex}", msg["content"], "completed"))
        for call in msg.get("tool_calls") or []:
            self.items.append(_call_item(call, "completed"))
        return self._response(self._status(), usage)

    # ---- streaming --------------------------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> dict[str, Any]:
        """One event, its fields copied now: items keep growing after it is made and sent later."""
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **copy.deepcopy(fields)}

    def _close_open(self) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        idx = self.items.index(item)
        item["status"] = "completed"
        part = item["content"][0]
        done = ("response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done")
        extra = {} if item["type"] == "reasoning" else {"logprobs": []}
        return [self._event(done, item_id=item["id"], output_index=idx, content_index=0, text=part["text"], **extra),
                self._event("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=idx, item=item)]

    def _open(self, kind: str) -> list[dict[str, Any]]:
        if self.open is not None and self.open["type"] == kind:
            return []
        events = self._close_open()
        if kind == "reasoning":
            item = _reasoning_item(f"rs_{uuid.uuid4().hex}", "", "in_progress")
        else:
            item = _message_item(f"msg_{uuid.uuid4().hex}", "", "in_progress")
        self.items.append(item)
        self.open = item
        idx = len(self.items) - 1
        events.append(self._event("response.output_item.added", output_index=idx, item={**item, "content": []}))
        events.append(self._event("response.content_part.added", item_id=item["id"], output_index=idx,
                                  content_index=0, part=item["content"][0]))
        return events

    def _text_delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = self._open(kind)
        self.open["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self._event(name, item_id=self.open["id"], output_index=len(self.items) - 1, content_index=0,
                                  delta=text, **extra))
        return events

    def _call_events(self, call: dict) -> list[dict[str, Any]]:
        events = self._close_open()
        item = _call_item(call, "in_progress")
        self.items.append(item)
        idx = len(self.items) - 1
        events.append(self._event("response.output_item.added", output_index=idx, item={**item, "arguments": ""}))
        events.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=idx,
                                  delta=item["arguments"]))
        events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                                  arguments=item["arguments"], name=item["name"]))
        item["status"] = "completed"
        events.append(self._event("response.output_item.done", output_index=idx, item=item))
        return events

    def feed(self, deltas: list[ChoiceDelta], streaming: bool) -> list[dict[str, Any]]:
        if not streaming:
            self.chat.feed(deltas, streaming=False)
            return []
        events: list[dict[str, Any]] = []
        if not self.started:
            self.started = True
            skeleton = self._response("in_progress", None)
            events += [self._event("response.created", response=skeleton),
                       self._event("response.in_progress", response=skeleton)]
        for chunk in self.chat.feed(deltas, streaming=True):
            choice = chunk["choices"][0]
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                events += self._text_delta("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text_delta("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call_events(call)
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
        return events

    def usage_chunk(self, usage: dict) -> list[dict[str, Any]]:
        """The stream's end: close the open item, then ``response.completed`` (or ``.incomplete``)."""
        events = self._close_open()
        status = self._status()
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self._event(kind, response=self._response(status, usage))]

    done_marker = False                    # the Responses stream ends with its last event, no [DONE]

    @staticmethod
    def sse(events) -> bytes:
        if isinstance(events, dict):
            events = [events]
        out = b""
        for e in events:
            kind = e.get("type", "error") if "error" not in e else "error"
            out += f"event: {kind}\n".encode() + b"data: " + json.dumps(e, ensure_ascii=False).encode() + b"\n\n"
        return out


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(call: dict, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def prefix_cache_unit(engine) -> int:
    """Tokens per reusable prefix-cache step (blocks x the KDA checkpoint interval), 0 with caching off."""
    kv = engine.kv
    return kv.block_size * kv.interval if kv.enable_prefix_caching else 0


def add_responses_route(app: FastAPI, state) -> None:
    @app.post("/v1/responses")
    async def responses(request: Request):
        req: ResponsesRequest = await parse_body(state, request, ResponsesRequest)
        name = check_model(state, req.model)
        origins: list[str] = []
        chat = to_chat_request(req, origins)
        tok = state.tokenizer
        if tok is None:
            raise bad_request("this server has no tokenizer, so it cannot render conversations")
        try:
            prompt = await chat_prompt(state, chat, "input")
        except APIError as e:
            raise renamed(e, origins) from None
        max_tokens = max_tokens_for(state, chat.max_tokens, "max_output_tokens", len(prompt.token_ids), "input")
        params = sampling_params(chat, max_tokens, None, tok.stop_token_ids, state.options.generation_defaults,
                                 prompt.constraint, state.max_logprobs, prompt.bad_token_sequences)
        fmt = ResponsesFormatter(f"resp_{uuid.uuid4().hex}", name, prompt, tok, req, prefix_cache_unit(state.engine))
        return await run_job(state, request, [PromptInput(prompt.token_ids, prompt.images)], params, fmt, req.stream,
                          True)
