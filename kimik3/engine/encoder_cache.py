"""Image embeddings by content hash: a bounded LRU, so a repeated image or a recomputed request
(after preemption) is not encoded again.

The bound counts embedding rows (image tokens), like the token budget of the text cache. An item
larger than the whole bound is used by its request but not kept.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()   # hash -> [N, D], LRU first
        self.num_tokens = 0
        self.num_hits = 0
        self.num_misses = 0

    def get(self, h: bytes) -> torch.Tensor | None:
        embeds = self.entries.get(h)
        if embeds is None:
            self.num_misses += 1
            return None
        self.entries.move_to_end(h)
        self.num_hits += 1
        return embeds

    def put(self, h: bytes, embeds: torch.Tensor) -> None:
        n = embeds.shape[0]
        if n > self.max_tokens or h in self.entries:
            return
        while self.num_tokens + n > self.max_tokens:
            _, old = self.entries.popitem(last=False)
            self.num_tokens -= old.shape[0]
        self.entries[h] = embeds
        self.num_tokens += n

    def clear(self) -> None:
        self.entries.clear()
        self.num_tokens = 0
