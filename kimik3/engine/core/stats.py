"""vLLM's periodic stats line (``Avg prompt throughput ...``), shared by ``kimik3 serve`` (``serve/stats_log.py``)
and ``LLM(disable_log_stats=False)``: prompt and generation throughput over the interval, running and waiting
sequences, cache use and the prefix-cache hit rate (over the interval's lookups; over all when it had none)."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


def stats_line(prev: dict[str, float], now: dict[str, float]) -> str | None:
    """The line for the interval from ``prev`` to ``now`` (snapshots: ``time``, ``prompt_tokens``,
    ``generation_tokens``, ``running``, ``waiting``, ``cache_usage``, ``prefix_queried_tokens``,
    ``prefix_hit_tokens``, ``prefix_hit_rate``), or None when idle."""
    dt = max(now["time"] - prev["time"], 1e-9)
    prompt = now["prompt_tokens"] - prev["prompt_tokens"]
    gen = now["generation_tokens"] - prev["generation_tokens"]
    if not (prompt or gen or now["running"] or now["waiting"]):
        return None
    queried = now["prefix_queried_tokens"] - prev["prefix_queried_tokens"]
    hits = now["prefix_hit_tokens"] - prev["prefix_hit_tokens"]
    hit_rate = hits / queried if queried else now["prefix_hit_rate"]
    return (f"Avg prompt throughput: {prompt / dt:.1f} tokens/s, Avg generation throughput: {gen / dt:.1f} tokens/s, "
            f"Running: {now['running']:.0f} reqs, Waiting: {now['waiting']:.0f} reqs, "
            f"KV cache usage: {100 * now['cache_usage']:.1f}%, Prefix cache hit rate: {100 * hit_rate:.1f}%")


def engine_snapshot(engine, prompt_tokens: int, generation_tokens: int) -> dict[str, float]:
    s = engine.stats()
    return {"time": time.monotonic(), "prompt_tokens": float(prompt_tokens),
            "generation_tokens": float(generation_tokens), "running": float(s.num_running),
            "waiting": float(s.num_waiting), "cache_usage": s.cache_usage,
            "prefix_queried_tokens": float(s.num_queried_tokens), "prefix_hit_tokens": float(s.num_hit_tokens),
            "prefix_hit_rate": s.prefix_hit_rate}


class StatsLog:
    """``LLM.generate``'s stats line: ``tick`` after each step logs one every ``interval`` seconds."""

    def __init__(self, engine, interval: float = 10.0):
        self.engine = engine
        self.interval = interval
        self.prev = engine_snapshot(engine, 0, 0)

    def tick(self, prompt_tokens: int, generation_tokens: int, force: bool = False) -> None:
        if not force and time.monotonic() - self.prev["time"] < self.interval:
            return
        now = engine_snapshot(self.engine, prompt_tokens, generation_tokens)
        line = stats_line(self.prev, now)
        if line is not None:
            logger.info(line)
        self.prev = now
