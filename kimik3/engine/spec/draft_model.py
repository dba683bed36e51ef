"""Drafts from a draft model (Eagle3, K3's MTP, a DFlash block drafter) for speculative decoding.

The target's forward keeps the hidden states the draft reads (``aux_layers``: Eagle3's / DFlash's auxiliary
layers, MTP's pre-norm h_final) for every row of the step (``ModelRunner``). After the step is committed
(drafts settled, tokens appended), ``observe`` plans the draft's work (``draft_exec.DraftWork``) and runs it:

1. the draft's cache catches up with the positions the target computed and kept (the rows of rejected drafts
   are rewritten later, as the target's MLA latents are: the draft cache shares the target's block tables,
   ``model/draft_attention.py``, so prefix hits, preemption and freeing need nothing of their own; a cached
   block's last row read the token after the block of the request that computed it). An MTP draft whose first
   layer is KDA keeps that layer's states in slots of its own numbered as the target's (``_slot``): they advance
   over committed rows only (the target's rollbacks to its draft snapshots are its own), and mirror the target
   step's restores, resets and prefix checkpoints (exactly: ``DraftExecutor._recurrent_catch_up``). On a CPU the
   rows of a request that neither drafts nor watches wait until it does (``_defer``, ``draft_lag.py``), so a step
   that drafts nothing runs no draft work (at batch 32 its catch-up cost 2-3% of a step);
2. the controller (``controller.py``) chooses each request's number of drafts k_r for the next step from its
   measured acceptance and the measured costs (0: a plain decode step), and the draft computes them (Eagle3 /
   MTP: one forward per draft position; DFlash: a block). A request that does not draft computes its first
   draft every 1, 2, 4 .. ``MAX_WATCH_GAP`` decode steps (it "watches"; on a CPU not while more than
   ``WATCH_LAG`` of its rows wait) and scores it against the token that comes, so its acceptance follows the text.

Drafts are the draft's greedy tokens (a one-token draft distribution): ``verify.verify`` accepts exactly as the
target's sampler would, greedy and sampled alike. Its drafts need the previous step's committed tokens, so its
requests' steps are never scheduled ahead (``drafts_ahead`` False).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from kimik3.engine.config import EngineConfig
from kimik3.engine.spec.acceptance import Acceptance
from kimik3.engine.spec.controller import MAX_WATCH_GAP, DraftController
from kimik3.engine.spec.device_drafts import DeviceDrafts
from kimik3.model.draft_step import (DraftExecutor, DraftWork, allocate_draft_cache, cache_nbytes, draft_cache_shape,
                                     draft_state_bytes)
from kimik3.engine.spec.draft_lag import WATCH_LAG, defer_rows, waiting
from kimik3.engine.spec.drafter import Drafter
from kimik3.loader.drafts import load_draft
from kimik3.model.dflash import DFlashDraft
from kimik3.model.draft_attention import extend_tables
from kimik3.model.mtp import MTPDraft

logger = logging.getLogger(__name__)

__all__ = ["ModelDrafter", "ModelState", "load_draft"]      # load_draft: the loader's, the engine's name for it


@dataclass
class ModelState:
    """One request's draft-model drafting state (``Request.spec``)."""

    accept: Acceptance = field(default_factory=Acceptance)
    proposal: list[int] = field(default_factory=list)   # the draft's drafts for its next step (``observe``)
    watch: tuple[int, int] | None = None     # (position, the first draft computed for it) while not drafting
    gap: int = 1                             # decode steps between its watched first drafts
    wait: int = 0                            # decode steps before the next one
    lag: list = field(default_factory=list)  # rows not caught up: (([step's states], 1st row), positions, next ids)


class ModelDrafter(Drafter):
    """Drafts from a draft model (module docstring); ``observe`` runs it after each committed step."""

    drafts_ahead = False

    def __init__(self, config: EngineConfig, draft, num_blocks: int, executor_factory=DraftExecutor,
                 num_slots: int = 1, spec_slots: range = range(0)):
        """``num_slots``: the target's state slots; ``spec_slots``: its draft snapshot slots among them. A recurrent
        (KDA) draft layer keeps its states under the target's slot numbers, but for the snapshot slots (the target's
        rollback copies from them are its own: the draft's states only ever see committed rows), then one
        scratch slot per sequence for the drafts' rows (``_slot``)."""
        super().__init__(config)
        k, block_size = config.num_speculative_tokens, config.block_size
        self.draft = draft
        self.k = k
        self.method, self.source = config.speculative_method, None   # the checkpoint other ranks load (drafters.py)
        if isinstance(draft, DFlashDraft) and k > draft.cfg.block_size - 1:
            raise ValueError(f"num_speculative_tokens {k} exceeds what the DFlash draft's blocks "
                             f"give (block_size - 1 = {draft.cfg.block_size - 1}); lower it")
        self.block_size = block_size
        self.aux_layers = tuple(draft.aux_layer_ids)
        reach = draft.cfg.block_size if isinstance(draft, DFlashDraft) else k
        self.scratch_per_seq = -(-(reach + 1) // block_size) + 1
        self.first_scratch = num_blocks
        total = num_blocks + config.max_num_seqs * self.scratch_per_seq
        p = next(draft.parameters())
        self.num_cache_blocks, self.spec_slots = total, spec_slots
        self.first_scratch_slot = num_slots - len(spec_slots)
        self.num_cache_slots = self.first_scratch_slot + config.max_num_seqs
        self.cache = allocate_draft_cache(draft, total, block_size, self.num_cache_slots)
        # MTP whose first layer is KDA: its states follow the target's committed rows, state ops and checkpoints
        self.recurrent = isinstance(draft, MTPDraft) and draft.layer(0).is_kda
        self.executor = executor_factory(draft, self.cache, block_size)
        self.controller = DraftController(k, config.num_speculative_tokens_per_batch_size)
        # the controller's clock: wall time where a device runs the steps; on a CPU this process's CPU time (on a
        # machine shared with other processes their load would stretch the measured costs at random)
        self.clock = time.process_time if p.device.type == "cpu" else time.perf_counter
        # rows of requests that neither draft nor watch wait (``_defer``) on a CPU; not where ranks hold states of
        # their own (tensor parallelism sets it False), not for a recurrent first layer (its states advance in order)
        self.may_lag = p.device.type == "cpu" and not self.recurrent
        self.prefix_caching = config.enable_prefix_caching
        self._step_end: float | None = None      # when the last ``observe`` returned (the target step's start)
        self._pending: tuple | None = None       # the last ``observe``'s launched draft work, not yet handed out
        self._deferred = False                   # proposals are placeholders for drafts still on the device
        self._tokens, self._heads, self._asked, self._handed, self._real = None, {}, set(), {}, {}

    @staticmethod
    def bytes_per_block(draft, block_size: int) -> int:
        """Bytes of the draft's cache per block of ``block_size`` tokens (all its attention layers)."""
        p = next(draft.parameters())
        shape = draft_cache_shape(draft, 1, block_size)
        return int(torch.Size(shape).numel()) * p.element_size()

    @staticmethod
    def bytes_per_slot(draft) -> int:
        """Bytes of the draft's recurrent state per state slot (its KDA layers; 0 without)."""
        return draft_state_bytes(draft)

    @property
    def cache_bytes(self) -> int:
        return cache_nbytes(self.cache)

    def _slot(self, slot: int) -> int:
        """The draft's state slot of the target's ``slot`` (not a snapshot slot): the slots after the target's
        snapshot slots move down over them."""
        return slot - len(self.spec_slots) if slot >= self.spec_slots.stop else slot

    @staticmethod
    def state(req) -> ModelState:
        if req.spec is None:
            req.spec = ModelState()
        return req.spec

    def proposes(self, req) -> bool:
        """Whether ``req`` drafts next: a drafting head of the last ``observe`` (its drafts launched, or handed out
        by ``_collect``); the rest (most of a large batch on a CPU, where drafts seldom pay) are not asked."""
        if self._pending is not None:
            return id(req) in self._heads
        return req.spec is not None and bool(req.spec.proposal)

    def propose(self, req, room: int) -> list[int]:
        """The draft's proposal from the last step (``observe``), within ``room`` and the grammar. While its drafts
        are still on the device (``_deferred``), placeholders of their count (``pending_drafts``)."""
        if self._deferred:
            self._asked.add(id(req))
            head = self._heads.get(id(req))
            if head is not None and room:
                self._handed[id(req)] = head[0]
                return [0] * min(head[1], room)
        else:
            self._collect()
        s = self.state(req)
        draft, s.proposal = s.proposal[:room], []
        return draft[:req.matcher.valid_prefix(draft)] if draft and req.matcher is not None else draft

    def settle(self, req, draft: list[int], num_accepted: int) -> None:
        """A verify step's outcome updates the request's (and the global) acceptance."""
        self.controller.settle(self.state(req).accept, len(draft), num_accepted)

    def observe(self, out, states: torch.Tensor | None) -> None:
        """Catch up with a committed step and set the proposal of each request that drafts next.
        ``states``: the target's aux states of the step's packed rows [T, n * D] (None: nothing to read). The draft's
        device work is only launched here (``DraftExecutor.launch``): the host emits the step's outputs while it
        runs, and the next ``propose`` hands its drafts out (``_collect``)."""
        self._collect()
        now = self.clock()
        decode = bool(out.chunks) and all(c.samples and c.num_tokens - len(c.draft) == 1 for c in out.chunks)
        if decode and self._step_end is not None:
            self.controller.record_step(len(out.chunks), sum(len(c.draft) for c in out.chunks), now - self._step_end)
        if states is not None:
            work, reqs, counts, states = self._plan(out, states)
            if work.rows or work.state_copies or work.state_resets:
                collect, tokens = self.executor.launch(work, states)
                sizes = (len(work.seq_lens), len(work.rows), work.num_forwards, work.forward_rows) \
                    if decode and work.rows else None
                self._pending = (collect, reqs, counts, sizes, self.clock() - now)
                # the next step may be scheduled before the drafts reach the host (none constrained by a grammar)
                self._deferred = tokens is not None and self._may_defer(reqs, counts)
                self._tokens, self._asked, self._handed = tokens, set(), {}
                self._heads = {id(r): (i, k) for i, (r, k) in enumerate(zip(reqs, counts)) if k}
        self._step_end = self.clock()

    @staticmethod
    def _may_defer(reqs, counts: list[int]) -> bool:
        """Whether the drafting heads' next step may be scheduled on placeholders: no grammar cuts their drafts."""
        return all(r.matcher is None for r, k in zip(reqs, counts) if k)

    def pending_drafts(self) -> DeviceDrafts | None:
        """After a step is scheduled: its placeholder drafts' source (the runner reads the device's tokens, the
        sampler resolves them), or None; the next step's proposals wait for the drafts."""
        deferred, self._deferred = self._deferred, False
        return DeviceDrafts(self._tokens, self._handed, self._take) if deferred and self._handed else None

    def _take(self) -> dict[int, list[int]]:
        self._collect()
        return self._real

    def _collect(self) -> None:
        """Hand out the last ``observe``'s drafts, waiting for the device if it still drafts: the wait is the draft's
        time (``record_draft``), not the next target step's."""
        if self._pending is None:
            return
        collect, reqs, counts, sizes, launched = self._pending
        self._pending, self._deferred = None, False
        t0 = self.clock()
        drafts = collect()
        waited = self.clock() - t0
        if sizes is not None:
            self.controller.record_draft(*sizes, launched + waited)
        if self._step_end is not None:
            self._step_end += waited
        self._hand_out(reqs, counts, drafts)
        self._real = {id(r): d for r, d in zip(reqs, drafts)}
        for req in reqs:                     # proposed already (as placeholders, or none): not proposed again
            if id(req) in self._asked:
                self.state(req).proposal = []
        self._asked = set()

    def _plan(self, out, states: torch.Tensor) -> tuple[DraftWork, list, list[int], torch.Tensor]:
        """The step's catch-up rows and, for the requests that sample next, their drafts (``controller.plan``):
        (work, the heads' requests, drafts each proposes: 0 for a watching head, the states its rows index)."""
        work, cands, spans = self._catch_up(out)
        if self.controller.rests(len(cands)):        # the last plan drafted nothing: none now, nothing planned
            rooms, depths = [], [0] * len(cands)
        else:
            rooms = [self._room(req) for req, _, _ in cands]
            depths = self.controller.plan_step([self.state(req).accept for req, _, _ in cands], rooms, len(cands))
        heads = self._drafting(cands, rooms, depths)
        last = [cands[i][1] for i in heads]                 # each head's last row
        if self.may_lag and self.executor.graphs is None:
            states, moved = self._defer(work, spans, {id(cands[i][0]) for i in heads}, states)
            last = [moved.get(row, row) for row in last]
        reach = self.draft.cfg.block_size if isinstance(self.draft, DFlashDraft) else None
        work.tables = extend_tables([reach or max(depths[i], 1) for i in heads], [work.positions[r] + 1 for r in last],
                                    [cands[i][0].cache.block_ids for i in heads], self.block_size,
                                    self._scratch(len(heads)))
        work.heads, work.depths = last, [max(depths[i], 1) for i in heads]
        work.head_seqs = [cands[i][2] for i in heads]
        work.scratch_slots = list(range(self.first_scratch_slot, self.first_scratch_slot + len(heads)))
        return work, [cands[i][0] for i in heads], [depths[i] for i in heads], states

    def _drafting(self, cands: list, rooms: list[int], depths: list[int]) -> list[int]:
        """The candidates that draft or watch, longest first. Requests that do not draft watch (their first draft)
        only where a forward runs anyway (a step that drafts nothing runs no draft forward), and not where more
        than ``WATCH_LAG`` of their rows wait (``_defer``: the watch would catch them all up)."""
        heads = []
        if any(depths):                              # (where nothing drafts, none watches)
            watch = self.controller.schedule is None
            heads = sorted((i for i, (req, _, _) in enumerate(cands) if depths[i] or (
                watch and rooms[i] and self.state(req).wait == 0 and waiting(self.state(req).lag) <= WATCH_LAG)),
                key=lambda i: -max(depths[i], 1))
        chosen = set(heads)
        for i, (req, _, _) in enumerate(cands):
            if i not in chosen:
                s = self.state(req)
                s.wait = max(s.wait - 1, 0)
        return heads

    def _defer(self, work: DraftWork, spans: list, heads: set[int], states: torch.Tensor):
        """Rows of requests that neither draft nor watch now wait (``draft_lag.defer_rows``): (the states, old row
        index -> new one)."""
        return defer_rows(work, spans, heads, states, self.state, self.block_size, self.prefix_caching)

    def _catch_up(self, out) -> tuple[DraftWork, list, list]:
        """The rows of ``out`` the draft's cache catches up with (packed row, the next token, position, cache row;
        per request its rows, block table and state slot) with the step's state restores, resets and prefix
        checkpoints, the requests that sample next (request, its last row, its sequence) and each request's rows
        (request, its first index in the rows, their number); scores the first drafts watched for them."""
        w = DraftWork([], [], [], [], [], [], [])
        rows, positions, slots, next_ids, seq_lens = w.rows, w.positions, w.slots, w.next_ids, w.seq_lens
        cands, spans, seq_of, offset, bs = [], [], {}, 0, self.block_size
        for i, c in enumerate(out.chunks):          # (once per step for every request: locals, no generators)
            req, start = c.req, c.start
            end = start + c.num_tokens - len(c.draft) + c.num_accepted
            if self.may_draft(req) and not req.is_finished and len(req.token_ids) > end:
                if req.spec is not None and req.spec.watch is not None:
                    self._score_watch(req)
                table = req.cache.block_ids
                spans.append((req, len(rows), end - start))
                rows.extend(range(offset, offset + end - start))
                positions.extend(range(start, end))
                slots.extend([table[p // bs] * bs + p % bs for p in range(start, end)])
                next_ids.extend(req.token_ids[start + 1:end + 1])
                seq_of[i] = len(seq_lens)
                seq_lens.append(end - start)
                if self.recurrent:
                    w.seq_tables.append(list(table))
                    w.seq_slots.append(self._slot(req.cache.state_slot))
                if c.samples:
                    cands.append((req, len(rows) - 1, seq_of[i]))
            offset += c.num_tokens
        if not self.recurrent:
            return w, cands, spans
        w.state_copies = [(self._slot(a), self._slot(b)) for a, b in out.state_copies if a not in self.spec_slots]
        w.state_resets = [self._slot(a) for a in out.state_resets]
        w.checkpoints = [(seq_of[ck.seq], ck.num_tokens, self._slot(ck.slot))
                         for ck, h in zip(out.checkpoints, out.checkpoint_hashes) if h is not None and ck.seq in seq_of]
        restored = {b for _, b in w.state_copies}         # live slots restored from a prefix checkpoint
        w.resumed = [(s, out.chunks[i].req.token_ids[out.chunks[i].start]) for i, s in seq_of.items()
                     if w.seq_slots[s] in restored]
        return w, cands, spans

    def _score_watch(self, req) -> None:
        s = self.state(req)
        if s.watch is not None and s.watch[0] < req.num_tokens:
            self.controller.watched(s.accept, req.token_ids[s.watch[0]] == s.watch[1])
            s.watch = None

    def _hand_out(self, reqs, counts: list[int], drafts: list[list[int]]) -> None:
        """Proposals for the drafting heads; a watching head keeps its first draft to score, and watches again
        after twice as many decode steps (up to ``MAX_WATCH_GAP``)."""
        for req, k, d in zip(reqs, counts, drafts):
            s = self.state(req)
            if k:
                s.proposal, s.gap, s.wait = d[:k], 1, 0
            else:
                s.watch = (req.num_tokens, d[0])
                s.wait, s.gap = s.gap - 1, min(2 * s.gap, MAX_WATCH_GAP)

    def _room(self, req) -> int:
        """Drafts ``req`` may take next (the scheduler trims them to its budget too)."""
        return 0 if req.is_finished else max(0, min(self.k, req.params.max_tokens - req.num_output_tokens - 1))

    def _scratch(self, n: int) -> list[list[int]]:
        return [list(range(self.first_scratch + i * self.scratch_per_seq,
                           self.first_scratch + (i + 1) * self.scratch_per_seq)) for i in range(n)]
