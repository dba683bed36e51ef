"""MLA latent-cache blocks: reference counts, the prefix cache of full blocks, LRU reuse.

A block is either referenced (ref count > 0, held by running requests) or free. Free blocks wait in
LRU order; a free block that still holds a cached full block keeps its hash until it is reused, so
a later request with the same prefix can take it back. Block 0 is the null block and never handed out.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Callable, Iterable


class BlockTable(array):
    """A request's MLA block ids, a growing int32 array: a decode step copies it into the graph's input (a memcpy
    through the buffer protocol). Equals a list of its ids; it cannot grow while a numpy view of it lives."""

    def __new__(cls, ids: Iterable[int] = ()):
        return super().__new__(cls, "i", ids)

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def __ne__(self, other) -> bool:
        return not self == other

    def __repr__(self) -> str:
        return f"BlockTable({self.tolist()})"


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[bytes], None] = lambda h: None):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.cached: dict[bytes, int] = {}      # hash of a full block (its whole prefix) -> block id
        self.on_evict = on_evict                # told when a cached hash disappears

    @property
    def num_free(self) -> int:
        return len(self.free)

    def lookup(self, h: bytes) -> int | None:
        return self.cached.get(h)

    def allocate(self) -> int:
        """Take the least recently freed block (evicting what it cached). Caller checks ``num_free``."""
        block, _ = self.free.popitem(last=False)
        h = self.block_hashes[block]
        if h is not None:
            self.block_hashes[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]
                self.on_evict(h)
        self.ref_counts[block] = 1
        return block

    def take(self, block: int) -> None:
        """Share a cached block (prefix hit)."""
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; tail blocks are freed first so they are evicted first."""
        for block in blocks[::-1]:
            assert self.ref_counts[block] > 0, f"block {block} released more often than taken"
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None

    def cache(self, block: int, h: bytes) -> None:
        """Register a full, computed block under its hash (the first block with a hash keeps it)."""
        if h not in self.cached and self.block_hashes[block] is None:
            self.cached[h] = block
            self.block_hashes[block] = h
