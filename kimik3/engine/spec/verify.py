"""Verifying a step's drafts against the target model (whatever drafter proposed them).

The model verifies a request's drafts in one forward (one chunk [last token, d_1 .. d_k], logits at every
row): d_j is accepted while it equals the target's greedy token at the row before it; the
target's token at the first mismatch (or after the last draft) is emitted too. So a step emits
1 .. k + 1 tokens, exactly the tokens plain greedy decoding would give. A sampled request accepts
d_j with probability p_j(d_j) (p_j: its processed distribution at row j - 1: temperature, min-p,
top-k, top-p), and on a rejection draws from p_j without d_j, renormalised (speculative sampling
with a one-token draft distribution): every emitted token has exactly the distribution plain
sampling gives it (a seeded request's uniforms from ``seeded_uniform``, per position and use).
Penalties (repetition, presence, frequency) apply to row j over the request's history and drafts 1..j
(``penalised``), as plain decoding applies them to each token: greedy rows pick the same tokens, sampled
rows accept and draw from the same penalised distributions.

Rollback of the recurrent layers (spec token-mixers §3.4, multi-slot in spirit): the step snapshots
the KDA state after each of the first k rows into spare slots; with m drafts accepted the request
continues from the snapshot after row m + 1 (copied into its live slot before its next step,
``Scheduler.settle_drafts``), or from the live state when all k were accepted. MLA latents of rejected
rows are simply overwritten later. Logprobs of every emitted token come from its own row.
"""

from __future__ import annotations

import dataclasses

import torch

from kimik3.engine.sample.logit_controls import apply_penalties
from kimik3.engine.sample.logprobs import logprob_dicts
from kimik3.engine.sample.sampler import Sampler, SamplerOutput, SamplingBatch, draw, filter_logits, seeded_uniform


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
    launches the next step, so reading them waits for this step alone). Requests with penalties get
    their rows penalised first (``penalised``) and are verified on those rows like any other."""
    spans = row_spans(chunks)
    params = [c.req.params for c in chunks]
    if any(p.has_penalties for p in params):
        logits, params = penalised(sampler, chunks, spans, logits)
        greedy = None
    if all(p.plain_greedy for p in params):
        targets = logits.argmax(-1).tolist() if greedy is None else greedy    # one device sync for every row
        result = SamplerOutput([targets[b - 1] for _, b in spans], [None] * len(chunks))
    else:
        last = torch.tensor([b - 1 for _, b in spans], device=logits.device)
        result = sampler.sample_rows([c.req for c in chunks], logits[last], raw[last], params).result()
        targets = [0] * spans[-1][1]                           # greedy rows of speculative chunks only
        greedy_rows = [j for c, p, (a, b) in zip(chunks, params, spans) if c.draft and p.greedy for j in range(a, b)]
        if greedy_rows:
            rows = logits[torch.tensor(greedy_rows, device=logits.device)].argmax(-1).tolist()
            for j, t in zip(greedy_rows, rows):
                targets[j] = t
    result.accepted = [[] for _ in chunks]
    sampled = []
    for i, (c, p, (a, _)) in enumerate(zip(chunks, params, spans)):
        if c.draft and p.greedy:
            m = accept_greedy(c.draft, targets[a:a + len(c.draft) + 1])
            result.accepted[i] = c.draft[:m]
            result.token_ids[i] = targets[a + m]
        elif c.draft:
            sampled.append(i)
    if sampled:
        _verify_sampled(sampler, [chunks[i] for i in sampled], [spans[i] for i in sampled], logits, result, sampled,
                        [params[i] for i in sampled])
    _logprobs(chunks, spans, raw, result)
    return result


def penalised(sampler: Sampler, chunks, spans, logits: torch.Tensor) -> tuple[torch.Tensor, list]:
    """The rows of requests with penalties penalised as plain decoding penalises each of their tokens: row j of a
    chunk over the request's history followed by its drafts 1..j (repetition: prompt and output ids; presence and
    frequency: output ids, ``logit_controls.apply_penalties``), the other rows unchanged; and every chunk's
    sampling settings, without the penalties where they were applied here (so nothing applies them twice)."""
    pen = [i for i, c in enumerate(chunks) if c.req.params.has_penalties]
    seen, counts = sampler.penalty_rows([chunks[i].req for i in pen])
    rows, owner, bumps = [], [], ([], [])
    for n, i in enumerate(pen):
        (a, b), draft = spans[i], chunks[i].draft
        for j in range(b - a):
            bumps[0].extend([len(rows)] * j)
            bumps[1].extend(draft[:j])
            rows.append(a + j)
            owner.append(n)
    dev = logits.device
    index = torch.tensor(owner, device=dev)
    counts = counts.index_select(0, index)
    if bumps[1]:
        counts.index_put_((torch.tensor(bumps[0], device=dev), torch.tensor(bumps[1], device=dev)),
                          torch.ones(len(bumps[1]), dtype=counts.dtype, device=dev), accumulate=True)
    row_params = [chunks[pen[n]].req.params for n in owner]
    sb = SamplingBatch.build(row_params, [None] * len(rows), sampler.vocab_size, dev,
                             (seen.index_select(0, index) | (counts > 0), counts))
    where = torch.tensor(rows, device=dev)
    logits = logits.index_copy(0, where, apply_penalties(logits.index_select(0, where), sb))
    params = [c.req.params for c in chunks]
    for i in pen:
        params[i] = dataclasses.replace(params[i], presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
    return logits, params


def _verify_sampled(sampler: Sampler, chunks, spans, logits: torch.Tensor, result: SamplerOutput,
                    index: list[int], chunk_params: list) -> None:
    """Speculative sampling of sampled requests: accept draft j + 1 with probability p_j(d),
    else draw from p_j without d; all accepted: keep the token drawn from the last row."""
    rows = [j for a, b in spans for j in range(a, b)]
    params = [p for p, (a, b) in zip(chunk_params, spans) for _ in range(a, b)]
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
