"""Warm-up: run the kinds of step that serving will hit once, before the first request.

On a GPU the first step of a new kind compiles Triton kernels (and autotunes fla's): a prefill
length in a new class (Triton specialises integer arguments on == 1 and on divisibility by 16,
and some tiles on the next power of two of the rows), a mixed step with decode rows beside a
chunk, a longer context's split count. Without a warm-up those compiles (seconds each) land on
the first requests' time to first token. ``warm_up`` runs three rounds of prompts of lengths 2^k - 1,
2^k and 2^k + 1 up to one step's token budget, each decoding two tokens: (1) one prompt at a time, so a
step holds exactly each of those token counts (the step-size classes: serving's steps take any size,
and the kernels specialise on the step's rows); (2) all at once, so prefill chunks share steps with
decode rows; (3) the same prompts again, all at once, so they hit the prefix cache (chunks shortened
by a hit, KDA states restored from checkpoints: what a repeated system prompt meets). Then it empties
the prefix cache, so the warm-up leaves no blocks behind. The engine's counters (steps, graph steps,
hit tokens) include its steps. Images are not warmed here: the vision tower's kernels compile when the
runner captures its CUDA graphs (``model/encoder_graphs.py``, at engine start); under ``enforce_eager``
the first image compiles them.
"""

from __future__ import annotations

import logging
import random
import time

from kimik3.engine.llm_engine import LLMEngine
from kimik3.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def warmup_lengths(limit: int) -> list[int]:
    """Prompt lengths 2^k - 1, 2^k, 2^k + 1 and ``limit`` itself, all in [1, limit]."""
    out = {limit}
    p = 1
    while p <= limit:
        out.update(n for n in (p - 1, p, p + 1) if 1 <= n <= limit)
        p *= 2
    return sorted(out)


def warm_up(engine: LLMEngine, seed: int = 0) -> float:
    """Run the warm-up requests to completion on an idle engine; returns the seconds it took."""
    if engine.has_unfinished_requests():
        raise RuntimeError("warm_up runs on an idle engine; it has unfinished requests")
    cfg = engine.config
    limit = max(1, min(cfg.max_num_batched_tokens, cfg.max_model_len - 2))
    pad = engine.model.config.media_placeholder_token_id
    rng = random.Random(seed)
    ids = [t for t in range(engine.vocab_size) if t != pad]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, detokenize=False)
    lengths = warmup_lengths(limit)
    alone, together = ([rng.choices(ids, k=n) for n in lengths] for _ in range(2))   # (2) must not hit (1)
    t0 = time.perf_counter()
    rounds = [[p] for p in alone] + [together, together]      # (1) each alone, (2) all at once, (3) again: hits
    for r, group in enumerate(rounds):
        for i, p in enumerate(group):
            engine.add_request(f"warmup-{r}-{i}", {"prompt_token_ids": p}, params)
        while engine.has_unfinished_requests():
            engine.step()
    engine.kv.reset_prefix_cache()
    seconds = time.perf_counter() - t0
    logger.info("warm-up: %d prompts of 1..%d tokens, alone, together and again, in %.1f s", len(lengths), limit,
                seconds)
    return seconds
