"""The one thread that drives the (not thread-safe) LLMEngine for the server.

HTTP handlers never touch the engine. They build a ``Job`` (prompts + SamplingParams) and call
``EngineLoop.submit``/``abort``, which append to an op queue and wake the thread. The thread applies
the ops, runs ``engine.step()`` while there is work, and posts each job's deltas to the job's
``asyncio.Queue`` on the server's event loop (one ``call_soon_threadsafe`` per step).

Failures: a ValueError from ``add_request`` fails that job with a 400 (the engine kept nothing of it),
anything else with a 500. A step whose forward raises names the requests of its batch (``StepError``):
when they all belong to one job, that job alone gets a 500 and the rest keep running. Otherwise every
request in the engine is aborted (freeing its cache) and put on probation: they are re-run one at a
time, each resumed from the tokens its client has already received (prompt + output so far, remaining
``max_tokens``), while new jobs wait, so the blame lands on the request whose data fails alone. An
engine request that no job owns is aborted and blames nobody. So a poisoned request costs the others a
slower stretch, never their answer. (A resumed seeded sample continues as it would have: its noise is
fixed by seed and position. A stop string straddling the resume point is not seen, and presence and
frequency penalties count the output from the resume point on.)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from kimik3.engine import LLMEngine, SamplingParams
from kimik3.serve.protocol import APIError

logger = logging.getLogger(__name__)


@dataclass
class PromptInput:
    token_ids: list[int]
    multi_modal: Any = None          # VisionInputs (the engine's multi_modal_data), or None


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class Done:
    cached_tokens: int


@dataclass
class Failed:
    error: APIError


@dataclass
class _Choice:
    prompt: int                      # index into Job.prompts
    token_ids: list[int] = field(default_factory=list)
    text_len: int = 0                # characters delivered
    finished: bool = False


class Job:
    """One HTTP request: ``len(prompts) * params.n`` choices; choice ``k * n + i`` is sample i of prompt k."""

    def __init__(self, job_id: str, prompts: list[PromptInput], params: SamplingParams):
        self.id = job_id
        self.prompts = prompts
        self.params = params
        self.choices = [_Choice(k) for k in range(len(prompts)) for _ in range(params.n)]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cached_tokens = 0
        self.prompt_logprobs: dict[int, list] = {}     # by prompt index (SamplingParams.prompt_logprobs)
        self.done = False
        self.posted = 0             # delta lists the engine thread sent
        self.taken = 0              # ... and the exchange read (the rest waits for a slow client)
        self.paused = False         # its engine requests are paused (EngineLoop._backpressure)


@dataclass
class _Route:
    """An engine request feeding a job: its output index i goes to choice ``indices[i]``."""

    job: Job
    indices: list[int]
    probation: bool = False      # a resumed sample re-run alone after a failed step


class EngineLoop:
    def __init__(self, engine: LLMEngine, buffer_steps: int = 64):
        self.engine = engine
        self.buffer_steps = buffer_steps      # a job more steps ahead of its reader pauses (backpressure)
        self._ops: deque = deque()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._routes: dict[str, _Route] = {}
        self._probation: deque[tuple[Job, int]] = deque()
        self._backlog: deque[Job] = deque()
        self._ids = itertools.count()
        self._outbox: list[tuple[Job, Any]] = []
        self.num_step_failures = 0
        self.num_prompt_tokens = 0          # prompt tokens of requests whose first token came (their prefill done)
        self.num_generation_tokens = 0      # tokens delivered
        self._started: set[str] = set()     # engine requests that delivered a token
        self.snapshot: dict[str, float] = {}
        self.on_finished = None   # (engine metrics, prompt tokens, SamplingParams) of each finished engine request
        self._publish()

    # ---- called from the event loop -------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="kimik3-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._push(("add", job))

    def abort(self, job: Job) -> None:
        self._push(("abort", job))

    def call(self, fn) -> asyncio.Future:
        """Run ``fn()`` on the engine thread between two steps (an engine operation such as EPLB's live rebalance);
        its result or exception comes in the returned future (event loop)."""
        future = self._loop.create_future()
        self._push(("call", (fn, future)))
        return future

    def refuse_queued(self) -> None:
        """Shutting down: fail (503) every job that has not started running yet."""
        self._push(("refuse_queued", None))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is left (its clients get a 503) and end the thread."""
        if self._thread is None:
            return
        self._push(("stop", None))
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("engine thread still busy after %.0f s at shutdown", timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def taken(self, job: Job) -> None:
        """The exchange read one of the job's delta lists (event loop); a paused job is woken once its reader
        has caught up to half the buffer."""
        job.taken += 1
        if job.paused and job.posted - job.taken <= self.buffer_steps // 2:
            self._wake.set()

    def _push(self, op) -> None:
        self._ops.append(op)
        self._wake.set()

    # ---- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        logger.info("engine loop started")
        while True:
            if not self._has_work():
                self._wake.wait(1.0)
                self._wake.clear()
            try:
                if not self._apply_ops():
                    break
                self._feed_engine()
                self._backpressure()
                if self.engine.has_unfinished_requests():
                    self._step()
            except Exception:   # a bug in this loop: keep serving, but say so
                logger.exception("engine loop error")
            self._publish()
            self._flush()
        self._publish()
        self._flush()
        logger.info("engine loop stopped")

    def _has_work(self) -> bool:
        return bool(self._ops) or self.engine.has_unfinished_requests() or (
            not self._routes and bool(self._probation or self._backlog))

    def _apply_ops(self) -> bool:
        while self._ops:
            op, job = self._ops.popleft()
            if op == "add":
                if self._probation or self._probation_running():
                    self._backlog.append(job)
                else:
                    self._add_job(job)
            elif op == "abort":
                self._drop_job(job)
            elif op == "refuse_queued":
                self._refuse_queued()
            elif op == "call":
                self._call(*job)
            elif op == "stop":
                jobs = {r.job.id: r.job for r in self._routes.values()}
                jobs.update({j.id: j for j, _ in self._probation})
                jobs.update({j.id: j for j in self._backlog})
                for job in jobs.values():
                    self._fail(job, APIError(503, "the server is shutting down; the request was aborted",
                                             code="shutting_down"))
                while self._ops:     # late adds and calls: refuse them too
                    op, job = self._ops.popleft()
                    if op == "add":
                        self._fail(job, APIError(503, "the server is shutting down", code="shutting_down"))
                    elif op == "call":
                        self._loop.call_soon_threadsafe(_settle, job[1], None, APIError(
                            503, "the server is shutting down", code="shutting_down"))
                return False
        return True

    def _call(self, fn, future) -> None:
        try:
            result, error = fn(), None
        except Exception as e:  # noqa: BLE001 - handed to the caller
            result, error = None, e
        self._loop.call_soon_threadsafe(_settle, future, result, error)

    def _refuse_queued(self) -> None:
        error = APIError(503, "the server is shutting down; the request was not started, retry on another instance",
                         code="shutting_down", headers={"Retry-After": "5"})
        started = {route.job.id for eid, route in self._routes.items() if self.engine.request_started(eid)}
        jobs = [j for j, _ in self._probation] + list(self._backlog) + [r.job for r in self._routes.values()]
        for job in {j.id: j for j in jobs if j.id not in started and not any(c.token_ids for c in j.choices)}.values():
            self._fail(job, error)
        self._probation = deque((j, i) for j, i in self._probation if not j.done)
        self._backlog = deque(j for j in self._backlog if not j.done)

    def _backpressure(self) -> None:
        """Pause the engine requests of a job whose client has left ``buffer_steps`` delta lists unread (a
        stream whose reader stopped: its memory stays bounded, and the server drops the connection after
        ``--stall-timeout``); resume them once half of that is read."""
        flip: dict[str, Job] = {}       # jobs to pause or resume (found without a dict a step of every job)
        limit, half = self.buffer_steps, self.buffer_steps // 2
        for route in self._routes.values():
            job = route.job
            behind = job.posted - job.taken
            if (behind > half if job.paused else behind >= limit) != job.paused:
                flip[job.id] = job
        if not flip:
            return
        for job in flip.values():
            job.paused = not job.paused
        for eid, route in self._routes.items():
            if route.job.id in flip:
                self.engine.pause_request(eid, route.job.paused)

    def _probation_running(self) -> bool:
        return any(r.probation for r in self._routes.values())

    def _feed_engine(self) -> None:
        """Probation requests run one at a time on an otherwise empty engine; then the backlog goes in."""
        if self._routes:
            return
        while self._probation and not self._routes:
            job, idx = self._probation.popleft()
            if not job.done:
                self._resume(job, idx)
        if not self._routes:
            while self._backlog:
                self._add_job(self._backlog.popleft())

    def _add_job(self, job: Job) -> None:
        if job.done:
            return
        for k, prompt in enumerate(job.prompts):
            if not self._add(job, f"{job.id}-{k}", prompt, job.params,
                             [k * job.params.n + i for i in range(job.params.n)]):
                return

    def _add(self, job: Job, engine_id: str, prompt: PromptInput, params: SamplingParams,
             indices: list[int], probation: bool = False) -> bool:
        try:
            self.engine.add_request(engine_id, {"prompt_token_ids": prompt.token_ids}, params,
                                    multi_modal_data=prompt.multi_modal)
        except ValueError as e:
            self._fail(job, APIError(400, str(e)))
            return False
        except Exception:
            logger.exception("add_request failed for %s", engine_id)
            self._fail(job, APIError(500, "the engine could not take the request (the server log has the details)",
                                     code="engine_error"))
            return False
        self._routes[engine_id] = _Route(job, indices, probation)
        return True

    def _resume(self, job: Job, idx: int) -> None:
        c = job.choices[idx]
        prompt = job.prompts[c.prompt]
        p = job.params
        if p.structured_outputs is not None:    # a fresh grammar would not know the delivered tokens
            self._fail(job, APIError(500, "the engine failed while this constrained request ran; retry it",
                                     code="engine_error"))
            return
        params = replace(p, n=1, max_tokens=p.max_tokens - len(c.token_ids),
                         min_tokens=max(0, p.min_tokens - len(c.token_ids)), prompt_logprobs=None,
                         seed=None if p.seed is None else p.seed + idx % p.n)     # sample i of its prompt
        tail = self._undelivered_text(c, p)
        if tail:
            self._emit(job, [ChoiceDelta(idx, tail, [], [] if p.logprobs is not None else None)])
        self._add(job, f"{job.id}-r{next(self._ids)}", PromptInput(prompt.token_ids + c.token_ids, prompt.multi_modal),
                  params, [idx], probation=True)

    def _undelivered_text(self, c: _Choice, p: SamplingParams) -> str:
        """Text of the delivered tokens that the old detokenizer held back (stop-string look-ahead)."""
        tok = self.engine.get_tokenizer() if p.detokenize else None
        if tok is None or not c.token_ids:
            return ""
        return tok.decode(c.token_ids, skip_special_tokens=p.skip_special_tokens)[c.text_len:]

    def _drop_job(self, job: Job) -> None:
        for eid in [eid for eid, r in self._routes.items() if r.job is job]:
            self._abort_engine(eid)
        if not job.done:
            job.done = True
            self._emit(job, Failed(APIError(499, "client disconnected", code="aborted")))

    def _abort_engine(self, engine_id: str) -> None:
        del self._routes[engine_id]
        self._started.discard(engine_id)
        try:
            self.engine.abort_request(engine_id)
        except Exception:
            logger.exception("abort_request(%s) failed", engine_id)

    def _fail(self, job: Job, error: APIError) -> None:
        for eid in [eid for eid, r in self._routes.items() if r.job is job]:
            self._abort_engine(eid)
        if not job.done:
            job.done = True
            self._emit(job, Failed(error))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - logged and blamed in _step_failed
            self._step_failed(e)
            return
        deltas: dict[Job, list[ChoiceDelta]] = {}
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:        # aborted by us; its memory is already free
                continue
            job = route.job
            if out.request_id not in self._started:
                self._started.add(out.request_id)
                self.num_prompt_tokens += len(out.prompt_token_ids)
            if out.prompt_logprobs is not None:
                job.prompt_logprobs[job.choices[route.indices[0]].prompt] = out.prompt_logprobs
            posted = deltas.get(job)
            if posted is None:
                posted = deltas[job] = []
            for o in out.outputs:
                idx = route.indices[o.index]
                c = job.choices[idx]
                c.token_ids.extend(o.token_ids)
                self.num_generation_tokens += len(o.token_ids)
                c.text_len += len(o.text)
                if o.finish_reason is not None:
                    c.finished = True
                # the engine's delta lists are its own copies, handed over (nothing else keeps them)
                posted.append(ChoiceDelta(idx, o.text, o.token_ids, o.logprobs, o.finish_reason, o.stop_reason))
            if out.finished:
                del self._routes[out.request_id]
                self._started.discard(out.request_id)
                job.cached_tokens += int(out.metrics.get("num_prefix_hit_tokens", 0))
                if self.on_finished is not None:
                    self.on_finished(out.metrics, len(out.prompt_token_ids), job.params)
        for job, ds in deltas.items():
            if not ds:
                continue
            self._emit(job, ds)
            if all(c.finished for c in job.choices) and not job.done:
                job.done = True
                self._emit(job, Done(job.cached_tokens))

    def _step_failed(self, error: Exception) -> None:
        self.num_step_failures += 1
        routes = dict(self._routes)
        jobs = {r.job.id: r.job for r in routes.values()}
        batch = getattr(error, "request_ids", None)       # StepError: the requests of the failed forward
        unknown = [eid for eid in batch or () if eid not in routes]
        for eid in unknown:                               # never ours: drop them, blame nobody for them
            logger.error("engine request %s has no job; aborting it", eid)
            self.engine.abort_request(eid)
        if batch is not None and not unknown:
            suspects = {routes[eid].job.id: routes[eid].job for eid in batch}
        else:
            suspects = jobs if not unknown else {}
        logger.error("engine step failed with %d request(s) in the engine: %s", len(routes), error,
                     exc_info=error)
        if len(suspects) == 1:      # only its data was in the failed forward: it alone fails
            for job in suspects.values():
                self._fail(job, APIError(500, "the engine failed while running this request; it was aborted "
                                              "(the server log has the details)", code="engine_error"))
        else:
            for eid, route in routes.items():
                if eid not in self._routes:
                    continue
                self._abort_engine(eid)
                for idx in route.indices:
                    if not route.job.choices[idx].finished:
                        self._probation.append((route.job, idx))
            logger.warning("re-running %d sample(s) one at a time to find the failing request", len(self._probation))
        try:   # deliver the aborts: frees nothing more, but clears the engine's bookkeeping
            s = self.engine.stats()
            if self.engine.has_unfinished_requests() and not s.num_running + s.num_waiting:
                self.engine.step()
        except Exception:
            logger.exception("engine step after a failure raised again")

    # ---- delivery -----------------------------------------------------------------------------------
    def _emit(self, job: Job, item) -> None:
        if isinstance(item, list):
            job.posted += 1
        self._outbox.append((job, item))

    def _flush(self) -> None:
        if not self._outbox or self._loop is None:
            self._outbox.clear()
            return
        batch, self._outbox = self._outbox, []
        try:
            self._loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:   # the event loop is closed (interpreter shutting down)
            pass

    def _publish(self) -> None:
        s = self.engine.stats()
        self.snapshot = {
            "running": float(s.num_running),
            "waiting": float(s.num_waiting + len(self._backlog) + len(self._probation)),
            "cache_usage": s.cache_usage,
            "free_blocks": float(s.num_free_blocks),
            "usable_blocks": float(s.num_usable_blocks),
            "prefix_hit_rate": s.prefix_hit_rate,
            "prefix_queried_tokens": float(s.num_queried_tokens),
            "prefix_hit_tokens": float(s.num_hit_tokens),
            "preemptions": float(s.num_preemptions),
            "draft_tokens": float(s.num_draft_tokens),
            "accepted_tokens": float(s.num_accepted_tokens),
            "drafts": float(s.num_drafts),
            "accepted_per_position": tuple(float(a) for a in s.accepted_per_position),
            "step_failures": float(self.num_step_failures),
            "prompt_tokens": float(self.num_prompt_tokens),
            "generation_tokens": float(self.num_generation_tokens),
            "time": time.monotonic(),
        }


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if not future.done():
        future.set_exception(error) if error is not None else future.set_result(result)


def _deliver(batch: list[tuple[Job, Any]]) -> None:
    for job, item in batch:
        job.queue.put_nowait(item)
