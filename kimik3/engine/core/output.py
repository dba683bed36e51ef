"""What the engine hands back: stop checks on each new token, the per-request deltas and metrics of
``LLMEngine.step``, and the engine-wide counters of ``LLMEngine.stats``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kimik3.engine.core.block_hash import extend_block_hashes
from kimik3.engine.core.request import Request, RequestStatus

FINISHED = RequestStatus.FINISHED


class Logprob(float):
    """vLLM's ``Logprob(logprob, rank, decoded_token)``, as a float (the log-probability itself), so code that
    reads the values as floats keeps working. ``rank``: 1-based place among the returned candidates by
    log-probability, exact for the top ``logprobs`` entries; None for a sampled token outside them (its
    place in the whole vocabulary is not computed). ``decoded_token``: the token's text (None without a
    tokenizer)."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        obj = super().__new__(cls, logprob)
        obj.rank = rank
        obj.decoded_token = decoded_token
        return obj

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` samples of a request (vLLM's shape)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None     # per generated token: {token id: logprob} (LLM: Logprob values)
    finish_reason: str | None = None            # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None        # the stop token id or stop string that ended it
    cumulative_logprob: float | None = None     # LLM: the sum of the sampled tokens' logprobs (with logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request's result (from ``LLM.generate``) or a streamed delta (from ``LLMEngine.step``).

    Deltas carry only the tokens/text produced since the previous delta of the same sample.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then {token: logprob, top-n...}
    # per prompt token (in the first delta that has them all; None otherwise)
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counters (the one thing the server and the bench read)."""

    num_running: int
    num_waiting: int
    num_usable_blocks: int          # MLA latent-cache blocks (the null block excluded)
    num_free_blocks: int
    num_queried_tokens: int         # prompt tokens looked up in the prefix cache
    num_hit_tokens: int             # of them, found there
    num_preemptions: int
    num_draft_tokens: int           # speculative decoding: drafts verified / accepted
    num_accepted_tokens: int
    num_steps: int                  # runner steps, and those replayed as CUDA graphs
    num_graph_steps: int
    num_encoded_images: int         # images run through the vision tower (encoder cache misses)
    host_seconds: float             # batch building + sampling's host work (not the wait for the device)
    prepare_seconds: float          # batch building alone
    model_seconds: float            # the forward launches and image encoding
    num_drafts: int = 0             # verify chunks (requests that carried drafts, counted per step)
    accepted_per_position: tuple[int, ...] = ()   # drafts accepted at draft position 0, 1, ...

    @property
    def cache_usage(self) -> float:
        return (self.num_usable_blocks - self.num_free_blocks) / max(self.num_usable_blocks, 1)

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_hit_tokens / max(self.num_queried_tokens, 1)


@dataclass
class RequestGroup:
    """The n samples of one user request."""

    request_id: str
    prompt: str | None
    children: list[Request]
    sent_final: set[int] = field(default_factory=set)
    sent_prompt_logprobs: bool = False
    final_only: bool = False        # one delta, when every sample has finished (``LLMEngine.add_request``)


def record_scheduling(out, now: float) -> None:
    """A scheduled step's admissions and preemptions (``SchedulerOutput.admitted``, ``preempted``) in the
    requests' metrics: first scheduled time, prefix-hit tokens, preemption count."""
    for req, hits in out.admitted:
        if req.out.scheduled_time is None:
            req.out.scheduled_time = now
        req.out.num_prefix_hit_tokens = max(req.out.num_prefix_hit_tokens, hits)
    for req in out.preempted:
        req.out.num_preemptions += 1


def append_output(req: Request, token: int, logprob: dict[int, float] | None, max_model_len: int) -> str | None:
    """Append a generated token (its logprob, its grammar step) and check the stops: the finish reason
    it gives, "stop" or "length", or None. (``Request.append_token`` and ``reaches_length`` written out: this
    runs once a token a request, the hot path of a large batch's step.)"""
    ids, p, out = req.token_ids, req.params, req.out
    ids.append(token)
    n = len(ids)
    if n % req.block_size == 0:
        extend_block_hashes(req.block_hashes, ids, req.block_size, req.extra_keys)
    if p.logprobs is not None:
        out.logprobs.append(logprob)
    reason = None
    if token in p.stop_token_ids or (token == req.eos_token_id and not p.ignore_eos):
        out.stop_reason, reason = token, "stop"
    elif out.detok is not None and (hit := out.detok.add(token, n - len(req.prompt_token_ids) >= p.min_tokens)):
        out.stop_reason, reason = hit, "stop"
    elif n - len(req.prompt_token_ids) >= p.max_tokens or n >= max_model_len:     # ``Request.reaches_length``
        reason = "length"
    if req.matcher is not None:
        req.matcher.consume(token)
        if reason is None and req.matcher.stopped:      # the grammar is complete
            out.stop_reason, reason = token, "stop"
    if reason is not None and out.detok is not None and not isinstance(out.stop_reason, str):
        out.detok.finish()
    return reason


def deltas(groups: list[RequestGroup]) -> list[RequestOutput]:
    """One delta per group with new tokens or a final state; marks what it sends."""
    outs = []
    for g in groups:
        if g.final_only and not all(r.status is FINISHED for r in g.children):
            continue
        completions = []
        for i, req in enumerate(g.children):
            if i in g.sent_final:
                continue
            out, done = req.out, req.status is FINISHED
            prompt_len, sent = len(req.prompt_token_ids), out.num_sent_tokens
            n_out = len(req.token_ids) - prompt_len
            if n_out == sent and not done:
                continue
            completions.append(CompletionOutput(
                i, out.detok.take(done) if out.detok is not None else "", req.token_ids[prompt_len + sent:],
                out.logprobs[sent:] if req.params.logprobs is not None else None, req.finish_reason, out.stop_reason))
            out.num_sent_tokens = n_out
            if done:
                g.sent_final.add(i)
        finished = len(g.sent_final) == len(g.children)
        if completions or finished:
            first = g.children[0]
            prompt_lps = None
            if (first.params.prompt_logprobs is not None and not g.sent_prompt_logprobs
                    and len(first.out.prompt_logprobs) == first.num_prompt_tokens):
                prompt_lps, g.sent_prompt_logprobs = list(first.out.prompt_logprobs), True
            outs.append(RequestOutput(g.request_id, g.prompt, first.prompt_token_ids, completions,
                                      finished, metrics(g) if finished else {}, prompt_lps))
    return outs


def metrics(g: RequestGroup) -> dict[str, float]:
    """A finished request's timings (seconds) and counts, over its samples."""
    outs = [r.out for r in g.children]
    arrival = g.children[0].arrival
    end = max(o.finish_time or time.monotonic() for o in outs)
    n_out = sum(r.num_output_tokens for r in g.children)
    m = {"arrival_time": arrival, "e2e_s": end - arrival, "num_output_tokens": float(n_out),
         "num_preemptions": float(sum(o.num_preemptions for o in outs)),
         "num_prefix_hit_tokens": float(sum(o.num_prefix_hit_tokens for o in outs)),
         "max_output_tokens": float(max(r.num_output_tokens for r in g.children))}
    scheduled = [o.scheduled_time for o in outs if o.scheduled_time is not None]
    first = [o.first_token_time for o in outs if o.first_token_time is not None]
    if scheduled:
        m["queue_s"] = min(scheduled) - arrival          # waiting for a slot and cache
        m["inference_s"] = end - min(scheduled)          # running (prefill + decode)
    if first:
        m["ttft_s"] = min(first) - arrival
        if scheduled:
            m["prefill_s"] = min(first) - min(scheduled)
            m["decode_s"] = end - min(first)
        if n_out > len(g.children):
            m["tpot_s"] = (end - min(first)) / max(n_out / len(g.children) - 1, 1)
    return m
