"""Memory planner: split one byte budget between the two cache pools of the hybrid model.

* KDA state pool (fixed size per sequence, every KDA layer): slot 0 is the null slot, then one live slot per
  running sequence (``max_num_seqs``), then ``num_speculative_tokens`` snapshot slots per running sequence
  when speculative decoding is on, then prefix-cache checkpoint slots.
* MLA latent cache (grows with length): block 0 is the null block, then ``num_blocks - 1`` usable blocks.

With prefix caching, a checkpoint is kept every ``checkpoint_interval`` blocks, so each usable block costs
``bytes_per_block + bytes_per_slot / checkpoint_interval`` and every cached boundary can keep its state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kimik3.model.batch import HybridCache
from kimik3.ops import ceil_div


@dataclass(frozen=True)
class MemoryPlan:
    block_size: int
    num_blocks: int                 # MLA latent-cache blocks, null block 0 included
    num_slots: int                  # KDA state-pool slots: null + live + speculative + checkpoint
    num_live_slots: int             # = max_num_seqs, slots 1..num_live_slots
    num_checkpoint_slots: int       # the last slots, after the live and speculative ones
    checkpoint_interval: int | None # blocks between KDA checkpoints; None = prefix caching off
    bytes_per_block: int
    bytes_per_slot: int
    budget_bytes: int
    num_spec_slots: int = 0         # speculative-decoding snapshots: slots num_live_slots+1 .. +num_spec_slots

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def max_cached_tokens(self) -> int:
        """Latent-cache tokens all running sequences can hold together."""
        return self.num_usable_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block + self.num_slots * self.bytes_per_slot

    def sequences_of(self, length: int) -> int:
        """How many sequences of ``length`` tokens the plan holds at once (latent blocks and live states)."""
        return min(self.num_usable_blocks // max_blocks_per_seq(length, self.block_size), self.num_live_slots)

    def describe(self) -> str:
        gib = 1 << 30
        ck = (f"{self.num_checkpoint_slots} KDA checkpoints (one per {self.checkpoint_interval} blocks)"
              if self.checkpoint_interval else "no KDA checkpoints (prefix caching off)")
        spec = f"{self.num_spec_slots} speculative snapshots, " if self.num_spec_slots else ""
        return (f"cache plan: {self.total_bytes / gib:.3f} of {self.budget_bytes / gib:.3f} GiB -> "
                f"{self.max_cached_tokens} latent tokens ({self.num_usable_blocks} blocks x {self.block_size}), "
                f"{self.num_live_slots} sequence states, {spec}{ck}; "
                f"{self.bytes_per_block} B/block, {self.bytes_per_slot} B/state")


def plan_memory(text_config, budget_bytes: int, block_size: int, max_num_seqs: int,
                checkpoint_interval: int | None, dtype: torch.dtype, num_spec_slots: int = 0,
                latent_dtype: torch.dtype | None = None) -> MemoryPlan:
    """Size both pools from ``budget_bytes``; ``checkpoint_interval=None`` plans no checkpoint slots;
    ``latent_dtype``: the MLA latent rows' dtype (None: ``dtype``; FP8 rows carry a float32 scale).
    Raises ValueError when the budget cannot hold the live states plus one usable block."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if checkpoint_interval is not None and checkpoint_interval < 1:
        raise ValueError(f"kda_checkpoint_interval must be >= 1 (or None to plan no checkpoints), "
                         f"got {checkpoint_interval}")
    per_slot = HybridCache.bytes_per_slot(text_config, dtype)
    per_block = HybridCache.bytes_per_block(text_config, block_size, dtype, latent_dtype)
    interval, per_ckpt = (checkpoint_interval, per_slot) if checkpoint_interval else (1, 0)
    fixed = (1 + max_num_seqs + num_spec_slots) * per_slot + per_block   # null, live and snapshot slots, null block
    left = max(budget_bytes - fixed, 0)
    # A unit is ``interval`` usable blocks and their checkpoint slot; the leftover still buys plain blocks.
    per_unit = max(per_block * interval + per_ckpt, 1)   # (1: a model without MLA layers has free blocks)
    units = left // per_unit
    num_blocks = units * interval + (left - units * per_unit) // max(per_block, 1)
    num_ckpt = units if checkpoint_interval else 0
    if num_blocks < 1:
        need = fixed + per_block + per_ckpt
        raise ValueError(
            f"cache_memory_bytes={budget_bytes} cannot hold {max_num_seqs} sequence states "
            + (f"and {num_spec_slots} speculative snapshots " if num_spec_slots else "") +
            f"({per_slot} B each, plus the null slot) and one {block_size}-token latent block ({per_block} B); "
            f"give at least {need} bytes or lower max_num_seqs")
    return MemoryPlan(block_size=block_size, num_blocks=1 + num_blocks, num_live_slots=max_num_seqs,
                      num_slots=1 + max_num_seqs + num_spec_slots + num_ckpt, num_checkpoint_slots=num_ckpt,
                      checkpoint_interval=checkpoint_interval, bytes_per_block=per_block, bytes_per_slot=per_slot,
                      budget_bytes=budget_bytes, num_spec_slots=num_spec_slots)


def max_blocks_per_seq(max_model_len: int, block_size: int) -> int:
    return ceil_div(max_model_len, block_size)
