"""The OpenAI-compatible HTTP app: routes, auth, admission (backpressure), streaming, shutdown.

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
import functools
import hmac
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kimik3.engine import LLMEngine, SamplingParams
from kimik3.serve.chat import build_chat_prompt, collect_images
from kimik3.serve.engine_loop import (
    ChoiceDelta,
    Done,
    EngineLoop,
    Failed,
    Job,
    PromptInput,
)
from kimik3.serve.limits import BodyLimits, Limits, check_request_limits
from kimik3.serve.metrics import ServerMetrics
from kimik3.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    error_body,
    validation_error,
)
from kimik3.serve.responses import ChatFormatter, CompletionFormatter, usage_body
from kimik3.serve.structured import request_constraint

logger = logging.getLogger(__name__)

_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health", "/metrics",
           "/tokenize", "/detokenize", "/version", "/ping")


@dataclass
class ServeOptions:
    served_model_name: str
    api_key: str | None = None
    max_queue_len: int = 256            # sequences accepted beyond max_num_seqs before answering 429
    shutdown_timeout: float = 30.0      # seconds in-flight requests get to finish at shutdown
    processor_config: object | None = None   # MediaProcessorConfig for images (None: defaults)
    limits: Limits = field(default_factory=Limits)
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])   # CORS (vLLM's defaults)
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    log_requests: bool = False          # one INFO line per request
    generation_defaults: dict = field(default_factory=dict)   # SamplingParams defaults (generation_config.json)
    limit_mm_per_prompt: dict | None = None   # {"image": N}: most images per request

    def __post_init__(self) -> None:
        if not isinstance(self.max_queue_len, int) or self.max_queue_len < 0:
            raise ValueError(f"max_queue_len must be an integer >= 0, got {self.max_queue_len!r}")
        if not self.served_model_name:
            raise ValueError("served_model_name must be a non-empty string")


class ServerState:
    def __init__(self, engine: LLMEngine, options: ServeOptions):
        self.engine = engine
        self.options = options
        self.loop = EngineLoop(engine)
        self.tokenizer = engine.get_tokenizer()
        self.metrics = ServerMetrics(self.loop, options.served_model_name)
        self.max_model_len = engine.config.max_model_len
        self.max_logprobs = engine.config.max_logprobs
        self.capacity = engine.config.max_num_seqs + options.max_queue_len
        self.has_vision = getattr(engine.model.config, "vision", None) is not None
        self.in_flight = 0                  # sequences (n x prompts of each admitted request)
        self.draining = False
        self.drained: asyncio.Event | None = None
        self.created = int(time.time())
        self.pool = ThreadPoolExecutor(options.limits.cpu_workers, thread_name_prefix="kimik3-cpu")

    async def cpu(self, fn, *args, **kwargs):
        """Run CPU-heavy request work (parsing, tokenising, rendering, image decoding) on the bounded pool,
        never on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    def admit(self, num_seqs: int) -> None:
        self.check_admission(num_seqs)
        self.in_flight += num_seqs

    def check_admission(self, num_seqs: int) -> None:
        """503 while shutting down, 429 when ``num_seqs`` more sequences do not fit (before any work)."""
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another instance", code="shutting_down",
                           headers={"Retry-After": "5"})
        if not self.loop.alive:
            raise APIError(503, "the engine loop is not running", code="engine_down")
        if self.in_flight + num_seqs > self.capacity:
            raise APIError(429, f"the server is at capacity: this request needs {num_seqs} sequence(s) (n x prompts) "
                                f"and {self.in_flight} of max_num_seqs + max_queue_len = {self.capacity} are taken; "
                                f"retry shortly", code="queue_full", headers={"Retry-After": "1"})

    async def drain(self) -> None:
        """Shutdown, from the signal on: new requests get 503, queued ones 503 at once, running ones get
        ``shutdown_timeout`` seconds to finish and then end with a 503 error (an SSE error event and
        ``[DONE]`` on streams). Idempotent; returns once every admitted request has been answered."""
        if self.drained is not None:
            await self.drained.wait()
            return
        self.drained = asyncio.Event()
        self.draining = True
        self.loop.refuse_queued()
        deadline = time.monotonic() + self.options.shutdown_timeout
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight:
            logger.warning("shutdown deadline: aborting %d sequence(s) still in flight", self.in_flight)
            await asyncio.get_running_loop().run_in_executor(None, self.loop.stop)
            end = time.monotonic() + 5.0         # their error events and bodies go out
            while self.in_flight and time.monotonic() < end:
                await asyncio.sleep(0.02)
        self.drained.set()


# ---- helpers -----------------------------------------------------------------------------------------------

async def _parse(state: ServerState, request: Request, model):
    raw = await request.body()
    if not raw:
        raise bad_request("request body is empty; send a JSON object", code="invalid_json")
    try:
        return await state.cpu(model.model_validate_json, raw) if len(raw) > 65536 else model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e) from None


def _check_model(state: ServerState, name: str | None) -> str:
    served = state.options.served_model_name
    if name is not None and name != served:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {served!r}", "model",
                       "model_not_found")
    return served


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        if not key.isdigit():
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        out[int(key)] = value
    return out


def _sampling_params(req, max_tokens: int, logprobs: int | None, stop_token_ids: list[int],
                     defaults: dict | None = None, constraint=None, max_logprobs: int = 20) -> SamplingParams:
    if req.prompt_logprobs is not None and not (0 <= req.prompt_logprobs <= max_logprobs):
        raise bad_request(f"prompt_logprobs must lie in [0, {max_logprobs}] (--max-logprobs), got "
                          f"{req.prompt_logprobs}", "prompt_logprobs")
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs needs stream=false (they come with the full response)", "prompt_logprobs")
    # vLLM's rule: ignore_eos also drops the chat format's stop ids; the client's own stop ids stay.
    stops = (req.stop_token_ids or []) + ([] if req.ignore_eos else stop_token_ids)
    kw = {"n": req.n, "max_tokens": max_tokens, "seed": req.seed, "stop": req.stop, "ignore_eos": req.ignore_eos,
          "stop_token_ids": stops, "logprobs": logprobs, "skip_special_tokens": req.skip_special_tokens,
          "logit_bias": _logit_bias(req.logit_bias), "allowed_token_ids": req.allowed_token_ids,
          "bad_words": req.bad_words, "min_tokens": req.min_tokens,
          "include_stop_str_in_output": req.include_stop_str_in_output, "prompt_logprobs": req.prompt_logprobs,
          "structured_outputs": constraint}
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = getattr(req, name)
        if value is None:
            value = (defaults or {}).get(name)      # the model's generation_config.json
        if value is not None:
            kw[name] = value
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        msg = str(e)
        param = msg.split(": ", 1)[1].split()[0] if msg.startswith("SamplingParams: ") else None
        raise bad_request(msg.removeprefix("SamplingParams: "), param) from None


def _max_tokens(state: ServerState, requested: int | None, param: str, prompt_len: int, prompt_param: str) -> int:
    limit = state.max_model_len
    if prompt_len >= limit:
        raise bad_request(f"the prompt has {prompt_len} tokens, but this model's context is max_model_len={limit} "
                          f"tokens (prompt and completion together); shorten the prompt", prompt_param,
                          "context_length_exceeded")
    if requested is None:
        default = state.options.generation_defaults.get("max_tokens")
        return min(default, limit - prompt_len) if default else limit - prompt_len
    if requested < 1:
        raise bad_request(f"{param} must be at least 1, got {requested}", param)
    if prompt_len + requested > limit:
        raise bad_request(f"this model's context is max_model_len={limit} tokens, but {prompt_len} prompt tokens "
                          f"+ {param}={requested} = {prompt_len + requested}; lower {param} or shorten the prompt",
                          param, "context_length_exceeded")
    return requested


def _sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


class _JobStream(StreamingResponse):
    """An SSE response that runs the job's cleanup however the stream ends (done, cancelled, errored)."""

    def __init__(self, body, on_close):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _Exchange:
    """One admitted job from submit to cleanup: event waiting, metrics, abort on early exit."""

    def __init__(self, state: ServerState, request: Request, job: Job, prompt_tokens: int, fmt):
        self.state, self.request, self.job, self.fmt = state, request, job, fmt
        self.prompt_tokens = prompt_tokens
        self.start = time.monotonic()
        self.first_token: float | None = None
        self.last_token: dict[int, float] = {}
        self.completion_tokens = 0
        self.closed = False
        self.watch_disconnect = True
        self._checked = self.start
        self._getter: asyncio.Future | None = None

    async def next_event(self, poll: float = 0.25):
        """The job's next event, or None once the client has disconnected. While the response is a
        stream, Starlette watches for the disconnect itself (and cancels the stream)."""
        while True:
            if self.watch_disconnect and time.monotonic() - self._checked >= poll:
                self._checked = time.monotonic()
                if await self.request.is_disconnected():
                    return None
            if self._getter is None:
                self._getter = asyncio.ensure_future(self.job.queue.get())
            done, _ = await asyncio.wait({self._getter}, timeout=poll)
            if done:
                item, self._getter = self._getter.result(), None
                if isinstance(item, list):
                    self._observe(item)
                return item

    def _observe(self, deltas: list[ChoiceDelta]) -> None:
        now = time.monotonic()
        m = self.state.metrics
        for d in deltas:
            if d.token_ids:
                self.completion_tokens += len(d.token_ids)
                if self.first_token is None:
                    self.first_token = now
                    m.ttft.observe(now - self.start)
                prev = self.last_token.get(d.index)
                if prev is not None:
                    m.itl.observe(now - prev)
                self.last_token[d.index] = now
            if d.finish_reason is not None:
                m.finished(d.finish_reason)

    def usage(self, cached: int) -> dict:
        return usage_body(self.prompt_tokens, self.completion_tokens, cached)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._getter is not None:
            self._getter.cancel()
        if not self.job.done:
            self.state.loop.abort(self.job)
            self.state.metrics.finished("abort")
        self.state.in_flight -= len(self.job.choices)
        self.state.metrics.generation_tokens.inc(self.completion_tokens)


async def _run(state: ServerState, request: Request, prompts: list[PromptInput], params: SamplingParams, fmt,
               stream: bool, include_usage: bool) -> Response:
    state.admit(len(prompts) * params.n)
    job = Job(fmt.id, prompts, params)
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    if state.options.log_requests:
        logger.info("request %s: %d prompt(s), %d prompt tokens, stream=%s, %s", fmt.id, len(prompts),
                    prompt_tokens, stream, params)
    ex = _Exchange(state, request, job, prompt_tokens, fmt)
    state.metrics.prompt_tokens.inc(prompt_tokens)
    handed_off = False
    try:
        state.loop.submit(job)
        first = await ex.next_event()
        if first is None:
            return Response(status_code=499)
        if isinstance(first, Failed):
            raise first.error
        if stream:
            handed_off = True
            ex.watch_disconnect = False
            return _JobStream(_stream(ex, first, include_usage), ex.close)
        item = first
        while not isinstance(item, Done):
            if item is None:
                return Response(status_code=499)
            if isinstance(item, Failed):
                raise item.error
            fmt.feed(item, streaming=False)
            item = await ex.next_event()
        body = fmt.final(ex.usage(item.cached_tokens))
        if params.prompt_logprobs is not None:
            fmt.add_prompt_logprobs(body, job.prompt_logprobs, params.n)
        return JSONResponse(body)
    finally:
        if not handed_off:
            ex.close()


async def _stream(ex: _Exchange, first, include_usage: bool):
    encode = getattr(ex.fmt, "sse", _sse)        # a formatter may frame its own events (/v1/responses)
    item = first
    while True:
        if isinstance(item, list):
            for chunk in ex.fmt.feed(item, streaming=True):
                yield encode(chunk)
        elif isinstance(item, Done):
            if include_usage:
                yield encode(ex.fmt.usage_chunk(ex.usage(item.cached_tokens)))
            break
        elif isinstance(item, Failed):
            e = item.error
            yield encode(error_body(e.status, e.message, e.param, e.code))
            break
        elif item is None:      # client gone: the cleanup aborts the job
            return
        item = await ex.next_event()
    if getattr(ex.fmt, "done_marker", True):
        yield b"data: [DONE]\n\n"


# ---- the app --------------------------------------------------------------------------------------------------

class _Guard:
    """Pure ASGI: API-key check on the /v1 routes (as vLLM: /health, /metrics, /ping, /version, /tokenize and
    /detokenize stay open; CORS preflights are answered outside this), and request counts by route and status."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state
        key = state.options.api_key
        self.expected = f"Bearer {key}".encode() if key else None

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
            if self.expected is not None and path.startswith("/v1") and scope.get("method") != "OPTIONS":
                got = dict(scope.get("headers") or []).get(b"authorization", b"")
                if not hmac.compare_digest(got, self.expected):
                    body = error_body(401, "invalid or missing API key; send 'Authorization: Bearer <key>'",
                                      code="invalid_api_key")
                    await JSONResponse(body, status_code=401)(scope, receive, send_wrapper)
                    return
            await self.app(scope, receive, send_wrapper)
        finally:
            self.state.metrics.request(route, str(status["code"]))


def create_app(engine: LLMEngine, options: ServeOptions) -> FastAPI:
    """The FastAPI app serving ``engine``. The engine loop starts with the app's lifespan."""
    state = ServerState(engine, options)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await state.drain()
            await asyncio.get_running_loop().run_in_executor(None, state.loop.stop)
            state.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kimik3", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kimik3 = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code)

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
        _check_model(state, model_id)
        return _model_card(state)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req: ChatCompletionRequest = await _parse(state, request, ChatCompletionRequest)
        name = _check_model(state, req.model)
        check_request_limits(options.limits, req.n, 1, req.stop, req.stop_token_ids)
        state.check_admission(req.n)
        tok = state.tokenizer
        if tok is None:
            raise APIError(500, "this server has no tokenizer, so it cannot render chats", code="no_tokenizer")
        limit = (options.limit_mm_per_prompt or {}).get("image")
        if limit is not None and len(collect_images(req.messages)) > limit:
            raise bad_request(f"the messages hold {len(collect_images(req.messages))} images, more than this server's "
                              f"--limit-mm-per-prompt image={limit}", "messages", "too_many_images")
        prompt = await state.cpu(build_chat_prompt, req, tok, options.processor_config, state.has_vision,
                                 state.loop.multi_modal_arg, max_image_tokens=state.max_model_len - 1)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = _max_tokens(state, requested, param, len(prompt.token_ids), "messages")
        if req.top_logprobs is not None and not (0 <= req.top_logprobs <= state.max_logprobs):
            raise bad_request(f"top_logprobs must lie in [0, {state.max_logprobs}] (--max-logprobs), got "
                              f"{req.top_logprobs}", "top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = _sampling_params(req, max_tokens, logprobs, tok.stop_token_ids, options.generation_defaults,
                                  prompt.constraint, state.max_logprobs)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        fmt = ChatFormatter(f"chatcmpl-{uuid.uuid4().hex}", name, prompt, req.n, logprobs, tok,
                            include_usage and req.stream)
        return await _run(state, request, [PromptInput(prompt.token_ids, prompt.images)], params, fmt, req.stream,
                          include_usage)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = await _parse(state, request, CompletionRequest)
        name = _check_model(state, req.model)
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request(f"best_of={req.best_of} is not supported: kimik3 does not rank candidates, so best_of "
                              f"must equal n ({req.n}) or be left out", "best_of", "unsupported_field")
        if req.logprobs is not None and not (0 <= req.logprobs <= state.max_logprobs):
            raise bad_request(f"logprobs must lie in [0, {state.max_logprobs}] (--max-logprobs), got {req.logprobs}",
                              "logprobs")
        num_prompts = len(_prompt_items(req.prompt))
        check_request_limits(options.limits, req.n, num_prompts, req.stop, req.stop_token_ids)
        state.check_admission(num_prompts * req.n)
        prompts_ids, echo = await state.cpu(_completion_prompts, state, req)
        requested = req.max_tokens
        max_tokens = min(_max_tokens(state, requested, "max_tokens", len(ids), "prompt") for ids in prompts_ids)
        params = _sampling_params(req, max_tokens, req.logprobs, [], options.generation_defaults,
                                  request_constraint(req), state.max_logprobs)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        n_choices = len(prompts_ids) * req.n
        fmt = CompletionFormatter(f"cmpl-{uuid.uuid4().hex}", name, n_choices, req.logprobs, state.tokenizer,
                                  include_usage and req.stream,
                                  [e for e in echo for _ in range(req.n)] if req.echo else None)
        return await _run(state, request, [PromptInput(ids) for ids in prompts_ids], params, fmt, req.stream,
                          include_usage)

    from kimik3.serve.routes import add_routes     # /tokenize, /detokenize, /version, /ping, /v1/responses
    add_routes(app, state)
    # last added runs first: CORS (preflights answered), then the API key, then the body limits
    app.add_middleware(BodyLimits, limits=options.limits, require_json=options.api_key is None)
    app.add_middleware(_Guard, state=state)
    app.add_middleware(CORSMiddleware, allow_origins=options.allowed_origins, allow_methods=options.allowed_methods,
                       allow_headers=options.allowed_headers, allow_credentials=options.allow_credentials)
    return app


def _model_card(state: ServerState) -> dict:
    return {"id": state.options.served_model_name, "object": "model", "created": state.created,
            "owned_by": "kimik3", "root": state.options.served_model_name, "max_model_len": state.max_model_len}


def _prompt_items(p) -> list:
    """A string or token list is one prompt, a list of them a batch."""
    return [p] if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)) else list(p)


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
            ids = tok.encode(item)
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
