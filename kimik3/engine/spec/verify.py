"""Verifying a step's drafts against the target model (whatever drafter proposed them).

The model verifies a request's drafts in one forward (one chunk [last token, d_1 .. d_k], logits at every
row): d_j is accepted while it equals the target's greedy token at the row before it; the
target's token at the first mismatch (or after the last draft) is emitted too. So a step emits
1 .. k + 1 tokens, exactly the tokens plain greedy decoding would give. A sampled request accepts
d_j with probability p_j(d_j) (p_j: its processed distribution at row j - 1: temperature, min-p,
top-k, top-p), and on a rejection draws from p_j without d_j, renormalised (speculative sampling
with a one-token draft distribution): every emitted token has exactly the distribution plain
sampling gives it (a seeded request's uniforms from ``seeded_uniform``, per position and use).

Rollback of the recurrent layers (spec token-mixers §3.4, multi-slot in spirit): the step snapshots
the KDA state after each of the first k rows into spare slots; with m drafts accepted the request
continues from the snapshot after row m + 1 (copied into its live slot before its next step,
``Scheduler.settle_drafts``), or from the live state when all k were accepted. MLA latents of rejected
rows are simply overwritten later. Logprobs of every emitted token come from its own row.
"""

from __future__ import annotations

import torch

from kimik3.engine.sample.logprobs import logprob_dicts
from kimik3.engine.sample.sampler import Sampler, SamplerOutput, SamplingBatch, draw, filter_logits, is_plain_greedy, \
    seeded_uniform


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
