"""OpenAI response bodies from engine deltas: chat.completion(.chunk) and text_completion.

A formatter is fed every ``ChoiceDelta`` of a job in order. Streaming, it returns the chunks to send
for those deltas; either way it accumulates, so ``final(usage)`` builds the non-streamed body.
"""

from __future__ import annotations

import time
from typing import Any

from kimik3.serve.chat import ChatPrompt, chat_finish_reason, make_parse
from kimik3.serve.engine_loop import ChoiceDelta


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": min(cached_tokens, prompt_tokens)}}


class _Tokens:
    """Token text and bytes for logprobs, cached per id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            tok = self.tokenizer
            if tok is None:
                hit = (f"token_id:{token_id}", [])
            elif tok.is_special_id(token_id):
                name = tok.convert_ids_to_tokens(token_id)
                hit = (name, list(name.encode()))
            else:
                raw = tok.token_bytes(token_id)
                hit = (raw.decode("utf-8", errors="replace"), list(raw))
            self._cache[token_id] = hit
        return hit


def _ranked(lp: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely entries (the engine adds the sampled token when it is not among them)."""
    return [(t, json_logprob(v)) for t, v in sorted(lp.items(), key=lambda kv: -kv[1])[:k]]


def json_logprob(value: float) -> float:
    """A logprob JSON can carry: -inf (a token the model gives no chance, forced by a constraint or a test
    script) becomes -9999.0, as vLLM sends it."""
    return max(value, -9999.0)


class _Formatter:
    """What the chat and completion formatters share: ids and the streamed chunk envelope."""

    chunk_object: str
    service_tier: str | None = None     # the request's, echoed on every body

    def __init__(self, request_id: str, model: str, tokenizer, include_usage: bool):
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.tokens = _Tokens(tokenizer)
        self.include_usage = include_usage

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": choices}
        if self.service_tier is not None:
            body["service_tier"] = self.service_tier
        if self.include_usage:
            body["usage"] = usage
        return body

    def usage_chunk(self, usage: dict) -> dict:
        return self._chunk([], usage)

    def _tier(self, body: dict) -> dict:
        if self.service_tier is not None:
            body["service_tier"] = self.service_tier
        return body

    def prompt_logprobs(self, lps: list[dict[int, float] | None]) -> list[dict | None]:
        """vLLM's prompt_logprobs: None for the first token, then {token id: {logprob, decoded_token}}."""
        out = []
        for d in lps:
            self.pace()         # between rows: set by the response's renderer (json_body.Pacer)
            out.append(None if d is None else {str(t): {"logprob": json_logprob(v), "decoded_token": self.tokens(t)[0]}
                                               for t, v in d.items()})
        return out

    @staticmethod
    def pace() -> None:
        return None

    def add_prompt_logprobs(self, body: dict, by_prompt: dict[int, list], n: int) -> dict:
        """Chat: one top-level ``prompt_logprobs``; completions: one per choice (choice i has prompt i // n)."""
        if self.chunk_object == "chat.completion.chunk":
            body["prompt_logprobs"] = self.prompt_logprobs(by_prompt.get(0, []))
        else:
            formatted = {k: self.prompt_logprobs(v) for k, v in by_prompt.items()}     # once per prompt, not choice
            for i, choice in enumerate(body["choices"]):
                choice["prompt_logprobs"] = formatted.get(i // n, [])
        return body


class ChatFormatter(_Formatter):
    chunk_object = "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, prompt: ChatPrompt, n: int, top_logprobs: int | None,
                 tokenizer, include_usage: bool):
        super().__init__(request_id, model, tokenizer, include_usage)
        self.parses = [make_parse(prompt) for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.logprobs: list[list[dict]] = [[] for _ in range(n)]
        self.top_logprobs = top_logprobs

    def _logprob_entries(self, d: ChoiceDelta) -> list[dict]:
        out = []
        for tid, lp in zip(d.token_ids, d.logprobs or []):
            text, raw = self.tokens(tid)
            top = []
            for t, v in _ranked(lp, self.top_logprobs or 0):
                tt, tb = self.tokens(t)
                top.append({"token": tt, "logprob": v, "bytes": tb})
            out.append({"token": text, "logprob": json_logprob(lp.get(tid, float("-inf"))), "bytes": raw,
                        "top_logprobs": top})
        return out

    def feed(self, deltas: list[ChoiceDelta], streaming: bool) -> list[dict]:
        chunks = []
        for d in deltas:
            parse = self.parses[d.index]
            if parse.in_thinking():
                parse.reasoning_tokens += len(d.token_ids)
            pd = parse.feed(d.text, final=d.finish_reason is not None)
            calls = parse.calls_json(pd, streaming)
            lps = self._logprob_entries(d) if self.top_logprobs is not None else None
            if lps:
                self.logprobs[d.index].extend(lps)
            if d.finish_reason is not None:
                self.finish[d.index] = chat_finish_reason(d.finish_reason, parse)
            if not streaming:
                continue
            delta: dict[str, Any] = {}
            if not parse.role_sent:
                delta["role"] = "assistant"
                parse.role_sent = True
            if pd.reasoning:          # current vLLM's name, and the older one clients still read
                delta["reasoning"] = delta["reasoning_content"] = pd.reasoning
            if pd.content or ("role" in delta and not pd.reasoning and not calls):
                delta["content"] = pd.content
            if calls:
                delta["tool_calls"] = calls
            if not delta and d.finish_reason is None and not lps:
                continue
            chunks.append(self._chunk([{"index": d.index, "delta": delta,
                                        "logprobs": {"content": lps} if lps is not None else None,
                                        "finish_reason": self.finish[d.index]}]))
        return chunks

    def final(self, usage: dict) -> dict:
        choices = []
        for i, p in enumerate(self.parses):
            content = "".join(p.content)
            thinking = p.parser is not None and p.parser.thinking
            reasoning = "".join(p.reasoning) if thinking else None
            msg: dict[str, Any] = {"role": "assistant", "content": content if content or not p.tool_calls else None,
                                   "reasoning": reasoning, "reasoning_content": reasoning, "tool_calls": p.tool_calls}
            choices.append({"index": i, "message": msg,
                            "logprobs": {"content": self.logprobs[i]} if self.top_logprobs is not None else None,
                            "finish_reason": self.finish[i]})
        return self._tier({"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                           "choices": choices, "usage": usage})


class CompletionFormatter(_Formatter):
    chunk_object = "text_completion"
    prompt_logprobs_per_choice = True      # each choice carries its prompt's prompt_logprobs

    def __init__(self, request_id: str, model: str, num_choices: int, logprobs: int | None, tokenizer,
                 include_usage: bool, echo_texts: list[str] | None, echo_ids: list[list[int]] | None = None,
                 prompt_logprobs_field: bool = True):
        """``echo_ids`` (echo with logprobs): each prompt's ids, whose logprobs open the choice's logprobs (the
        first token's are null), as OpenAI's and vLLM's echo gives them; ``prompt_logprobs_field``: vLLM's
        separate ``prompt_logprobs`` too (when the request asked for it)."""
        super().__init__(request_id, model, tokenizer, include_usage)
        self.echo_ids = echo_ids
        self.prompt_logprobs_field = prompt_logprobs_field
        self.texts = [[] for _ in range(num_choices)]
        self.finish: list[str | None] = [None] * num_choices
        self.num_logprobs = logprobs
        self.lp = [{"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                   for _ in range(num_choices)]
        self.offsets = [0] * num_choices
        self.echo = echo_texts

    def _logprobs(self, d: ChoiceDelta) -> dict | None:
        if self.num_logprobs is None:
            return None
        part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, lp in zip(d.token_ids, d.logprobs or []):
            text, _ = self.tokens(tid)
            part["tokens"].append(text)
            part["token_logprobs"].append(json_logprob(lp.get(tid, float("-inf"))))
            part["top_logprobs"].append({self.tokens(t)[0]: v for t, v in _ranked(lp, self.num_logprobs)})
            part["text_offset"].append(self.offsets[d.index])
            self.offsets[d.index] += len(text)
        acc = self.lp[d.index]
        for k, values in part.items():
            acc[k].extend(values)
        return part

    def feed(self, deltas: list[ChoiceDelta], streaming: bool) -> list[dict]:
        chunks = []
        for d in deltas:
            text = d.text
            if self.echo is not None and not self.texts[d.index]:
                text = self.echo[d.index] + text
                self.offsets[d.index] = len(self.echo[d.index])
            lp = self._logprobs(d)
            self.texts[d.index].append(text)
            if d.finish_reason is not None:
                self.finish[d.index] = d.finish_reason
            if streaming and (text or d.finish_reason is not None or lp):
                chunks.append(self._chunk([{"index": d.index, "text": text, "logprobs": lp,
                                            "finish_reason": d.finish_reason}]))
        return chunks

    def add_prompt_logprobs(self, body: dict, by_prompt: dict[int, list], n: int) -> dict:
        if self.echo_ids is not None:
            for i, choice in enumerate(body["choices"]):
                self._echo_logprobs(choice["logprobs"], self.echo_ids[i // n], by_prompt.get(i // n, []))
        return super().add_prompt_logprobs(body, by_prompt, n) if self.prompt_logprobs_field else body

    def _echo_logprobs(self, lp: dict, ids: list[int], rows: list) -> None:
        part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        for k, tid in enumerate(ids):
            row = rows[k] if k < len(rows) else None
            text = self.tokens(tid)[0]
            part["tokens"].append(text)
            part["token_logprobs"].append(None if row is None else json_logprob(row.get(tid, float("-inf"))))
            part["top_logprobs"].append(None if row is None else {self.tokens(t)[0]: v
                                                                  for t, v in _ranked(row, self.num_logprobs)})
            part["text_offset"].append(offset)
            offset += len(text)
        for key, values in part.items():
            lp[key][:0] = values

    def final(self, usage: dict) -> dict:
        choices = [{"index": i, "text": "".join(t), "logprobs": self.lp[i] if self.num_logprobs is not None else None,
                    "finish_reason": self.finish[i]} for i, t in enumerate(self.texts)]
        return self._tier({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                           "choices": choices, "usage": usage})
