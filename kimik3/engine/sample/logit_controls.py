"""Logit controls: per-request rewrites of logits rows before sampling (logit_bias, min_tokens,
bad_words, allowed_token_ids and the grammar of structured outputs).

They touch only the rows of requests that have them: their entries (biases, banned and allowed ids,
the grammar bitmask) go to the device as a few index tensors and one bitmask, and one gather /
index_put / masked_fill / index_copy sequence rewrites those rows; the other rows are not read or
written, so they stay bit-identical.

Penalties (repetition, presence, frequency) are applied by the sampler, over every row of a step
that has any (``apply_penalties``), from the token history ``PenaltyHistory`` keeps on the device.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from kimik3.engine.sample.sampling_params import SamplingParams
from kimik3.engine.sample.structured import fill_bitmasks, unpack_bitmask
from kimik3.engine.transfer import on_device


def controlled_logits(chunks, spans: list[tuple[int, int]], logits: torch.Tensor) -> torch.Tensor:
    """Logits with each controlled request's controls applied. Chunk i owns rows ``spans[i]``; row
    a + j of a speculative chunk sees the request's output followed by its drafts 1..j."""
    rows: list[int] = []
    controls: list[ControlRow] = []
    for c, (a, b) in zip(chunks, spans):
        q = c.req
        if not q.params.has_controls:
            continue
        ends = [t for t in (q.eos_token_id, *q.params.stop_token_ids) if t is not None and not
                (t == q.eos_token_id and q.params.ignore_eos)]
        bad = q.bad_words
        keep = bad.longest_prefix if bad is not None else 0     # bad words read the last tokens only
        tail = q.token_ids[max(q.num_prompt_tokens, q.num_tokens - keep):] if keep else []
        if q.device_controls is None:                 # once per request
            q.device_controls = DeviceControls.of(q.params, logits.device)
        for j in range(b - a):
            rows.append(a + j)
            hist = (tail + c.draft[:j])[-keep:] if keep else []
            controls.append(ControlRow(q.params, hist, ends, bad, q.matcher, c.draft[:j],
                                       q.num_output_tokens + j, q.device_controls))
    if not rows:
        return logits
    bitmask = None
    if any(row.matcher is not None for row in controls):
        bitmask = fill_bitmasks([(row.matcher, row.pending) for row in controls])
    return apply_controls(logits, rows, controls, bitmask)


@dataclass
class ControlRow:
    """What one logits row needs for its logit controls: its request's settings and history."""

    params: SamplingParams
    output_ids: list[int]               # generated tokens before this row (drafts included): the last ones
                                        # the bad words read, or all of them
    end_ids: list[int]                  # tokens min_tokens holds back (EOS and stop_token_ids)
    bad_words: BadWords | None          # token sequences of the bad words
    matcher: object | None = None       # structured.Matcher, or None
    pending: list[int] | None = None    # draft tokens the matcher has not consumed yet (speculative rows)
    num_output: int | None = None       # generated tokens before this row (None: len(output_ids))
    tensors: DeviceControls | None = None    # the request's ids and biases on the device (None: made here)


@dataclass
class DeviceControls:
    """A request's allowed ids and logit biases as device tensors, made once: a step then writes them
    with one tensor op per row, whatever their number (up to the vocabulary)."""

    allowed: torch.Tensor | None        # int64 ids
    bias_ids: torch.Tensor | None       # int64 ids
    bias: torch.Tensor | None           # fp32 values

    @staticmethod
    def of(params: SamplingParams, device: torch.device) -> DeviceControls:
        allowed = None if params.allowed_token_ids is None else on_device(params.allowed_token_ids, torch.int64, device)
        lb = params.logit_bias or {}
        return DeviceControls(allowed, on_device(list(lb), torch.int64, device) if lb else None,
                              on_device(list(lb.values()), torch.float32, device) if lb else None)


class BadWords:
    """The token sequences of a request's bad words, indexed by all but their last token, so a row
    looks up one tuple per distinct word length instead of scanning every word (a request may carry
    thousands)."""

    def __init__(self, seqs: list[list[int]]):
        self.seqs = seqs
        self.last_by_prefix: dict[tuple[int, ...], list[int]] = {}
        for w in seqs:
            self.last_by_prefix.setdefault(tuple(w[:-1]), []).append(w[-1])
        self.prefix_lengths = sorted({len(w) - 1 for w in seqs})
        self.longest_prefix = max(self.prefix_lengths, default=0)

    def banned(self, hist: list[int]) -> list[int]:
        """The last token of each word whose other tokens end ``hist``."""
        out: list[int] = []
        for k in self.prefix_lengths:
            if len(hist) >= k:
                out.extend(self.last_by_prefix.get(tuple(hist[len(hist) - k:]), ()))
        return out


def banned_ids(row: ControlRow) -> list[int]:
    """Tokens this row may not produce: end tokens before ``min_tokens``, and the last token of each
    bad word whose other tokens end the output."""
    n = len(row.output_ids) if row.num_output is None else row.num_output
    out = list(row.end_ids) if n < row.params.min_tokens else []
    if row.bad_words is not None:
        out.extend(row.bad_words.banned(row.output_ids))
    return out


def apply_controls(logits: torch.Tensor, rows: list[int], controls: list[ControlRow],
                   bitmask: torch.Tensor | None) -> torch.Tensor:
    """Logits with the controls of ``rows`` applied (other rows unchanged): + logit_bias, -inf on banned
    ids, only allowed_token_ids and the grammar's tokens (``bitmask``: int32 [len(rows), words] host
    tensor, or None) left. A row whose allowed set would be empty keeps the grammar's set alone (a request
    whose allowed ids hold none of the constraint's first tokens is refused at admission; a later step can still
    find the two disjoint)."""
    dev = logits.device
    n_rows, vocab = len(rows), logits.shape[-1]
    every_row = rows == list(range(logits.shape[0]))       # (a batch of constrained requests): no gather
    index = None if every_row else on_device(rows, torch.int64, dev)
    tensors = [row.tensors or DeviceControls.of(row.params, dev) for row in controls]
    r, c = [], []
    for k, row in enumerate(controls):
        for t in banned_ids(row):
            r.append(k), c.append(t)
    biased = [k for k, t in enumerate(tensors) if t.bias_ids is not None]
    sub = logits.index_select(0, index) if index is not None else logits.clone() if r or biased else logits
    for k in biased:                 # one op per biased row: its ids and values stay on the device
        sub[k].index_add_(0, tensors[k].bias_ids, tensors[k].bias.to(sub.dtype))
    if r:
        sub.index_put_((on_device(r, torch.int64, dev), on_device(c, torch.int64, dev)),
                       torch.tensor(float("-inf"), dtype=sub.dtype, device=dev))
    grammar = unpack_bitmask(bitmask, vocab, dev) if bitmask is not None else None
    listed = [k for k, row in enumerate(controls) if row.params.allowed_token_ids is not None]
    if listed:
        allow = torch.ones(n_rows, vocab, dtype=torch.bool, device=dev)
        allow[on_device(listed, torch.int64, dev)] = False
        for k in listed:          # one index write per listed row: its ids stay on the device
            allow[k, tensors[k].allowed] = True
        if grammar is not None:
            both = allow & grammar
            grammar = torch.where(both.any(-1, keepdim=True), both, grammar)
        else:
            grammar = allow
    if grammar is not None:
        sub = sub.masked_fill(~grammar, float("-inf"))      # out of place: the raw logits stay for logprobs
    return sub if index is None else logits.index_copy(0, index, sub)


class PenaltyHistory:
    """The token history penalties read, kept on the device per live state slot and brought up to
    date with each step's new tokens: a penalized row costs O(new tokens) a step, not O(prompt +
    output) (rebuilding [n, P] id tensors from the token lists took 134 ms a step for 32 requests
    of 32k-token prompts). A slot's rows are rebuilt when another request takes it (a request
    preempted and re-admitted to its own slot keeps them: its history did not change). ``seen``:
    in the prompt; ``counts``: times in the output (int32). Size: (1 + max_num_seqs) x vocab x 5
    bytes, allocated when the first penalized request samples, outside the cache plan (211 MB for
    K3's vocabulary at 256 sequences)."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device):
        self.seen = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)
        self.counts = torch.zeros(num_slots, vocab_size, dtype=torch.int32, device=device)
        self.owner: list[weakref.ref | None] = [None] * num_slots   # the request whose history a slot holds
        # (weakly: a finished request's tokens are not kept alive by the slot it last held)
        self.num_counted = [0] * num_slots                        # its output tokens counted so far
        self.device = device

    def rows(self, reqs) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen [n, vocab] bool: prompt or output, counts [n, vocab] fp32) of the requests' rows."""
        dev, slots, new_slots, new_ids = self.device, [], [], []
        for q in reqs:
            s = q.cache.state_slot
            slots.append(s)
            if self.owner[s] is None or self.owner[s]() is not q:
                self.owner[s], self.num_counted[s] = weakref.ref(q), 0
                self.seen[s].zero_()
                self.counts[s].zero_()
                self.seen[s, on_device(q.prompt_token_ids, torch.int64, dev)] = True
            new = q.token_ids[q.num_prompt_tokens + self.num_counted[s]:]
            new_slots.extend([s] * len(new))
            new_ids.extend(new)
            self.num_counted[s] = q.num_output_tokens
        if new_ids:
            self.counts.index_put_((on_device(new_slots, torch.int64, dev), on_device(new_ids, torch.int64, dev)),
                                   torch.ones(len(new_ids), dtype=torch.int32, device=dev), accumulate=True)
        index = on_device(slots, torch.int64, dev)
        counts = self.counts.index_select(0, index).float()
        return self.seen.index_select(0, index) | (counts > 0), counts


def apply_penalties(logits: torch.Tensor, b) -> torch.Tensor:
    """Repetition (HF: prompt + output ids), then presence/frequency (OpenAI: output ids); ``b``: the
    step's ``sampler.SamplingBatch``, whose penalty columns are set."""
    rep, counts = b.repetition[:, None], b.counts
    logits = torch.where(b.seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - b.frequency[:, None] * counts - b.presence[:, None] * (counts > 0).float()
