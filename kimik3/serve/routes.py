"""vLLM's utility routes beside the OpenAI ones: ``/tokenize``, ``/detokenize``, ``/version``, ``/ping``, and
OpenAI's ``/v1/responses`` (``kimik3.serve.responses_api``); kimik3's ``/rebalance_experts`` (EPLB, live)."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from kimik3.serve.chat import chat_prompt
from kimik3.serve.exchange import check_model, parse_body
from kimik3.serve.json_body import json_response
from kimik3.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    DetokenizeRequest,
    TokenizeChecks,
    TokenizeRequest,
    bad_request,
    context_exceeded,
    validation_error,
)
from kimik3.serve.responses_api import add_responses_route
from kimik3.tokenizer import TooManyTokens


def _version() -> str:
    try:
        return importlib.metadata.version("kimik3")
    except importlib.metadata.PackageNotFoundError:   # run from a source tree that was never installed
        return "unknown (not installed)"


def _token_strs(tok, ids: list[int]) -> list[str]:
    return [tok.convert_ids_to_tokens(t) if tok.is_special_id(t) else tok.token_bytes(t).decode("utf-8", errors="replace")
            for t in ids]


def add_routes(app: FastAPI, state) -> None:

    def tokenizer():
        if state.tokenizer is None:
            raise APIError(500, "this server has no tokenizer", code="no_tokenizer")
        return state.tokenizer

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        if not state.loop.alive:
            return JSONResponse({"error": {"message": "engine loop is not running"}}, status_code=503)
        return Response(status_code=200)

    tok = state.tokenizer
    tokenize_checks = TokenizeChecks(state.options.served_model_name, tok is not None, state.max_model_len,
                                     state.max_model_len * tok.max_token_chars if tok is not None else 0)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        # the model's name, a tokenizer, one of prompt and messages, a prompt that cannot fit: with the body
        req: TokenizeRequest = await parse_body(state, request, TokenizeRequest, tokenize_checks)
        if req.prompt is not None:
            # add_special_tokens: kimik3's tokenizer adds none to a raw prompt (the engine does not either)
            try:        # a prompt longer than the context is refused (its count would serve no request)
                ids = await state.cpu(tok.encode, req.prompt, limit=state.max_model_len)
            except TooManyTokens:
                raise context_exceeded(state.max_model_len, "prompt") from None
        else:
            if not req.messages:
                raise bad_request("messages is empty; give at least one message", "messages")
            try:
                chat = ChatCompletionRequest.model_validate(
                    {"messages": req.messages, "tools": req.tools, "chat_template_kwargs": req.chat_template_kwargs,
                     "media_io_kwargs": req.media_io_kwargs})
            except ValidationError as e:
                raise validation_error(e) from None
            prompt = await chat_prompt(state, chat)
            ids = prompt.token_ids
        body: dict[str, Any] = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
        body["token_strs"] = await state.cpu(_token_strs, tok, ids) if req.return_token_strs else None
        return await json_response(state, body)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req: DetokenizeRequest = await parse_body(state, request, DetokenizeRequest)
        check_model(state, req.model)
        tok = tokenizer()
        vocab = state.engine.vocab_size
        if len(req.tokens) > state.max_model_len:
            raise bad_request(f"tokens holds {len(req.tokens)} ids, more than max_model_len={state.max_model_len}, "
                              f"the longest sequence this server makes", "tokens", "context_length_exceeded")
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids {bad[:5]} lie outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": await state.cpu(tok.decode, req.tokens, skip_special_tokens=False)}

    @app.post("/rebalance_experts")
    async def rebalance_experts():
        """EPLB, live (behind the API key): every MoE layer's experts re-placed from the loads recorded since the last
        placement, moved between the expert-parallel ranks between two steps (``LLM.rebalance_experts``)."""
        if not getattr(getattr(state.engine.model, "parallel", None), "eplb", False):
            raise APIError(400, "this server runs without expert load balancing: start it with --enable-eplb "
                                "(and --enable-expert-parallel)", code="eplb_disabled")
        report = await state.loop.call(state.engine.runner.rebalance_experts)
        return {"layers": {str(i): {"max_over_mean_measured": now, "max_over_mean_planned": planned}
                           for i, (now, planned) in report.items()}}

    add_responses_route(app, state)
