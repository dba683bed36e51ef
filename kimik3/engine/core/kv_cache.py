"""Hybrid cache manager: who holds which latent blocks and KDA state slots, and the prefix cache.

Prefix caching for the hybrid model (spec token-mixers §3.3): reusing a prefix needs its MLA latents (the
cached blocks) *and* the KDA state right after it. States are kept only every ``checkpoint_interval`` blocks,
snapshotted by the model when a step crosses or ends on such a boundary (``StateCheckpoint``), so a hit is
clamped to the last matched boundary with a checkpoint; it never covers the whole sequence (at least one token
is computed, so the step yields logits). Evicting a block drops its checkpoint.

Answers are "fits or None": nothing is changed when a request does not fit.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

from kimik3.engine.core.block_pool import BlockPool, BlockTable
from kimik3.engine.core.memory import MemoryPlan
from kimik3.engine.core.request import CacheHoldings, Request
from kimik3.ops import ceil_div


@dataclass(frozen=True)
class Admission:
    num_hit_tokens: int          # tokens reused from the prefix cache (a multiple of the block size)
    restore_from: int | None     # checkpoint slot to copy into the request's live slot, None = zero state


class KVCacheManager:
    def __init__(self, plan: MemoryPlan, enable_prefix_caching: bool):
        self.plan = plan
        self.block_size = plan.block_size
        self.interval = plan.checkpoint_interval if enable_prefix_caching else None
        self.enable_prefix_caching = enable_prefix_caching and self.interval is not None
        self.blocks = BlockPool(plan.num_blocks, on_evict=self._drop_checkpoint)
        first_spec = 1 + plan.num_live_slots           # MemoryPlan's slot layout; each list pops its lowest first
        first_ckpt = first_spec + plan.num_spec_slots
        # live slots: a heap, the lowest free slot given first, so requests admitted together hold consecutive
        # ascending slots whatever order earlier ones finished in (a CPU decode step then updates their KDA states
        # and conv windows in place: ``ops/pool_rows.slot_range``)
        self.free_live_slots = list(range(1, first_spec))
        self.free_spec_slots = list(reversed(range(first_spec, first_ckpt)))
        self.free_checkpoint_slots = list(reversed(range(first_ckpt, plan.num_slots)))
        self.checkpoints: OrderedDict[bytes, int] = OrderedDict()   # block hash -> slot, LRU first
        self.num_hit_tokens = self.num_queried_tokens = 0      # prompt tokens found in / looked up in the prefix cache

    # ---- prefix cache ----------------------------------------------------------------
    def _match(self, req: Request) -> tuple[int, list[int]]:
        """Longest usable cached prefix of ``req``: (blocks, their ids), clamped to a checkpoint."""
        if not self.enable_prefix_caching or (req.params.prompt_logprobs is not None
                                              and len(req.out.prompt_logprobs) < req.num_prompt_tokens):
            return 0, []    # prompt logprobs need the logits of every prompt position
        matched: list[int] = []
        for h in req.block_hashes[:(req.num_tokens - 1) // self.block_size]:
            if (block := self.blocks.lookup(h)) is None:
                break
            matched.append(block)
        n = len(matched) - len(matched) % self.interval
        while n > 0 and req.block_hashes[n - 1] not in self.checkpoints:
            n -= self.interval
        return n, matched[:n]

    def cache_blocks(self, req: Request) -> None:
        """Register the request's full computed blocks (called after the step that computed them)."""
        if not self.enable_prefix_caching:
            return
        held = req.cache
        full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        for i in range(held.num_cached_blocks, full):
            self.blocks.cache(held.block_ids[i], req.block_hashes[i])
        held.num_cached_blocks = max(held.num_cached_blocks, full)

    def next_checkpoint(self, pos: int) -> int | None:
        """The first token count after ``pos`` at which a checkpoint is taken (None: prefix caching off)."""
        step = self.interval * self.block_size if self.enable_prefix_caching else 0
        return (pos // step + 1) * step if step else None

    def checkpoint_boundaries(self, start: int, end: int) -> list[int]:
        """Block indices j (boundary at j*block_size tokens) in (start, end] that take a checkpoint."""
        first = self.next_checkpoint(start)
        if first is None or first > end:      # the common case (a decode step between boundaries)
            return []
        return [p // self.block_size for p in range(first, end + 1, self.interval * self.block_size)]

    def take_checkpoint_slot(self, h: bytes) -> int | None:
        """A slot to snapshot the state after block hash ``h`` into; None if it is already kept."""
        if h in self.checkpoints:
            self.checkpoints.move_to_end(h)
            return None
        if self.free_checkpoint_slots:
            return self.free_checkpoint_slots.pop()
        return self.checkpoints.popitem(last=False)[1] if self.checkpoints else None    # evict the LRU snapshot

    def return_checkpoint_slots(self, slots) -> None:
        """Give back slots taken for a step that did not run (the model raised)."""
        self.free_checkpoint_slots.extend(slots)

    def commit_checkpoint(self, h: bytes, slot: int) -> None:
        """The step ran: keep the snapshot if its block is cached and no other snapshot won."""
        if h in self.checkpoints or self.blocks.lookup(h) is None:
            self.free_checkpoint_slots.append(slot)
        else:
            self.checkpoints[h] = slot

    def _drop_checkpoint(self, h: bytes) -> None:
        slot = self.checkpoints.pop(h, None)
        if slot is not None:
            self.free_checkpoint_slots.append(slot)

    # ---- allocation ------------------------------------------------------------------
    def admit(self, req: Request, num_new_tokens: int) -> Admission | None:
        """Give a waiting request a state slot and blocks for its first ``num_new_tokens`` tokens
        after any prefix hit (``num_new_tokens`` is capped so at least one token is computed)."""
        held = req.cache
        assert req.num_computed_tokens == 0 and not held.block_ids and held.state_slot == 0
        if not self.free_live_slots:
            return None
        n_hit, hit_blocks = self._match(req)
        hit_tokens = n_hit * self.block_size
        num_new_tokens = min(num_new_tokens, req.num_tokens - hit_tokens)
        need = ceil_div(hit_tokens + num_new_tokens, self.block_size) - n_hit
        reclaim = sum(1 for b in hit_blocks if self.blocks.ref_counts[b] == 0)
        if need > self.blocks.num_free - reclaim:
            return None
        for b in hit_blocks:
            self.blocks.take(b)
        held.block_ids = BlockTable(hit_blocks + [self.blocks.allocate() for _ in range(need)])
        held.state_slot = heapq.heappop(self.free_live_slots)
        held.num_cached_blocks = n_hit
        req.num_computed_tokens = hit_tokens
        restore = None
        if n_hit:
            h = req.block_hashes[n_hit - 1]
            self.checkpoints.move_to_end(h)
            restore = self.checkpoints[h]
        self.num_queried_tokens += req.num_tokens
        self.num_hit_tokens += hit_tokens
        return Admission(hit_tokens, restore)

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Grow a running request's block table to hold ``num_new_tokens`` more tokens; False if no room."""
        held = req.cache
        need = max(0, ceil_div(req.num_computed_tokens + num_new_tokens, self.block_size) - len(held.block_ids))
        if need > self.blocks.num_free:
            return False
        held.block_ids.extend(self.blocks.allocate() for _ in range(need))
        return True

    def take_spec_slots(self, n: int) -> list[int]:
        """Up to ``n`` speculative snapshot slots (fewer when the pool runs short)."""
        return [self.free_spec_slots.pop() for _ in range(min(n, len(self.free_spec_slots)))]

    def return_spec_slots(self, slots) -> None:
        self.free_spec_slots.extend(slots)

    def keep_rollback(self, req: Request, slot: int) -> None:
        """Hold snapshot ``slot`` (the state after the last accepted draft) for ``req``'s next step."""
        req.cache.rollback_slot = slot

    def take_rollback(self, req: Request, state_copies: list[tuple[int, int]]) -> None:
        """Append ``req``'s pending rollback to a step's state copies as (snapshot slot, live slot), its
        snapshot slot given back (the copy runs before the step, ahead of any write to the slot)."""
        held = req.cache
        if held.rollback_slot is not None:
            state_copies.append((held.rollback_slot, held.state_slot))
            self.return_spec_slots([held.rollback_slot])
            held.rollback_slot = None

    def free(self, req: Request) -> None:
        """Return everything the request holds (its cached blocks stay reusable until evicted)."""
        held = req.cache
        if held.rollback_slot is not None:        # a speculative rollback that will not run
            self.return_spec_slots([held.rollback_slot])
        if held.state_slot:
            heapq.heappush(self.free_live_slots, held.state_slot)
        self.blocks.release(held.block_ids)
        req.cache = CacheHoldings()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block and checkpoint; only possible (True) when no block is held."""
        if self.blocks.num_free != self.plan.num_usable_blocks:
            return False
        for h in list(self.checkpoints):
            self._drop_checkpoint(h)
        self.blocks.cached.clear()
        self.blocks.block_hashes = [None] * self.blocks.num_blocks
        return True
