"""The OpenAI-compatible HTTP app: the generating routes, auth, the lifespan (what each exchange
shares, admission and streaming included, is ``exchange.py``).

Request path: body limits (``limits.py``: size, time, content type, host) -> parse + validate the body
(400 before the engine is touched; caps on n, prompts, stop) -> render / tokenise on the CPU pool ->
context-length check -> admission in sequences (429 + Retry-After when ``n`` x prompts more do not fit in
``max_num_seqs + max_queue_len``, 503 while shutting down) -> ``EngineLoop.submit`` -> wait for the first
event, so an engine-side refusal still gets a proper status -> JSON body or an SSE stream. Whatever ends the
exchange (done, error, client gone, server stopping) runs one cleanup that aborts the job in the engine
if it is still running, which frees its cache.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import sys
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kimik3.engine import LLMEngine
from kimik3.chat.k3 import IMAGE_PLACEHOLDER
from kimik3.serve.chat import chat_prompt
from kimik3.serve.engine_loop import PromptInput
from kimik3.serve.exchange import (
    ServeOptions,
    ServerState,
    check_model,
    max_tokens_for,
    parse_body,
    run_job,
    sampling_params,
)
from kimik3.serve.media import completion_images
from kimik3.serve.limits import BodyLimits, RepeatedErrors, check_request_limits
from kimik3.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    context_exceeded,
    error_body,
)
from kimik3.serve.responses import ChatFormatter, CompletionFormatter
from kimik3.serve.routes import add_routes
from kimik3.serve.stats_log import log_stats
from kimik3.serve.unserved import unserved_message
from kimik3.serve.structured import request_constraint
from kimik3.tokenizer import TooManyTokens

logger = logging.getLogger(__name__)

_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health", "/metrics",
           "/tokenize", "/detokenize", "/version", "/ping", "/rebalance_experts")


# ---- the app --------------------------------------------------------------------------------------------------

_OPEN_ROUTES = ("/health", "/ping", "/version", "/metrics")     # answered without the API key
SWITCH_INTERVAL = 0.0005        # seconds, sys.setswitchinterval while serving (Python's default: 0.005)


def _bearer_token(headers) -> bytes:
    """The credentials of an ``Authorization: Bearer <token>`` header (the scheme in any case, RFC 7235)."""
    value = dict(headers or []).get(b"authorization", b"").strip()
    scheme, _, token = value.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


class _Guard:
    """Pure ASGI: the API-key check on every route but /health, /ping, /version and /metrics (vLLM leaves
    /tokenize and /detokenize open too; they do real work, so here they need the key; CORS preflights are
    answered outside this), and request counts by route and status."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state
        key = state.options.api_key
        self.expected = key.encode() if key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        route = path if path in _ROUTES else "other"
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if self.expected is not None and path not in _OPEN_ROUTES and scope.get("method") != "OPTIONS":
                if not hmac.compare_digest(_bearer_token(scope.get("headers")), self.expected):
                    body = error_body(401, "invalid or missing API key; send 'Authorization: Bearer <key>'",
                                      code="invalid_api_key")
                    await JSONResponse(body, status_code=401)(scope, receive, send_wrapper)
                    return
            await self.app(scope, receive, send_wrapper)
        finally:
            self.state.metrics.request(route, str(status["code"]))


def _continuous_usage(req) -> bool:
    so = req.stream_options
    if so is not None and so.continuous_usage_stats and not req.stream:
        raise bad_request("stream_options.continuous_usage_stats needs stream=true", "stream_options")
    return bool(so and so.continuous_usage_stats)


def create_app(engine: LLMEngine, options: ServeOptions) -> FastAPI:
    """The FastAPI app serving ``engine``. The engine loop starts with the app's lifespan."""
    state = ServerState(engine, options)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # What exists once the engine is built and warm (modules, tokenizer tables, compiled kernels: ~250k
        # objects the collector tracks) lives as long as the server: frozen, the full collections that serving's
        # garbage triggers skip it (one took 90 ms on a dev CPU, holding the GIL from the engine thread).
        gc.collect()
        gc.freeze()
        # A thread waiting for the GIL gets it after this long, not 5 ms: the engine thread takes the GIL back after
        # every torch op, and while a request's Python work (formatting 170k prompt logprobs) ran beside a step,
        # each op waited the whole interval: an innocent stream's gap grew from ~0.2 s to ~1.1 s (0.34 s at 0.5 ms)
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL)
        asyncio.get_running_loop().set_exception_handler(RepeatedErrors())    # e.g. EMFILE: one line + a count
        state.loop.start(asyncio.get_running_loop())
        stats = None
        if options.log_stats_interval is not None:
            stats = asyncio.create_task(log_stats(state.loop, options.log_stats_interval))
        try:
            yield
        finally:
            if stats is not None:
                stats.cancel()
            await state.drain()
            await asyncio.get_running_loop().run_in_executor(None, state.loop.stop)
            state.pool.shutdown(wait=False, cancel_futures=True)
            state.grammar_pool.shutdown(wait=False, cancel_futures=True)
            state.body_workers.close()
            gc.unfreeze()           # a process that builds apps one after another (tests) collects them again
            sys.setswitchinterval(switch_interval)

    app = FastAPI(title="kimik3", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kimik3 = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        message = unserved_message(e.status_code, request.method, request.url.path)
        return JSONResponse(error_body(e.status_code, message or str(e.detail), code="not_served" if message else None),
                            status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(500, "internal server error (the server log has the details)",
                                       code="internal_error"), status_code=500)

    @app.get("/health")
    async def health():
        if not state.loop.alive:
            return JSONResponse(error_body(503, "engine loop is not running"), status_code=503)
        if state.draining:
            return JSONResponse(error_body(503, "the server is shutting down", code="shutting_down"), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(state, model_id)
        return _model_card(state)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req: ChatCompletionRequest = await parse_body(state, request, ChatCompletionRequest)
        name = check_model(state, req.model)
        check_request_limits(options.limits, req.n, 1, req.stop, req.stop_token_ids)
        state.check_admission(req.n)
        tok = state.tokenizer
        if tok is None:
            raise APIError(500, "this server has no tokenizer, so it cannot render chats", code="no_tokenizer")
        prompt = await chat_prompt(state, req)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = max_tokens_for(state, requested, param, len(prompt.token_ids), "messages")
        if req.top_logprobs is not None and not (0 <= req.top_logprobs <= state.max_logprobs):
            raise bad_request(f"top_logprobs must lie in [0, {state.max_logprobs}] (--max-logprobs), got "
                              f"{req.top_logprobs}", "top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(req, max_tokens, logprobs, tok.stop_token_ids, options.generation_defaults,
                                  prompt.constraint, state.max_logprobs, prompt.bad_token_sequences)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        fmt = ChatFormatter(f"chatcmpl-{uuid.uuid4().hex}", name, prompt, req.n, logprobs, tok,
                            include_usage and req.stream)
        fmt.service_tier = req.service_tier
        return await run_job(state, request, [PromptInput(prompt.token_ids, prompt.images)], params, fmt, req.stream,
                          include_usage, _continuous_usage(req))

    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = await parse_body(state, request, CompletionRequest)
        name = check_model(state, req.model)
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request(f"best_of={req.best_of} is not supported: kimik3 does not rank candidates, so best_of "
                              f"must equal n ({req.n}) or be left out", "best_of", "unsupported_field")
        if req.logprobs is not None and not (0 <= req.logprobs <= state.max_logprobs):
            raise bad_request(f"logprobs must lie in [0, {state.max_logprobs}] (--max-logprobs), got {req.logprobs}",
                              "logprobs")
        num_prompts = len(_prompt_items(req.prompt))
        check_request_limits(options.limits, req.n, num_prompts, req.stop, req.stop_token_ids)
        state.check_admission(num_prompts * req.n)
        if req.media_urls is not None:
            ids, text, vision = await state.cpu(_image_completion_prompt, state, req)
            prompts_ids, echo, visions = [ids], [text], [vision]
        else:
            prompts_ids, echo = await state.cpu(_completion_prompts, state, req)
            visions = [None] * len(prompts_ids)
        requested = req.max_tokens
        max_tokens = min(max_tokens_for(state, requested, "max_tokens", len(ids), "prompt") for ids in prompts_ids)
        echo_logprobs = req.echo and req.logprobs is not None     # the prompt's tokens get logprobs too
        if echo_logprobs and req.stream:
            raise bad_request("echo with logprobs needs stream=false: the prompt's logprobs come with the full "
                              "response", "echo")
        asked = req.prompt_logprobs
        if echo_logprobs and asked is None:
            req = req.model_copy(update={"prompt_logprobs": req.logprobs})
        params = sampling_params(req, max_tokens, req.logprobs, [], options.generation_defaults,
                                  request_constraint(req), state.max_logprobs)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        n_choices = len(prompts_ids) * req.n
        fmt = CompletionFormatter(f"cmpl-{uuid.uuid4().hex}", name, n_choices, req.logprobs, state.tokenizer,
                                  include_usage and req.stream,
                                  [e for e in echo for _ in range(req.n)] if req.echo else None,
                                  echo_ids=prompts_ids if echo_logprobs else None, prompt_logprobs_field=asked is not None)
        fmt.service_tier = req.service_tier
        return await run_job(state, request, [PromptInput(ids, v) for ids, v in zip(prompts_ids, visions)], params,
                             fmt, req.stream, include_usage, _continuous_usage(req))

    add_routes(app, state)       # /tokenize, /detokenize, /version, /ping, /v1/responses
    # last added runs first: CORS (preflights answered), then the API key, then the body limits
    app.add_middleware(BodyLimits, limits=options.limits, require_json=options.api_key is None)
    app.add_middleware(_Guard, state=state)
    if options.allowed_origins:     # off by default: a web page may not read a local server's answers
        app.add_middleware(CORSMiddleware, allow_origins=options.allowed_origins,
                           allow_methods=options.allowed_methods, allow_headers=options.allowed_headers,
                           allow_credentials=options.allow_credentials)
    return app


def _model_card(state: ServerState) -> dict:
    return {"id": state.options.served_model_name, "object": "model", "created": state.created,
            "owned_by": "kimik3", "root": state.options.served_model_name, "max_model_len": state.max_model_len}


def _prompt_items(p) -> list:
    """A string or token list is one prompt, a list of them a batch."""
    return [p] if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)) else list(p)


def _image_completion_prompt(state: ServerState, req: CompletionRequest):
    tok = state.tokenizer
    if tok is None:
        raise bad_request("this server has no tokenizer; images need a prompt it can read", "prompt")
    o = state.options
    pad = getattr(getattr(state.engine.model, "config", None), "media_placeholder_token_id", None)
    return completion_images(req.prompt, req.media_urls, tok, pad, o.processor_config, o.media, state.has_vision,
                             o.limit_mm_per_prompt, state.max_model_len - 1)


def _completion_prompts(state: ServerState, req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
    """(token ids, text for echo) per prompt."""
    items = _prompt_items(req.prompt)
    if not items:
        raise bad_request("prompt is empty; give a string, a list of token ids, or a list of either", "prompt")
    tok = state.tokenizer
    vocab = state.engine.vocab_size
    out, texts = [], []
    for k, item in enumerate(items):
        where = "prompt" if len(items) == 1 else f"prompt[{k}]"
        if isinstance(item, str):
            if tok is None:
                raise bad_request("this server has no tokenizer; send token ids", where)
            if IMAGE_PLACEHOLDER in item:
                raise bad_request(f"{where} holds {IMAGE_PLACEHOLDER} but the request has no images: send them as "
                                  f"media_urls={{\"image\": [\"data:image/png;base64,...\"]}} (one per placeholder), "
                                  f"or use /v1/chat/completions with image parts", where, "missing_images")
            try:
                ids = tok.encode(item, limit=state.max_model_len)
            except TooManyTokens:
                raise context_exceeded(state.max_model_len, where) from None
            text = item
        else:
            ids = list(item)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise bad_request(f"{where}: token ids {bad[:5]} lie outside the vocabulary [0, {vocab})", where)
            text = tok.decode(ids) if tok is not None else ""
        if not ids:
            raise bad_request(f"{where} is empty (0 tokens)", where)
        out.append(ids)
        texts.append(text)
    return out, texts
