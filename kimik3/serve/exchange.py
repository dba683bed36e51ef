"""What every generating route shares: the server's state (admission, drain, the CPU pool), body
parsing, the model-name check, sampling parameters and max_tokens from a request, and one admitted
job's exchange from submit to cleanup (JSON body or SSE stream). The routes are ``app.py``,
``routes.py`` and ``responses_api.py``."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from kimik3.engine import LLMEngine, SamplingParams
from kimik3.serve.engine_loop import ChoiceDelta, Done, EngineLoop, Failed, Job, PromptInput
from kimik3.serve.body_worker import WORKER_BODY_BYTES, BodyWorkers, WorkerFault
from kimik3.serve.json_body import Pacer, RenderedJSON, json_response, render
from kimik3.serve.limits import BODY_KEY, Limits, ReadBody, check_response_logprobs
from kimik3.serve.media import MediaOptions
from kimik3.serve.metrics import ServerMetrics
from kimik3.serve.protocol import APIError, bad_request, error_body, model_not_found, validation_error
from kimik3.serve.responses import usage_body

logger = logging.getLogger(__name__)

INLINE_BODY_BYTES = 65536       # bodies up to this size are validated on the event loop (well under a millisecond)


@dataclass
class ServeOptions:
    served_model_name: str
    api_key: str | None = None
    max_queue_len: int = 256            # sequences accepted beyond max_num_seqs before answering 429
    shutdown_timeout: float = 30.0      # seconds in-flight requests get to finish at shutdown
    processor_config: object | None = None   # MediaProcessorConfig for images (None: defaults)
    limits: Limits = field(default_factory=Limits)
    allowed_origins: list[str] = field(default_factory=list)   # CORS: none unless given (vLLM: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    log_requests: bool = False          # one INFO line per request
    generation_defaults: dict = field(default_factory=dict)   # SamplingParams defaults (generation_config.json)
    limit_mm_per_prompt: dict | None = None   # {"image": N, "video": M}: most images / videos per request
    media: MediaOptions = field(default_factory=MediaOptions)   # local files, video sampling and limits
    log_stats_interval: float | None = 10.0   # seconds between stats lines (None: off, --disable-log-stats)

    def __post_init__(self) -> None:
        if not isinstance(self.max_queue_len, int) or self.max_queue_len < 0:
            raise ValueError(f"max_queue_len must be an integer >= 0, got {self.max_queue_len!r}")
        if not self.served_model_name:
            raise ValueError("served_model_name must be a non-empty string")
        if self.log_stats_interval is not None and not self.log_stats_interval > 0:
            raise ValueError(f"log_stats_interval must be positive seconds or None, got {self.log_stats_interval!r}")


class ServerState:
    def __init__(self, engine: LLMEngine, options: ServeOptions):
        self.engine = engine
        self.options = options
        self.loop = EngineLoop(engine, options.limits.stream_buffer_steps)
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
        self.grammar_pool = ThreadPoolExecutor(2, thread_name_prefix="kimik3-grammar")
        self.body_workers = BodyWorkers()

    async def cpu(self, fn, *args, **kwargs):
        """Run CPU-heavy request work (parsing, tokenising, rendering, image decoding) on the bounded pool,
        never on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    async def prepare_constraint(self, params: SamplingParams, copies: int) -> None:
        """Compile the request's constraint on the grammar threads (never the event loop, the engine thread or
        the CPU pool that tokenises other requests); a constraint that does not compile is a 400. One compiled
        already only needs its copies: made on the CPU pool, so it never waits behind other requests' compiles
        (two hostile grammars held both grammar threads for their whole time budget)."""
        loop = asyncio.get_running_loop()
        try:
            if not await loop.run_in_executor(self.pool, self.engine.prepare_constraint, params, copies, True):
                await loop.run_in_executor(self.grammar_pool, self.engine.prepare_constraint, params, copies)
        except ValueError as e:
            raise bad_request(str(e), "structured_outputs", "invalid_constraint") from None

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

async def parse_body(state: ServerState, request: Request, model, checks=None):
    """The request's body validated as ``model`` and passed through ``checks`` (the route's refusals that need only
    the body, e.g. ``TokenizeChecks``). A body over ``INLINE_BODY_BYTES`` is joined from its chunks
    (``limits.ReadBody``) and validated on the CPU pool, one over ``WORKER_BODY_BYTES`` (a model of protocol.py) in
    a body worker process: never on the event loop, and the largest never under this process's GIL."""
    box = request.scope.get(BODY_KEY)
    if box is None or box.taken:        # an app without BodyLimits (tests that build one by hand)
        box = ReadBody([await request.body()])
    if not box.size:
        raise bad_request("request body is empty; send a JSON object", code="invalid_json")
    try:
        if box.size > WORKER_BODY_BYTES and BodyWorkers.handles(model):
            chunks = box.take_chunks()
            try:
                return await state.cpu(state.body_workers.validate, model, checks, chunks)
            except WorkerFault as e:
                logger.warning("the body worker failed (%s); validating a %d-byte body here", e, box.size)
                box = ReadBody(chunks, box.size)
        if box.size > INLINE_BODY_BYTES:
            req = await state.cpu(lambda: model.model_validate_json(box.take()))
        else:
            req = model.model_validate_json(box.take())
    except ValidationError as e:
        raise validation_error(e) from None
    if checks is not None:
        checks(req)
    return req


def check_model(state: ServerState, name: str | None) -> str:
    served = state.options.served_model_name
    if name is not None and name != served:
        raise model_not_found(name, served)
    return served


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):      # "²".isdigit() and int("٣") == 3: ASCII digits only
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        out[int(key)] = value
    return out


def sampling_params(req, max_tokens: int, logprobs: int | None, stop_token_ids: list[int],
                     defaults: dict | None = None, constraint=None, max_logprobs: int = 20,
                     bad_token_sequences: list[list[int]] | None = None) -> SamplingParams:
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
          "structured_outputs": constraint, "bad_token_sequences": bad_token_sequences}
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


def max_tokens_for(state: ServerState, requested: int | None, param: str, prompt_len: int, prompt_param: str) -> int:
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


def _final_bytes(fmt, usage: dict, prompt_logprobs: dict[int, list], params: SamplingParams) -> bytes:
    """The logprob response, formatted and rendered at a pace that leaves the engine thread room (``Pacer``)."""
    pace = fmt.pace = Pacer()
    body = fmt.final(usage)
    if params.prompt_logprobs is not None:
        fmt.add_prompt_logprobs(body, prompt_logprobs, params.n)
    return render(body, pace=pace)


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
        stream, Starlette watches for the disconnect itself (and cancels the stream), so the event is
        awaited directly: no future, timed wait and timer per token (about 12 us a stream a step on the CPU,
        ``benchmarks/serve_event_cost.py``)."""
        if not self.watch_disconnect and self._getter is None:
            item = await self.job.queue.get()
        else:
            item = await self._next_watched(poll)
        return self._took(item)

    def ready_event(self):
        """A stream's next event if the engine thread has posted it already, else ``_EMPTY`` (no wait)."""
        try:
            item = self.job.queue.get_nowait()
        except asyncio.QueueEmpty:
            return _EMPTY
        return self._took(item)

    def _took(self, item):
        if isinstance(item, list):
            self.state.loop.taken(self.job)
            self._observe(item)
        return item

    async def _next_watched(self, poll: float):
        """The next event, checking every ``poll`` seconds whether the client is still there (None once not: the
        engine loop posts lists, ``Done`` and ``Failed``, never None)."""
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


async def run_job(state: ServerState, request: Request, prompts: list[PromptInput], params: SamplingParams, fmt,
               stream: bool, include_usage: bool, continuous_usage: bool = False) -> Response:
    check_response_logprobs(state.options.limits, [len(p.token_ids) for p in prompts], params, stream,
                            getattr(fmt, "prompt_logprobs_per_choice", False))
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
        if params.structured_outputs is not None:       # compiled off the engine thread, in a worker first
            await state.prepare_constraint(params, len(prompts) * params.n)
        state.loop.submit(job)
        first = await ex.next_event()
        if first is None:
            return Response(status_code=499)
        if isinstance(first, Failed):
            raise first.error
        if stream:
            handed_off = True
            ex.watch_disconnect = False
            return _JobStream(_stream(ex, first, include_usage, continuous_usage), ex.close)
        item = first
        while not isinstance(item, Done):
            if item is None:
                return Response(status_code=499)
            if isinstance(item, Failed):
                raise item.error
            fmt.feed(item, streaming=False)
            item = await ex.next_event()
        usage = ex.usage(item.cached_tokens)
        if params.logprobs is None and params.prompt_logprobs is None:
            return await json_response(state, fmt.final(usage))
        # logprobs: up to --max-response-logprobs entries, formatted and rendered on the CPU pool in pieces
        return RenderedJSON(await state.cpu(_final_bytes, fmt, usage, job.prompt_logprobs, params))
    finally:
        if not handed_off:
            ex.close()


_EMPTY = object()       # ``_Exchange.ready_event``: nothing posted yet


async def _stream(ex: _Exchange, first, include_usage: bool, continuous_usage: bool = False):
    """The SSE body. ``continuous_usage`` (vLLM's ``stream_options.continuous_usage_stats``): every chunk also
    carries the usage so far (prompt tokens, tokens generated up to and including it). The events of everything
    the engine thread has posted by the time the stream wakes go out as one body write (one send for the steps
    a busy event loop fell behind on, and for a step's several choices, instead of one an event)."""
    encode = getattr(ex.fmt, "sse", _sse)        # a formatter may frame its own events (/v1/responses)
    item = first
    while True:
        out, end = [], False
        while item is not _EMPTY and not end:
            end = _encode_event(ex, item, encode, out, include_usage, continuous_usage)
            if not end:
                item = ex.ready_event()
        if out:
            yield b"".join(out)
        if end:
            break
        item = await ex.next_event()
    if item is not None and getattr(ex.fmt, "done_marker", True):
        yield b"data: [DONE]\n\n"


def _encode_event(ex: _Exchange, item, encode, out: list[bytes], include_usage: bool, continuous_usage: bool) -> bool:
    """Append the SSE events of one posted item to ``out``; True when it ends the stream (``Done``, ``Failed``, or
    None: the client is gone, and the cleanup aborts the job)."""
    if isinstance(item, list):
        for chunk in ex.fmt.feed(item, streaming=True):
            if continuous_usage:
                chunk["usage"] = {"prompt_tokens": ex.prompt_tokens, "completion_tokens": ex.completion_tokens,
                                  "total_tokens": ex.prompt_tokens + ex.completion_tokens}
            out.append(encode(chunk))
        return False
    if isinstance(item, Done):
        if include_usage:
            out.append(encode(ex.fmt.usage_chunk(ex.usage(item.cached_tokens))))
    elif isinstance(item, Failed):
        e = item.error
        out.append(encode(error_body(e.status, e.message, e.param, e.code)))
    return True
