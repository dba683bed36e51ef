"""The periodic stats line of ``kimik3 serve`` (vLLM's ``Avg prompt throughput ...`` log): every
``interval`` seconds while there is work or there was since the last line, one INFO line with the prompt
and generation throughput over the interval (tokens/s), running and waiting sequences, cache use and
the prefix-cache hit rate (over the interval's lookups; over all of them when the interval had none).
``--disable-log-stats`` turns it off. It reads the engine loop's snapshot, so it costs the engine nothing.
The line itself is ``kimik3.engine.core.stats.stats_line`` (``LLM(disable_log_stats=False)`` logs it too)."""

from __future__ import annotations

import asyncio
import logging

from kimik3.engine.core.stats import stats_line

__all__ = ["log_stats", "stats_line"]

logger = logging.getLogger(__name__)


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
