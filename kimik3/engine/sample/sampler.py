"""Sampling: one token per sequence that reached its last token, from its logits row.

Every transform is a tensor op over [n, vocab] (after the logit controls of ``logit_controls.py``):
penalties (``logit_controls.apply_penalties``), temperature, min-p, top-k, top-p. Unseeded rows draw
from the engine's generator (an exponential race); a seeded request's row inverts its distribution's
CDF at a uniform fixed by (seed, position of the token in the sequence) (``seeded_uniform``), so its
tokens depend on neither its batch, its step nor the device, a request resumed from its own output
continues as it would have, and a step of many seeded rows costs the same few tensor ops as one. Plain
greedy rows take the argmax. Speculative chunks (several rows each) are verified by
``spec/verify.py``, which uses these pieces. Logprobs come from ``logprobs.py``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from operator import attrgetter

import torch

from kimik3.engine.sample.logit_controls import PenaltyHistory, apply_penalties
from kimik3.engine.sample.logprobs import dicts_from_parts, logprob_parts
from kimik3.engine.sample.sampling_params import SamplingParams
from kimik3.engine.transfer import on_device


def is_plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing else to compute: the token is the argmax of its row."""
    return params.plain_greedy



class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int, num_live_slots: int):
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)     # requests without their own seed
        self.num_live_slots = num_live_slots
        self.history: PenaltyHistory | None = None      # built when the first request with penalties samples

    def sample_rows(self, reqs, logits: torch.Tensor, raw: torch.Tensor,
                    params: list[SamplingParams] | None = None) -> PendingOutput:
        """One token per request from its (controlled) row; logprobs from ``raw``. ``params``: the rows'
        settings in place of the requests' own (``spec/verify.py``: penalties already applied)."""
        if params is None:
            if all(map(attrgetter("plain_greedy"), reqs)):        # plain greedy: the argmax
                return PendingOutput(logits.argmax(-1), [None] * len(reqs))
            params = [r.params for r in reqs]
        elif all(p.plain_greedy for p in params):
            return PendingOutput(logits.argmax(-1), [None] * len(reqs))
        uniforms = [None if r.seed is None else seeded_uniform(r.seed, r.num_tokens) for r in reqs]
        history = self.penalty_rows(reqs) if any(p.has_penalties for p in params) else None
        sb = SamplingBatch.build(params, uniforms, self.vocab_size, self.device, history)
        return sample(logits, sb, self.generator, raw)

    def penalty_rows(self, reqs) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen, counts) of the requests' token histories (``PenaltyHistory.rows``), built at first use."""
        if self.history is None:
            self.history = PenaltyHistory(1 + self.num_live_slots, self.vocab_size, self.device)
        return self.history.rows(reqs)


@dataclass
class SamplingBatch:
    """Per-row sampling settings for one step, as device tensors (n rows)."""

    temperature: torch.Tensor           # [n] fp32, 1.0 on greedy rows (they use argmax)
    greedy: torch.Tensor                # [n] bool
    top_k: torch.Tensor | None          # [n] int64 (vocab = off), None when no row uses it
    top_p: torch.Tensor | None          # [n] fp32
    min_p: torch.Tensor | None          # [n] fp32
    presence: torch.Tensor | None       # [n] fp32, None when no row has any penalty
    frequency: torch.Tensor | None
    repetition: torch.Tensor | None
    seen: torch.Tensor | None           # [n, vocab] bool: in the prompt or the output (repetition penalty)
    counts: torch.Tensor | None         # [n, vocab] fp32: times in the output (presence, frequency)
    uniforms: list[float | None]        # seeded rows: the uniform their token inverts the CDF at
    num_logprobs: list[int | None]
    all_greedy: bool

    @staticmethod
    def build(params: list[SamplingParams], uniforms: list[float | None], vocab_size: int,
              device: torch.device | str, history: tuple[torch.Tensor, torch.Tensor] | None = None) -> SamplingBatch:
        """``history``: (seen, counts) of the rows (``PenaltyHistory.rows``), needed when any row has
        penalties."""
        f32 = torch.float32
        greedy = [p.greedy for p in params]
        top_k = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]
        penal = any(p.has_penalties for p in params)
        if penal and history is None:
            raise ValueError("SamplingBatch.build: rows with penalties need their token history")

        def col(values, default, dtype=f32):
            return None if all(v == default for v in values) else on_device(values, dtype, device)

        return SamplingBatch(
            temperature=on_device([1.0 if g else p.temperature for p, g in zip(params, greedy)], f32, device),
            greedy=on_device(greedy, torch.bool, device),
            top_k=col(top_k, vocab_size, torch.int64),
            top_p=col([p.top_p for p in params], 1.0),
            min_p=col([p.min_p for p in params], 0.0),
            presence=on_device([p.presence_penalty for p in params], f32, device) if penal else None,
            frequency=on_device([p.frequency_penalty for p in params], f32, device) if penal else None,
            repetition=on_device([p.repetition_penalty for p in params], f32, device) if penal else None,
            seen=history[0] if penal else None, counts=history[1] if penal else None,
            uniforms=uniforms, num_logprobs=[p.logprobs for p in params], all_greedy=all(greedy))


def filter_logits(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Temperature, then min-p, top-k, top-p; removed tokens get -inf."""
    logits = logits / b.temperature[:, None]
    if b.min_p is not None:
        probs = logits.softmax(-1)
        floor = b.min_p[:, None] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if b.top_k is None and b.top_p is None:
        return logits
    sorted_logits, order = logits.sort(-1, descending=True)
    if b.top_k is not None:
        rank = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(rank[None, :] >= b.top_k[:, None], float("-inf"))
    if b.top_p is not None:
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs     # mass of the more likely tokens; the top token always stays
        sorted_logits = sorted_logits.masked_fill(before >= b.top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def seeded_uniform(seed: int, position: int, stream: int = 0) -> float:
    """A uniform in (0, 1) fixed by a seeded request's seed, the sequence position it draws for, and the
    stream (0: the token, 1: accepting a draft, 2: the token after a rejected draft): 53 bits of blake2b."""
    h = hashlib.blake2b(f"{seed}:{position}:{stream}".encode(), digest_size=8).digest()
    return ((int.from_bytes(h, "little") >> 11) + 0.5) / 2 ** 53


def draw(probs: torch.Tensor, uniforms: list[float | None], default: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs``: rows with a uniform take the token where their CDF (float64)
    reaches it; the others race (argmax p/q, q ~ Exp(1) from ``default``). No host sync."""
    seeded = [i for i, u in enumerate(uniforms) if u is not None]
    tokens = None
    if len(seeded) < len(uniforms):
        q = torch.empty_like(probs).exponential_(generator=default)
        tokens = (probs / q.clamp_(min=1e-20)).argmax(-1)
    if seeded:
        dev = probs.device
        rows = on_device(seeded, torch.int64, dev) if tokens is not None else None
        cdf = (probs if rows is None else probs.index_select(0, rows)).double().cumsum(-1)
        u = on_device([uniforms[i] for i in seeded], torch.float64, dev)[:, None] * cdf[:, -1:]
        picked = torch.searchsorted(cdf, u).clamp_(max=probs.shape[-1] - 1)[:, 0]
        tokens = picked if rows is None else tokens.index_copy(0, rows, picked)
    return tokens


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    accepted: list[list[int]] | None = None     # speculative: per sampling chunk, drafts accepted before token_ids[i]
    accepted_logprobs: list[list[dict[int, float] | None]] | None = None    # their logprobs (None: not asked for)

    def result(self) -> SamplerOutput:
        return self


class PendingOutput:
    """Sampled tokens (and their logprob tensors) on their way to the host: the device-to-host copies
    are queued without waiting, so work queued after them (async scheduling's next step) runs on;
    ``result`` waits for these copies alone."""

    def __init__(self, tokens: torch.Tensor, num_logprobs: list[int | None], raw: torch.Tensor | None = None):
        self.tokens = tokens                    # [n] int64 on the device (the next step's input ids)
        self.num_logprobs = num_logprobs
        parts = logprob_parts(raw, tokens, num_logprobs) if raw is not None else ()
        self._host = [t.to("cpu", non_blocking=True) for t in (tokens, *parts)]
        self._ready = torch.cuda.Event() if tokens.is_cuda else None
        if self._ready is not None:
            self._ready.record()

    def result(self) -> SamplerOutput:
        if self._ready is not None:
            self._ready.synchronize()
        tokens, *parts = [t.tolist() for t in self._host]
        return SamplerOutput(tokens, dicts_from_parts(tokens, parts, self.num_logprobs))


def sample(logits: torch.Tensor, b: SamplingBatch, default_generator: torch.Generator | None = None,
           raw: torch.Tensor | None = None) -> PendingOutput:
    """logits [n, vocab] fp32 (logit controls already applied) -> one token per row (+ logprobs of
    ``raw``, the model distribution before any processing; default ``logits``)."""
    raw = logits if raw is None else raw
    if b.presence is not None:
        logits = apply_penalties(logits, b)
    tokens = logits.argmax(-1)
    if not b.all_greedy:
        probs = filter_logits(logits, b).softmax(-1)
        tokens = torch.where(b.greedy, tokens, draw(probs, b.uniforms, default_generator))
    return PendingOutput(tokens, b.num_logprobs, raw)
