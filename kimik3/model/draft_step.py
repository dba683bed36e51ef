"""The draft model's device work of one step (``DraftWork``, planned on the host by ``draft_model.ModelDrafter``):
catch its cache up with the target's positions, then draft for the requests that draft or watch.

1. Catch-up: the draft's cache rows of the positions the target computed and kept (every prompt row; in a verify
   chunk the input row and the accepted drafts): the row at position p reads the target's states at p and token
   p + 1 (Eagle3, MTP; keys/values or latents only, ``write``: no attention, no LM head) or the states alone
   (DFlash's context). MTP with a KDA first layer advances each sequence's state over its rows in order
   (``_recurrent_catch_up``); a KDA layer past the first sees only its own chain's rows (a zero state each chain).
2. Heads: for each request that drafts (``depths``, longest first) its last caught-up row attends and gives draft
   1 (Eagle3 / MTP); draft j + 1 comes from a row at position P + j - 1 that reads draft j and the draft's own
   feature of the row before (positions past the request's blocks go to the scratch blocks in ``tables``).
   DFlash drafts a request's block in one forward. Drafts are the draft's greedy tokens in the target's vocabulary.

The executor holds no request state: a rank given the same work and the same target states computes the same
tokens (tensor parallelism: every rank runs it on its shard of the draft, ``parallel/worker.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from kimik3.model.batch import ForwardBatch, StateCheckpoint
from kimik3.model.dflash import DFlashDraft
from kimik3.model.draft_attention import DraftBatch
from kimik3.model.mtp import MTPDraft


def draft_cache_shape(draft, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """The draft's paged cache per block: [num_blocks, block_size, 2, KVH, hd] (Eagle3's one layer; DFlash per
    layer, MTP's MLA layers [.., D_c]); KVH: this rank's key/value heads."""
    if isinstance(draft, MTPDraft):
        return (draft.num_layers - len(draft.kda_layer_ids), num_blocks, block_size, draft.cfg.mla_cache_dim)
    heads, hd = draft.layers[0].self_attn.num_kv_heads, draft.cfg.head_dim
    if isinstance(draft, DFlashDraft):
        return (draft.cfg.num_hidden_layers, num_blocks, block_size, 2, heads, hd)
    return (num_blocks, block_size, 2, heads, hd)


def allocate_draft_cache(draft, num_blocks: int, block_size: int, num_slots: int):
    """The draft's cache: a paged key/value tensor (Eagle3, DFlash), or MTP's ``HybridCache`` (its MLA layers'
    latents by block, its KDA layers' states by slot: ``num_slots``, the target's and one scratch slot per
    sequence that drafts)."""
    p = next(draft.parameters())
    if isinstance(draft, MTPDraft):
        return draft.allocate_cache(num_slots, num_blocks, block_size, p.dtype, p.device)
    return torch.zeros(draft_cache_shape(draft, num_blocks, block_size), dtype=p.dtype, device=p.device)


def draft_state_bytes(draft) -> int:
    """Bytes of the draft's recurrent state per state slot (MTP's KDA layers, and a KDA first layer's pending row
    of a checkpoint: ``DraftExecutor.pending``; 0 for a draft without)."""
    if not isinstance(draft, MTPDraft) or not draft.kda_layer_ids:
        return 0
    p = next(draft.parameters())
    pending = draft.cfg.hidden_size * p.element_size() if draft.layer(0).is_kda else 0
    return cache_nbytes(draft.allocate_cache(1, 0, 1, p.dtype, "meta")) + pending


def cache_nbytes(cache) -> int:
    """Bytes of a draft cache (a tensor, or MTP's ``HybridCache``)."""
    if isinstance(cache, torch.Tensor):
        return cache.numel() * cache.element_size()
    return sum(t.numel() * t.element_size() for t in (cache.kda_conv, cache.kda_state, cache.mla_latent))


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
    # An MTP draft whose first layer is recurrent (KDA) advances each sequence's state over its rows in order
    # (``DraftExecutor._recurrent_catch_up``); the slots are the draft's (``ModelDrafter._slot``):
    seq_lens: list[int] = field(default_factory=list)        # caught-up rows per sequence, in ``rows`` order
    seq_tables: list[list[int]] = field(default_factory=list)
    seq_slots: list[int] = field(default_factory=list)       # each sequence's state slot
    head_seqs: list[int] = field(default_factory=list)       # the sequence of each head
    scratch_slots: list[int] = field(default_factory=list)   # a state slot per head for its drafts' rows
    state_copies: list[tuple[int, int]] = field(default_factory=list)   # the target step's restores (no rollbacks)
    state_resets: list[int] = field(default_factory=list)
    checkpoints: list[tuple[int, int, int]] = field(default_factory=list)   # (sequence, rows, slot): prefix ones
    resumed: list[tuple[int, int]] = field(default_factory=list)   # (sequence, its first token): restored from one

    @property
    def num_forwards(self) -> int:
        """Forwards that attend (``record_draft``'s count): one per draft position (DFlash: one)."""
        return max(self.depths, default=0)

    @property
    def forward_rows(self) -> int:
        return sum(self.depths)


class DraftExecutor:
    """Runs ``DraftWork`` on ``draft`` over its own ``cache`` (module docstring): a paged key/value tensor, or MTP's
    ``HybridCache`` (``MTPDraft.allocate_cache``)."""

    def __init__(self, draft, cache, block_size: int):
        self.draft, self.cache, self.block_size = draft, cache, block_size
        self.device = next(draft.parameters()).device
        self.graphs = None          # ``draft_graphs.DraftGraphs``: its steps replay where one fits, else eager
        # MTP with a KDA first layer: per state slot, the target's state of a prefix checkpoint's last row (its
        # row waits for the token after the prefix: ``_recurrent_catch_up``), allocated at first use
        self.recurrent = isinstance(draft, MTPDraft) and draft.layer(0).is_kda
        self.pending: torch.Tensor | None = None

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def launch(self, work: DraftWork, states: torch.Tensor):
        """``run`` begun: (a function that returns its drafts, the device tensor that holds them [k, N] or None). The
        draft's graphs queue their replays and the drafts' copy to the host and return at once (the host goes on
        while the device drafts; draft j of head i at [j, i]); else ``run`` drafts now (None)."""
        collect = self._replayed(work, states)
        if collect is not None:
            return collect, self.graphs.tokens
        drafts = self.run(work, states)          # (an instance's ``run`` may be wrapped: tensor parallelism)
        return (lambda: drafts), None

    @torch.inference_mode()
    def run(self, work: DraftWork, states: torch.Tensor) -> list[list[int]]:
        """The drafts of each head (``work.depths[i]`` tokens each); ``states``: the target step's auxiliary
        states of every packed row [T, n * D]."""
        collect = self._replayed(work, states)
        if collect is not None:
            return collect()
        feats = states[self._long(work.rows).to(states.device)]
        positions = self._long(work.positions)
        max_pos = max(work.positions, default=0)
        slots = self._long(work.slots)
        draft = self.draft
        if isinstance(draft, DFlashDraft):
            draft.write_context([feats], positions, slots, self.cache)
            return self._dflash(work) if work.heads else []
        ids = self._long(work.next_ids)
        if self.recurrent:
            self._recurrent_catch_up(work, feats)
        elif isinstance(draft, MTPDraft):
            draft.layer(0).write(ids, feats, positions, slots, None, self.cache)
        else:
            feats = draft.combine([feats])
            draft.write(ids, feats, positions, slots, self.cache, max_pos)
        if not work.heads:
            return []
        heads = self._long(work.heads)
        start = [work.positions[h] for h in work.heads]
        live = [work.seq_slots[s] for s in work.head_seqs] if self.recurrent else None
        logits, hidden = self._forward(0, ids[heads], feats[heads], start, work.tables, live)
        tokens = [self.draft.greedy(logits)]
        if work.depths[0] > 1 and isinstance(draft, MTPDraft) and draft.kda_layer_ids:
            for h, scratch in enumerate(work.scratch_slots[:sum(d > 1 for d in work.depths)]):
                if live:            # the drafts' rows run on a copy of the live states
                    self.cache.copy_state(live[h], scratch)
                else:               # a KDA layer past the first sees its chain's rows alone
                    self.cache.reset_state(scratch)
        for j in range(1, work.depths[0]):
            n = sum(d > j for d in work.depths)                 # heads are sorted by depth: a prefix drafts on
            pos = [p + j for p in start[:n]]
            logits, hidden = self._forward(j, tokens[-1][:n], hidden[:n], pos, work.tables[:n], work.scratch_slots[:n])
            tokens.append(self.draft.greedy(logits))
        flat = torch.cat(tokens).tolist()
        out, offsets = [[] for _ in work.heads], [0]
        for t in tokens:
            offsets.append(offsets[-1] + t.shape[0])
        for j in range(len(tokens)):
            for i in range(offsets[j + 1] - offsets[j]):
                out[i].append(flat[offsets[j] + i])
        return out

    @torch.inference_mode()
    def _replayed(self, work: DraftWork, states: torch.Tensor):
        """``work`` queued on the draft's graphs (``DraftGraphs.launch``: a function that returns its drafts), or None
        (nothing done) where none fits. A KDA first layer's catch-up runs eagerly first where the graphs' rounds do not
        hold it (the target's state copies, prefix checkpoints, prompt rows: ``DraftGraphs.rounds_for``). The step's
        plan is worked out once (``DraftGraphs.step_plan``) and handed to ``launch``."""
        plan = None if self.graphs is None else self.graphs.step_plan(work, states)
        if plan is None:
            return None
        if self.recurrent and plan.rounds is None:
            self._recurrent_catch_up(work, states[self._long(work.rows).to(states.device)])
        return self.graphs.launch(work, states, plan)

    def _recurrent_catch_up(self, work: DraftWork, feats: torch.Tensor) -> None:
        """MTP whose layer 0 is KDA: its states follow the target's committed rows. The target step's restores and
        resets first; then layer 0 over each sequence's rows but a head's last (the head's forward computes it).
        The row at position p reads token p + 1, which a prefix's block hash does not cover: a prefix checkpoint
        after n tokens keeps the state after n - 1 rows and the target's state at n - 1 (``pending``), and a
        sequence restored from one replays that row with its own token n first (``work.resumed``)."""
        cache = self.cache
        if self.pending is None:
            self.pending = feats.new_zeros(cache.kda_state.shape[1], feats.shape[-1])
        pending = self.pending
        for src, dst in work.state_copies:
            pending[dst] = pending[src]
        cache.apply_state_ops(work.state_copies, work.state_resets)
        first = list(itertools.accumulate([0, *work.seq_lens]))
        resumed, heads = dict(work.resumed), set(work.head_seqs)
        for s, n, slot in work.checkpoints:
            pending[slot] = feats[first[s] + n - 1]
            if n == 1 and s not in resumed:                   # the state before the chunk's rows
                cache.copy_state(work.seq_slots[s], slot)
        rows, ids, pos, seqs, where = [], [], [], [], {}
        for s, n in enumerate(work.seq_lens):
            pre, m, p0 = int(s in resumed), n - (s in heads), work.positions[first[s]]
            if pre:
                rows.append(len(work.rows) + len(where))        # a row of ``pending`` (below)
                ids.append(resumed[s])
                pos.append(p0 - 1)
            rows.extend(range(first[s], first[s] + m))
            ids.extend(work.next_ids[first[s]:first[s] + m])
            pos.extend(work.positions[first[s]:first[s] + m])
            if pre:
                where[s] = work.seq_slots[s]
            if pre + m:
                seqs.append((s, pre + m, p0 - pre))
        if not seqs:
            return
        index = {s: i for i, (s, _, _) in enumerate(seqs)}
        cks = tuple(StateCheckpoint(index[s], int(s in resumed) + n - 1, slot) for s, n, slot in work.checkpoints
                    if int(s in resumed) + n > 1)
        batch = ForwardBatch.build([q for _, q, _ in seqs], [c for _, _, c in seqs], [work.seq_slots[s] for s, _, _ in seqs],
                                   [work.seq_tables[s] for s, _, _ in seqs], self.block_size, self.device, checkpoints=cks)
        if where:
            feats = torch.cat([feats, pending[self._long(list(where.values()))]])
        r = self._long(rows)
        self.draft.layer(0).write(self._long(ids), feats[r], self._long(pos), None, batch, cache)

    def _forward(self, step: int, ids: torch.Tensor, hidden: torch.Tensor, pos: list[int], tables: list[list[int]],
                 state_slots: list[int] | None = None):
        """One attending forward of one row per head at ``pos`` (its context: the positions before it); MTP's
        KDA layers read and write ``state_slots`` (None: no KDA layer at this step)."""
        n = len(pos)
        if isinstance(self.draft, MTPDraft):
            batch = ForwardBatch.build([1] * n, pos, state_slots or [0] * n, tables, self.block_size, self.device)
            return self.draft(step, ids, hidden, self._long(pos), batch, self.cache)
        return self.draft(ids, hidden, DraftBatch.build([1] * n, pos, tables, self.block_size, None, self.device),
                          self.cache)

    def _dflash(self, work: DraftWork) -> list[list[int]]:
        """One block forward per head: anchored at the token after its last caught-up row."""
        B = self.draft.cfg.block_size
        P = [work.positions[h] + 1 for h in work.heads]
        block = DraftBatch.build([B] * len(P), P, work.tables, self.block_size, None, self.device, causal=False,
                                 write=False)
        anchors = self._long([work.next_ids[h] for h in work.heads])
        drafts = self.draft.greedy(self.draft(anchors, block, self.cache)).tolist()
        return [d[:n] for d, n in zip(drafts, work.depths)]
