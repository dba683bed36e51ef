"""Logprobs: {token id: logprob} dicts under the raw model distribution (before any logit control or
sampling transform), for sampled tokens (the chosen token, then the top-n) and for prompt tokens."""

from __future__ import annotations

import torch


def logprob_parts(raw: torch.Tensor, tokens: torch.Tensor, num_logprobs: list[int | None]) -> tuple:
    """(top logprobs, their ids, the chosen tokens' logprobs) of ``raw``'s rows, on its device; ()
    when no row asks for logprobs."""
    wanted = [k for k in num_logprobs if k is not None]
    if not wanted:
        return ()
    lp = raw.log_softmax(-1)
    k = min(max(wanted), lp.shape[-1])
    top_vals, top_ids = lp.topk(k, -1) if k else (lp[:, :0], lp[:, :0].long())
    return top_vals, top_ids, lp.gather(-1, tokens[:, None])[:, 0]


def logprob_dicts(raw: torch.Tensor, tokens: torch.Tensor, num_logprobs: list[int | None]
                  ) -> list[dict[int, float] | None]:
    """Per row: {chosen token: its logprob, then the top-n tokens} under the raw model
    distribution (None for rows that asked for no logprobs)."""
    return dicts_from_parts(tokens.tolist(), [t.tolist() for t in logprob_parts(raw, tokens, num_logprobs)],
                            num_logprobs)


def dicts_from_parts(token_list: list[int], parts: list, num_logprobs: list[int | None]
                     ) -> list[dict[int, float] | None]:
    """``logprob_dicts`` from host copies: the chosen tokens and the ``logprob_parts`` as lists."""
    logprobs: list[dict[int, float] | None] = [None] * len(num_logprobs)
    if not parts:
        return logprobs
    top_vals, top_ids, chosen = parts
    for i, n_top in enumerate(num_logprobs):
        if n_top is not None:
            d = {token_list[i]: chosen[i]}
            d.update((t, v) for t, v in zip(top_ids[i][:n_top], top_vals[i][:n_top]) if t not in d)
            logprobs[i] = d
    return logprobs


def record_prompt_logprobs(scored: list[tuple], logits: torch.Tensor) -> None:
    """Store the logprob dicts of prompt positions: ``scored`` holds (request, position) per row of
    ``logits`` (the row scores the prompt token after the position)."""
    reqs = [q for q, _ in scored]
    targets = torch.tensor([q.token_ids[p + 1] for q, p in scored], device=logits.device)
    for q, d in zip(reqs, logprob_dicts(logits, targets, [q.params.prompt_logprobs for q in reqs])):
        if not q.out.prompt_logprobs:
            q.out.prompt_logprobs.append(None)      # the first prompt token has no logprob
        q.out.prompt_logprobs.append(d)
