"""OpenAI request bodies (pydantic, strict types) and the OpenAI error body.

Bodies are parsed with ``model_validate_json`` in strict mode, so ``"max_tokens": "5"`` is a type error
(400), not a silent coercion. Unknown fields are ignored, as vLLM does. vLLM's extra sampling fields
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``,
``chat_template_kwargs``) are accepted too, so ``extra_body`` works from the ``openai`` client.
"""

from __future__ import annotations

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
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    model: str | None = None
    n: int = 1
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
    user: str | None = None


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
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


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
    """The first pydantic error as a 400 naming the field (``param``) and what was wrong."""
    err = e.errors(include_url=False)[0]
    loc = ".".join(_field_path(err.get("loc", ())))
    if err.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}",
                           code="invalid_json")
    if err.get("type") == "model_type" or not loc:
        return bad_request(f"request body must be a JSON object: {err['msg']}", code="invalid_json")
    return bad_request(f"{loc}: {err['msg']}" + (f" (got {err['input']!r})" if "input" in err and
                                                  not isinstance(err["input"], (dict, list)) else ""),
                       param=loc, code="invalid_type" if err.get("type", "").endswith("_type") else None)
