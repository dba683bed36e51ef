"""OpenAI request bodies (pydantic, strict types) and the OpenAI error body.

Bodies are parsed with ``model_validate_json`` in strict mode, so ``"max_tokens": "5"`` is a type error
(400), not a silent coercion. A field kimik3 does not implement is never accepted and ignored: it is a
400 naming it (``unsupported_field``; vLLM-only fields it will not serve get the reason, see
``UNSUPPORTED``). vLLM's extra sampling fields (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``min_tokens``, ``bad_words``,
``allowed_token_ids``, ``include_stop_str_in_output``, ``prompt_logprobs``, ``guided_*``,
``structured_outputs``, ``chat_template_kwargs``, ``media_io_kwargs``) are accepted, so ``extra_body`` works from the
``openai`` client. Accepted no-ops, with their reason: ``user`` (OpenAI's end-user id for abuse
monitoring; kimik3 keeps no per-user state) and ``safety_identifier`` (its newer name),
``add_generation_prompt: true`` and
``continue_final_message: false`` (what kimik3 always does; the other values are a 400), ``best_of``
equal to ``n`` (the n samples are the best_of), ``response_format.json_schema.strict`` (the schema is
always enforced), ``n: null`` (1), ``store: false`` (nothing is stored; true is a 400), ``metadata`` (it
tags stored completions; none are), ``prompt_cache_key`` (the prefix cache is keyed by the prompt's
content and shared by every request), ``modalities: ["text"]`` and ``prompt_cache_retention: "in_memory"``
(what kimik3 does; other values are a 400), ``service_tier`` ``auto``/``default`` (echoed; one local tier,
others a 400). ``stream_options.continuous_usage_stats`` puts the usage so far on every chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                500: "server_error", 503: "server_unavailable"}


class APIError(Exception):
    """An error answered with the OpenAI body ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


# Fields other servers take that kimik3 will not serve, with the reason (any other unknown field is a 400 too).
_BEAM = "beam search is not implemented"
UNSUPPORTED = {
    "use_beam_search": _BEAM, "length_penalty": f"it only applies to beam search; {_BEAM}",
    "early_stopping": f"it only applies to beam search; {_BEAM}",
    "priority": "the scheduler is first come, first served: requests have no priority",
    "vllm_xargs": "kimik3 takes no extension arguments",
    "chat_template": "the chat format is the checkpoint's own (K3 or Kimi-Linear); custom templates are not supported",
    "thinking_token_budget": "the reasoning length cannot be capped; use max_tokens or reasoning_effort",
    "guided_decoding_backend": "the structured-outputs backend is always llguidance",
    "guided_whitespace_pattern": "JSON is always written with compact separators",
    "logits_processors": "custom logits processors are not supported",
    "truncate_prompt_tokens": "prompts are never truncated; shorten the prompt",
    "spaces_between_special_tokens": "detokenization is the tokenizer's own",
    "return_tokens_as_token_ids": "token ids come back in the logprobs' bytes only",
    "documents": "retrieval documents are not part of the K3 chat format",
    "mm_processor_kwargs": "preprocessing follows the checkpoint's preprocessor_config.json; video sampling is "
                           "media_io_kwargs.video (fps, num_frames)",
    "cache_salt": "the prefix cache is shared by all requests",
    "kv_transfer_params": "disaggregated prefill is not supported",
    "functions": "legacy function calling is not supported; use tools", "function_call": "use tool_choice",
    "echo": "chat requests cannot echo the prompt",
    "audio": "K3 has no audio input or output", "modalities": "K3 answers in text only",
    "prediction": "predicted outputs are not supported (see --num-speculative-tokens)",
    "web_search_options": "the server has no network access",
    "suffix": "K3 has no fill-in-the-middle format",
    "moderation": "no moderation model is served",
    "prompt_cache_options": "the prefix cache keeps blocks while memory allows and is shared by all requests; it "
                            "has no per-request options",
    "prompt_cache_retention": "the prefix cache keeps blocks in memory while room allows; it has no longer retention",
    "verbosity": "K3 has no verbosity control; use max_tokens, reasoning_effort or the prompt",
}


def unsupported_store() -> APIError:
    return bad_request("store=true: this server stores no completions; send store=false (or leave it out)", "store",
                       "unsupported_field")


def service_tier_error(tier: str) -> APIError:
    return bad_request(f"service_tier {tier!r}: this server has one tier; send 'auto' or 'default' (or leave it out)",
                       "service_tier")


def unsupported_field(name: str) -> APIError:
    reason = UNSUPPORTED.get(name)
    return bad_request(f"{name}: kimik3 does not support this field" + (f" ({reason})" if reason else "")
                       + "; remove it", name, "unsupported_field")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False    # vLLM's: every chunk carries the usage so far


class _SamplingFields(_Body):
    model: str | None = None
    n: int | None = 1                   # null = 1 (vLLM and OpenAI's default)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None             # accepted no-op (see the module docstring)
    safety_identifier: str | None = None    # accepted no-op, as user (OpenAI's newer name for it)
    store: bool | None = None           # only false: nothing is stored
    metadata: dict[str, str] | None = None      # accepted no-op: it tags stored completions, and none are stored
    service_tier: str | None = None     # auto / default, echoed: one local tier
    prompt_cache_key: str | None = None  # accepted no-op: the prefix cache is keyed by content, shared by all

    def model_post_init(self, _context) -> None:
        if self.n is None:
            self.n = 1
        if self.store:
            raise unsupported_store()
        if self.service_tier is not None and self.service_tier not in ("auto", "default"):
            raise service_tier_error(self.service_tier)
    # logit controls (vLLM's names)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    # constraints (one at most): OpenAI's response_format, vLLM's structured_outputs and guided_*
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    thinking: dict[str, Any] | None = None       # Moonshot's {"type", "keep", "effort"} (kimik3.chat.options)
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None   # vLLM's: {"video": {"fps", "num_frames"}} (serve/media.py)
    add_generation_prompt: bool = True      # only true: the answer always starts a new assistant message
    continue_final_message: bool = False    # only false
    modalities: list[str] | None = None     # only ["text"] (what K3 answers in)
    prompt_cache_retention: str | None = None   # only "in_memory" (what the prefix cache is)

    def model_post_init(self, context) -> None:
        super().model_post_init(context)
        if self.modalities is not None and self.modalities != ["text"]:
            raise bad_request(f"modalities {self.modalities}: K3 answers in text only; send [\"text\"] or leave it out",
                              "modalities", "unsupported_field")
        if self.prompt_cache_retention not in (None, "in_memory"):
            raise bad_request(f"prompt_cache_retention {self.prompt_cache_retention!r}: "
                              f"{UNSUPPORTED['prompt_cache_retention']}; send 'in_memory' or leave it out",
                              "prompt_cache_retention", "unsupported_field")


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None              # only equal to n
    media_urls: dict[str, Any] | None = None   # {"image": [url, ...]} for <|kimi_image_placeholder|> (serve/media.py)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_path(loc) -> list[str]:
    """Field names and indices of a pydantic error location, without union member tags (``str``, ``list[int]``)."""
    out = []
    for p in loc:
        if isinstance(p, int):
            if out:
                out[-1] += f"[{p}]"
            continue
        if p in _TYPE_TAGS or "[" in p or "-" in p:
            continue
        out.append(p)
    return out


def validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the field (``param``) and what was wrong; a field the
    body may not hold comes first."""
    errors = e.errors(include_url=False)
    extra = [x for x in errors if x.get("type") == "extra_forbidden"]
    if extra:
        path = ".".join(_field_path(extra[0].get("loc", ())))
        return unsupported_field(path) if "." not in path else bad_request(
            f"{path}: kimik3 does not support this field; remove it", path, "unsupported_field")
    err = errors[0]
    loc = ".".join(_field_path(err.get("loc", ())))
    if err.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}",
                           code="invalid_json")
    if err.get("type") == "model_type" or not loc:
        return bad_request(f"request body must be a JSON object: {err['msg']}", code="invalid_json")
    return bad_request(f"{loc}: {err['msg']}" + (f" (got {err['input']!r})" if "input" in err and
                                                  not isinstance(err["input"], (dict, list)) else ""),
                       param=loc, code="invalid_type" if err.get("type", "").endswith("_type") else None)


# ---- /tokenize and /detokenize (here, with no import beyond pydantic, so a body worker can parse them) ---------

class TokenizeRequest(_Body):
    """vLLM's body: ``prompt`` (a string) or ``messages`` (a chat, rendered as /v1/chat/completions would)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None      # video sampling, as the chat request would give it


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def model_not_found(name: str, served: str) -> APIError:
    return APIError(404, f"the model {name!r} does not exist; this server serves {served!r}", "model",
                    "model_not_found")


def context_exceeded(max_model_len: int, param: str) -> APIError:
    """The 400 for a text that has more tokens than the context (found before it was all tokenised)."""
    return bad_request(f"{param} has more than max_model_len={max_model_len} tokens, the most this server's context "
                       f"holds (prompt and completion together); shorten it", param, "context_length_exceeded")


@dataclass(frozen=True)
class TokenizeChecks:
    """/tokenize's refusals that need nothing but the body, in the route's order: the model's name, a tokenizer,
    exactly one of prompt and messages, a prompt too long to fit the context whatever its tokens
    (``max_prompt_chars``: max_model_len x the longest token's characters). Run where the body is validated:
    for a large body that is a worker process (``body_worker``), so a 57 MiB prompt is refused without ever being
    built in the server."""

    served: str
    has_tokenizer: bool
    max_model_len: int
    max_prompt_chars: int

    def __call__(self, req: TokenizeRequest) -> None:
        if req.model is not None and req.model != self.served:
            raise model_not_found(req.model, self.served)
        if not self.has_tokenizer:
            raise APIError(500, "this server has no tokenizer", code="no_tokenizer")
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt (a string) or messages (a chat)", "prompt")
        if req.prompt is not None and len(req.prompt) > self.max_prompt_chars:
            raise context_exceeded(self.max_model_len, "prompt")
