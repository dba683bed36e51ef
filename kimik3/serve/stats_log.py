"""The periodic stats line of ``kimik3 serve`` (vLLM's ``Avg prompt throughput ...`` log): every
``interval`` seconds while there is work or there was since the last line, one INFO line with the prompt
and generation throughput over the interval (tokens/s), running and waiting sequences, cache use and
the prefix-cache hit rate (over the interval's lookups; over all of them when the interval had none).
``--disable-log-stats`` turns it off. It reads the engine loop's snapshot, so it costs the engine nothing."""

from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger(__name__)


def stats_line(prev: dict[str, float], now: dict[str, float]) -> str | None:
    """The line for the interval from ``prev`` to ``now`` (engine-loop snapshots), or None when idle."""
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


async def log_stats(loop, interval: float) -> None:
    """Log ``stats_line`` every ``interval`` seconds until cancelled (``loop``: the EngineLoop)."""
    prev = dict(loop.snapshot)
    while True:
        await asyncio.sleep(interval)
        now = dict(loop.snapshot)
        line = stats_line(prev, now)
        if line is not None:
            logger.info(line)
        prev = now
