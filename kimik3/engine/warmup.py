"""Warm-up: run the kinds of step that serving will hit once, before the first request.

On a GPU the first step of a new kind compiles Triton kernels (and autotunes fla's): a prefill
length in a new class (Triton specialises integer arguments on == 1 and on divisibility by 16,
and some tiles on the next power of two of the rows), a mixed step with decode rows beside a
chunk, a longer context's split count. Without a warm-up those compiles (seconds each) land on
the first requests' time to first token. ``warm_up`` runs three rounds over step sizes 2^k - 1, 2^k and
2^k + 1 up to one step's token budget, each prompt decoding two tokens:
(1) one size at a time, so a step holds exactly each of those token counts (the step-size classes: serving's
    steps take any size, and the kernels specialise on the step's rows). A size above the longest prompt
    ``max_model_len`` admits is a group of prompts that fill one step together (the K3 slice served with
    ``max_model_len`` 400 on an H100 compiled its 8192-token steps' kernels, the MXFP4 experts' grouped-GEMM
    path among them, while the first requests waited: the first pass at half the steady rate). Last, a group
    that overflows one step by a short tail (a chunked prompt's last tokens over its first part: MLA's split-K
    prefill);
(2) all at once, so prefill chunks share steps with decode rows;
(3) the same prompts again, all at once, so they hit the prefix cache (chunks shortened by a hit, KDA states
    restored from checkpoints: what a repeated system prompt meets).
Then it empties the prefix cache, so the warm-up leaves no blocks behind. The engine's counters (steps, graph steps,
hit tokens) include its steps. Images are not warmed here: the vision tower's kernels compile when the
runner captures its CUDA graphs (``model/encoder_graphs.py``, at engine start); under ``enforce_eager``
the first image compiles them.
"""

from __future__ import annotations

import logging
import random
import time

from kimik3.engine.core.llm_engine import LLMEngine
from kimik3.engine.sample.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def warmup_lengths(limit: int) -> list[int]:
    """Prompt lengths 2^k - 1, 2^k, 2^k + 1 and ``limit`` itself, all in [1, limit]."""
    out = {limit}
    p = 1
    while p <= limit:
        out.update(n for n in (p - 1, p, p + 1) if 1 <= n <= limit)
        p *= 2
    return sorted(out)


def _even(total: int, longest: int) -> list[int]:
    """``total`` tokens as few prompts of at most ``longest`` tokens as it takes, their lengths within one."""
    k = -(-total // longest)
    return [total // k + (i < total % k) for i in range(k)]


def step_groups(budget: int, longest: int, max_seqs: int) -> list[list[int]]:
    """Prompt lengths of the warm-up's groups: one group per step size in ``warmup_lengths`` up to the step
    budget (and to what ``max_seqs`` prompts of at most ``longest`` tokens can fill), each group's lengths
    summing to its size, as few prompts as that takes; then one group whose last prompt overflows a full step
    by a short tail, which the next step computes over that prompt's first part (a chunked prompt's tail: few
    queries over a long context, MLA's split-K prefill; the served K3 slice compiled its merge kernel in the
    first pass without it)."""
    limit = max(1, min(budget, longest * max_seqs))
    groups = [_even(n, longest) for n in warmup_lengths(limit)]
    tail = min(16, longest // 2)
    context = min(longest - tail, budget)
    fillers = _even(budget - context, longest) if budget > context else []
    if tail and len(fillers) < max_seqs:
        groups.append(fillers + [context + tail])
    return groups


def warm_up(engine: LLMEngine, seed: int = 0) -> float:
    """Run the warm-up requests to completion on an idle engine; returns the seconds it took."""
    if engine.has_unfinished_requests():
        raise RuntimeError("warm_up runs on an idle engine; it has unfinished requests")
    cfg = engine.config
    longest = max(1, min(cfg.max_num_batched_tokens, cfg.max_model_len - 2))
    pad = engine.model.config.media_placeholder_token_id
    rng = random.Random(seed)
    ids = [t for t in range(engine.vocab_size) if t != pad]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, detokenize=False)
    groups = step_groups(cfg.max_num_batched_tokens, longest, cfg.max_num_seqs)
    alone = [[rng.choices(ids, k=n) for n in g] for g in groups]
    together = [rng.choices(ids, k=n) for g in groups for n in g]        # (2) must not hit (1)
    t0 = time.perf_counter()
    rounds = alone + [together, together]      # (1) each size alone, (2) all at once, (3) again: hits
    for r, group in enumerate(rounds):
        for i, p in enumerate(group):
            engine.add_request(f"warmup-{r}-{i}", {"prompt_token_ids": p}, params)
        while engine.has_unfinished_requests():
            engine.step()
    engine.kv.reset_prefix_cache()
    seconds = time.perf_counter() - t0
    logger.info("warm-up: steps of 1..%d tokens (%d prompts of 1..%d tokens), alone, together and again, in %.1f s",
                min(cfg.max_num_batched_tokens, sum(groups[-1])), len(together), longest, seconds)
    return seconds
