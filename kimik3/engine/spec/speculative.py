"""Speculative decoding with n-gram (prompt lookup) drafts: no draft model, no extra weights.

Each step, a decoding request may carry up to ``k`` draft tokens: the tokens that followed
the most recent earlier occurrence of its last ``n`` tokens (n from ``max_n`` down to ``min_n``).
The model verifies them in the same forward (one chunk [last token, d_1 .. d_k], logits at every
row): d_j is accepted while it equals the target's greedy token at the row before it; the
target's token at the first mismatch (or after the last draft) is emitted too. So a step emits
1 .. k + 1 tokens, exactly the tokens plain greedy decoding would give. A sampled request accepts
d_j with probability p_j(d_j) (p_j: its processed distribution at row j - 1: temperature, min-p,
top-k, top-p), and on a rejection draws from p_j without d_j, renormalised (speculative sampling
with a one-token draft distribution): every emitted token has exactly the distribution plain
sampling gives it (a seeded request's uniforms from ``seeded_uniform``, per position and use).

Rollback of the recurrent layers (spec token-mixers §3.4, multi-slot in spirit): the step snapshots
the KDA state after each of the first k rows into spare slots; with m drafts accepted the request
continues from the snapshot after row m + 1 (copied into its live slot before its next step), or
from the live state when all k were accepted. MLA latents of rejected rows are simply overwritten
later. Speculation applies to requests without penalties (their rows would depend on the drafts
before them); the others decode one token per step in the same batches. Logprobs of every
emitted token come from its own row.
"""

from __future__ import annotations

from array import array

import torch

from kimik3.engine.sample.logprobs import logprob_dicts
from kimik3.engine.sample.sampler import Sampler, SamplerOutput, SamplingBatch, draw, filter_logits, is_plain_greedy, \
    seeded_uniform
from kimik3.engine.sample.sampling_params import SamplingParams


def token_bytes(req) -> bytearray:
    """``req.token_ids`` as int64 bytes for ``propose_ngram``, kept on the request and extended by the
    tokens appended since the last call (converting a 1M-token list each step took 59 ms)."""
    buf, width = req.token_bytes, array("q").itemsize
    if len(buf) // width < req.num_tokens:
        buf.extend(array("q", req.token_ids[len(buf) // width:]).tobytes())
    return buf


def _rfind_tokens(data: bytes, n: int, end: int) -> int:
    """Token index of the latest occurrence of the last ``n`` tokens of ``data`` (int64 bytes) that
    ends by byte ``end``; -1 when there is none."""
    width = array("q").itemsize
    suffix = data[-n * width:]
    while True:
        pos = data.rfind(suffix, 0, end)
        if pos < 0:
            return -1
        if pos % width == 0:                # token-aligned match
            return pos // width
        end = pos + len(suffix) - 1


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int, data: bytes | None = None,
                  follow: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix n-gram
    (``max_n`` >= n >= ``min_n``) of ``token_ids`` that ``follow`` tokens or more follow; [] when none
    recurs. ``data``: the same tokens as int64 bytes (``token_bytes``), else converted here."""
    if k < 1 or len(token_ids) < min_n + follow:
        return []
    data = array("q", token_ids).tobytes() if data is None else data
    width = array("q").itemsize
    for n in range(min(max_n, len(token_ids) - follow), min_n - 1, -1):
        pos = _rfind_tokens(data, n, len(data) - follow * width)    # it ends ``follow`` tokens before the end
        if pos >= 0:
            return token_ids[pos + n:pos + n + k]
    return []


def may_propose_after(token_ids: list[int], min_n: int, data: bytes | None = None) -> bool:
    """False when ``propose_ngram`` finds nothing for ``token_ids`` plus any one more token: its
    suffix n-grams (n >= ``min_n``) end in that token, so each can recur only where the n - 1 tokens
    before it recur followed by a token, and the shortest of those (n = min_n) recurs wherever a longer
    one does. With min_n = 1 any token may recur: True. Under async scheduling this lets a step whose
    drafts cannot exist run ahead instead of waiting for the previous step's token."""
    if min_n <= 1:
        return True
    if len(token_ids) < min_n:
        return False
    data = array("q", token_ids).tobytes() if data is None else data
    width = array("q").itemsize
    return _rfind_tokens(data, min_n - 1, len(data) - width) >= 0


def can_speculate(params: SamplingParams) -> bool:
    """Requests whose rows need no output history (no penalties)."""
    return not params.has_penalties


def row_spans(chunks) -> list[tuple[int, int]]:
    """Each sampling chunk's logits rows [a, b): one, plus one per draft token."""
    spans, r = [], 0
    for c in chunks:
        spans.append((r, r + 1 + len(c.draft)))
        r += 1 + len(c.draft)
    return spans


def accept_greedy(draft: list[int], targets: list[int]) -> int:
    """Number of leading drafts equal to the target's greedy tokens (targets[j] follows row j)."""
    m = 0
    while m < len(draft) and draft[m] == targets[m]:
        m += 1
    return m


def verify(sampler: Sampler, chunks, logits: torch.Tensor, raw: torch.Tensor,
           greedy: list[int] | None = None) -> SamplerOutput:
    """The tokens of a step with speculative chunks: per chunk, its accepted drafts
    (``SamplerOutput.accepted``) and the token after them. A chunk brings one logits row per draft
    plus one (row j verifies draft j + 1); a chunk without drafts samples from its one row.
    ``logits``: with the logit controls applied; ``raw``: without (for logprobs). ``greedy``: every
    row's argmax already on the host (plain greedy chunks only; the engine copies them out before it
    launches the next step, so reading them waits for this step alone)."""
    spans = row_spans(chunks)
    if all(is_plain_greedy(c.req.params) for c in chunks):
        targets = logits.argmax(-1).tolist() if greedy is None else greedy    # one device sync for every row
        result = SamplerOutput([targets[b - 1] for _, b in spans], [None] * len(chunks))
    else:
        last = torch.tensor([b - 1 for _, b in spans], device=logits.device)
        result = sampler.sample_rows([c.req for c in chunks], logits[last], raw[last]).result()
        targets = [0] * spans[-1][1]                           # greedy rows of speculative chunks only
        greedy_rows = [j for c, (a, b) in zip(chunks, spans) if c.draft and c.req.params.greedy
                       for j in range(a, b)]
        if greedy_rows:
            rows = logits[torch.tensor(greedy_rows, device=logits.device)].argmax(-1).tolist()
            for j, t in zip(greedy_rows, rows):
                targets[j] = t
    result.accepted = [[] for _ in chunks]
    sampled = []
    for i, (c, (a, _)) in enumerate(zip(chunks, spans)):
        if c.draft and c.req.params.greedy:
            m = accept_greedy(c.draft, targets[a:a + len(c.draft) + 1])
            result.accepted[i] = c.draft[:m]
            result.token_ids[i] = targets[a + m]
        elif c.draft:
            sampled.append(i)
    if sampled:
        _verify_sampled(sampler, [chunks[i] for i in sampled], [spans[i] for i in sampled], logits, result, sampled)
    _logprobs(chunks, spans, raw, result)
    return result


def _verify_sampled(sampler: Sampler, chunks, spans, logits: torch.Tensor, result: SamplerOutput,
                    index: list[int]) -> None:
    """Speculative sampling of sampled requests: accept draft j + 1 with probability p_j(d),
    else draw from p_j without d; all accepted: keep the token drawn from the last row."""
    rows = [j for a, b in spans for j in range(a, b)]
    params = [c.req.params for c, (a, b) in zip(chunks, spans) for _ in range(a, b)]
    sb = SamplingBatch.build(params, [None] * len(rows), sampler.vocab_size, sampler.device)
    probs = filter_logits(logits[torch.tensor(rows, device=logits.device)], sb).softmax(-1)
    starts, local = [], 0                          # each chunk's first row in ``probs``
    for a, b in spans:
        starts.append(local)
        local += b - a
    draft_rows = [s + j for c, s in zip(chunks, starts) for j in range(len(c.draft))]
    p_draft = probs[torch.tensor(draft_rows, device=probs.device),
                    torch.tensor([t for c in chunks for t in c.draft], device=probs.device)].tolist()
    k = 0
    gen = sampler.generator
    for i, c, start in zip(index, chunks, starts):
        n, seed, pos = len(c.draft), c.req.seed, c.req.num_tokens
        u = (torch.rand(n, generator=gen, device=gen.device).tolist() if seed is None
             else [seeded_uniform(seed, pos + j, 1) for j in range(n)])
        m = 0
        while m < n and u[m] < p_draft[k + m]:
            m += 1
        result.accepted[i] = c.draft[:m]
        if m < n:                                  # rejected: draw from p_m without the draft token
            residual = probs[start + m].clone()
            residual[c.draft[m]] = 0.0
            uniform = None if seed is None else seeded_uniform(seed, pos + m, 2)
            result.token_ids[i] = int(draw(residual[None], [uniform], gen)[0])
        k += n


def _logprobs(chunks, spans, logits: torch.Tensor, result: SamplerOutput) -> None:
    """Logprobs of the emitted tokens of speculative chunks that ask for them: row j for the
    accepted draft j + 1, row m for the final token."""
    rows, tokens, tops, where = [], [], [], []
    result.accepted_logprobs = [[None] * len(acc) for acc in result.accepted]
    for i, (c, (a, _)) in enumerate(zip(chunks, spans)):
        if c.draft and c.req.params.logprobs is not None:
            emitted = [*result.accepted[i], result.token_ids[i]]
            rows.extend(range(a, a + len(emitted)))
            tokens.extend(emitted)
            tops.extend([c.req.params.logprobs] * len(emitted))
            where.extend((i, j) for j in range(len(emitted)))
    if not rows:
        return
    dicts = logprob_dicts(logits[torch.tensor(rows, device=logits.device)],
                          torch.tensor(tokens, device=logits.device), tops)
    for (i, j), d in zip(where, dicts):
        if j < len(result.accepted[i]):
            result.accepted_logprobs[i][j] = d
        else:
            result.logprobs[i] = d


# A request whose verify step accepted no draft stops drafting and watches instead: each decode step still
# looks up its n-gram prediction of the next token (on the host, no rows on the device), and it drafts again
# once WATCH_HITS predictions in a row came true (``Scheduler._watching``). A prediction that comes true is
# exactly a first draft that would have been accepted (greedy; sampled: with the probability the verify
# accepts it), so drafts that keep failing cost one failed verify on the device, where a fixed pause
# probed again after 4, 16, 64 .. 128 steps (each probe about 0.2 of a plain step on the K3 slice: rejected
# drafts cost 0.5-0.6% of the first 256 tokens at 856b609). Two hits in a row, not one: where predictions
# come true at random with probability p, a probe follows p^2 of the steps, not p.
WATCH_HITS = 2
# Each n-gram lookup scans the request's history (about 3 us per 1k tokens here: 0.1 ms at 32k, which a batch of
# 128 pays per step), so a watching request whose prediction failed skips its next lookups: 4, 16, 64, then
# MAX_WATCH_PAUSE decode steps as its misses grow (the schedule the device probes once had, now host work only).
WATCH_PAUSE_BASE = 4
MAX_WATCH_PAUSE = 128
# Under async scheduling a request whose n-gram lookup found nothing skips this many decode steps' lookups
# (on a long context each lookup scans its whole history).
EMPTY_DRAFT_PAUSE = 4


def is_watching(req) -> bool:
    """Whether ``req`` watches its predictions instead of drafting (a failed verify step, watching on)."""
    return bool(req.draft_misses) and WATCH_HITS > 0


def watch_pause(misses: int) -> int:
    """Decode steps a watching request skips lookups after a wrong prediction; ``misses`` counts its failed
    verify step and wrong predictions since (2 at the first wrong prediction)."""
    return min(WATCH_PAUSE_BASE ** (misses - 1), MAX_WATCH_PAUSE)


def settle_drafts(kv, chunk, m: int) -> None:
    """A speculative chunk accepted ``m`` of its drafts: keep the snapshot after row m + 1 for the
    request's next step (unless every draft was accepted: then the live state is right) and give
    the other snapshot slots back; a request that accepted none watches instead of drafting (``WATCH_HITS``),
    and its next step carries at most m + 1 drafts (``draft_limit``)."""
    chunk.num_accepted = m
    req = chunk.req
    req.draft_misses = 0 if m else req.draft_misses + 1
    req.draft_streak, req.draft_watch = 0, None
    # A rejected draft limits the next step's drafts to m + 1 (a step that accepted all raises the limit by
    # one; the scheduler caps it at ``num_speculative_tokens``): each row of a verify step costs (on MoE
    # models a row touches its own top-k experts: a (1, 4)-row verify graph of the K3 slice reads up to four
    # tokens' experts), so drafts that fail at the same place stop paying for the rows after it, and a
    # request back from watching probes with one draft.
    req.draft_limit = m + 1 if m < len(chunk.draft) else max(req.draft_limit, m + 1)
    slots = chunk.spec_slots
    if m < len(chunk.draft):
        kv.keep_rollback(req, slots[m])
        kv.return_spec_slots(slots[:m] + slots[m + 1:])
    else:
        kv.return_spec_slots(slots)
