"""The draft model's device work of one step (``DraftWork``, planned on the host by ``draft_model.ModelDrafter``):
catch its cache up with the target's positions, then draft for the requests that draft or watch.

1. Catch-up: the draft's cache rows of the positions the target computed and kept (every prompt row; in a verify
   chunk the input row and the accepted drafts): the row at position p reads the target's states at p and token
   p + 1 (Eagle3, MTP; keys/values or latents only, ``write``: no attention, no LM head) or the states alone
   (DFlash's context).
2. Heads: for each request that drafts (``depths``, longest first) its last caught-up row attends and gives draft
   1 (Eagle3 / MTP); draft j + 1 comes from a row at position P + j - 1 that reads draft j and the draft's own
   feature of the row before (positions past the request's blocks go to the scratch blocks in ``tables``).
   DFlash drafts a request's block in one forward. Drafts are the draft's greedy tokens in the target's vocabulary.

The executor holds no request state: a rank given the same work and the same target states computes the same
tokens (tensor parallelism: every rank runs it on its shard of the draft, ``parallel/worker.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kimik3.model.batch import ForwardBatch
from kimik3.model.dflash import DFlashDraft
from kimik3.model.draft_attention import DraftBatch
from kimik3.model.mtp import MTPDraft


def draft_cache_shape(draft, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """The draft's paged cache: [num_blocks, block_size, 2, KVH, hd] (Eagle3's one layer; DFlash per layer,
    MTP per layer [.., D_c]); KVH: this rank's key/value heads."""
    if isinstance(draft, MTPDraft):
        return (draft.num_layers, num_blocks, block_size, draft.cfg.mla_cache_dim)
    heads, hd = draft.layers[0].self_attn.num_kv_heads, draft.cfg.head_dim
    if isinstance(draft, DFlashDraft):
        return (draft.cfg.num_hidden_layers, num_blocks, block_size, 2, heads, hd)
    return (num_blocks, block_size, 2, heads, hd)


@dataclass
class DraftWork:
    """One step's draft work, host lists only (it travels to tensor-parallel workers as it is)."""

    rows: list[int]              # packed rows of the target's step whose states are caught up
    next_ids: list[int]          # the token after each of those rows' positions
    positions: list[int]
    slots: list[int]             # the draft cache row of each position (the target's block table)
    heads: list[int]             # index into ``rows``: each drafting request's last caught-up row, longest first
    depths: list[int]            # drafts to compute per head (>= 1), non-increasing
    tables: list[list[int]]      # each head's block table, extended by scratch blocks for its drafts

    @property
    def num_forwards(self) -> int:
        """Forwards that attend (``record_draft``'s count): one per draft position (DFlash: one)."""
        return max(self.depths, default=0)

    @property
    def forward_rows(self) -> int:
        return sum(self.depths)


class DraftExecutor:
    """Runs ``DraftWork`` on ``draft`` over its own paged ``cache`` (module docstring)."""

    def __init__(self, draft, cache: torch.Tensor, block_size: int):
        self.draft, self.cache, self.block_size = draft, cache, block_size
        self.device = cache.device
        self.graphs = None          # ``draft_graphs.DraftGraphs``: its steps replay where one fits, else eager

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    @torch.inference_mode()
    def run(self, work: DraftWork, states: torch.Tensor) -> list[list[int]]:
        """The drafts of each head (``work.depths[i]`` tokens each); ``states``: the target step's auxiliary
        states of every packed row [T, n * D]."""
        if self.graphs is not None:
            drafts = self.graphs.run(work, states)
            if drafts is not None:
                return drafts
        feats = states[self._long(work.rows).to(states.device)]
        positions = self._long(work.positions)
        max_pos = max(work.positions, default=0)
        slots = self._long(work.slots)
        draft = self.draft
        if isinstance(draft, DFlashDraft):
            draft.write_context([feats], positions, slots, self.cache)
            return self._dflash(work) if work.heads else []
        ids = self._long(work.next_ids)
        if isinstance(draft, MTPDraft):
            draft.layer(0).write(ids, feats, positions, slots, self.cache[0])
        else:
            feats = draft.combine([feats])
            draft.write(ids, feats, positions, slots, self.cache, max_pos)
        if not work.heads:
            return []
        heads = self._long(work.heads)
        start = [work.positions[h] for h in work.heads]
        logits, hidden = self._forward(0, ids[heads], feats[heads], start, work.tables)
        tokens = [self._greedy(logits)]
        for j in range(1, work.depths[0]):
            n = sum(d > j for d in work.depths)                 # heads are sorted by depth: a prefix drafts on
            pos = [p + j for p in start[:n]]
            logits, hidden = self._forward(j, tokens[-1][:n], hidden[:n], pos, work.tables[:n])
            tokens.append(self._greedy(logits))
        flat = torch.cat(tokens).tolist()
        out, offsets = [[] for _ in work.heads], [0]
        for t in tokens:
            offsets.append(offsets[-1] + t.shape[0])
        for j in range(len(tokens)):
            for i in range(offsets[j + 1] - offsets[j]):
                out[i].append(flat[offsets[j] + i])
        return out

    def _forward(self, step: int, ids: torch.Tensor, hidden: torch.Tensor, pos: list[int], tables: list[list[int]]):
        """One attending forward of one row per head at ``pos`` (its context: the positions before it)."""
        n = len(pos)
        if isinstance(self.draft, MTPDraft):
            batch = ForwardBatch.build([1] * n, pos, [0] * n, tables, self.block_size, self.device)
            return self.draft(step, ids, hidden, self._long(pos), batch, self.cache)
        return self.draft(ids, hidden, DraftBatch.build([1] * n, pos, tables, self.block_size, None, self.device),
                          self.cache)

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        return self.draft.greedy(logits) if hasattr(self.draft, "greedy") else logits.argmax(-1)

    def _dflash(self, work: DraftWork) -> list[list[int]]:
        """One block forward per head: anchored at the token after its last caught-up row."""
        B = self.draft.cfg.block_size
        P = [work.positions[h] + 1 for h in work.heads]
        block = DraftBatch.build([B] * len(P), P, work.tables, self.block_size, None, self.device, causal=False,
                                 write=False)
        anchors = self._long([work.next_ids[h] for h in work.heads])
        drafts = self._greedy(self.draft(anchors, block, self.cache)).tolist()
        return [d[:n] for d, n in zip(drafts, work.depths)]
