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
sampling gives it, drawn with the request's own generator.

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

from kimik3.engine.sampling_params import SamplingParams


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix n-gram
    (``max_n`` >= n >= ``min_n``) of ``token_ids``; [] when none recurs."""
    if k < 1 or len(token_ids) < min_n + 1:
        return []
    data = array("q", token_ids).tobytes()
    width = array("q").itemsize
    for n in range(min(max_n, len(token_ids) - 1), min_n - 1, -1):
        suffix = data[-n * width:]
        end = len(data) - width             # an occurrence must end before the last token
        while True:
            pos = data.rfind(suffix, 0, end)
            if pos < 0:
                break
            if pos % width == 0:            # token-aligned match
                start = pos // width + n
                return token_ids[start:start + k]
            end = pos + len(suffix) - 1
    return []


def can_speculate(params: SamplingParams) -> bool:
    """Requests whose rows need no output history (no penalties)."""
    return not params.has_penalties


def is_plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing else to compute: the token is the argmax of its row."""
    return params.greedy and not params.has_penalties and params.logprobs is None


def accept_greedy(draft: list[int], targets: list[int]) -> int:
    """Number of leading drafts equal to the target's greedy tokens (targets[j] follows row j)."""
    m = 0
    while m < len(draft) and draft[m] == targets[m]:
        m += 1
    return m
