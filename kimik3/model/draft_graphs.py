"""CUDA graphs of a draft's steps (``draft_step.DraftWork``): the catch-up and each draft position (Eagle3, MTP) or
the block (DFlash).

A draft step is many small kernels (fc, norms, projections, rotary, the cache writes, attention, the MLP, the
LM head, the greedy pick) per forward; eagerly their launches cost more than the work at small batches. Two
kinds of graph replay them:

1. Catch-up, one graph per padded row count R (a ladder up to ``max_num_seqs * (k + 1)``: every row of a
   decode or verify step): the rows' features (``fc`` over the target's states, gathered by the graph from a
   fixed buffer), their keys/values written to the draft cache, and each drafting head's first inputs (its
   row's feature, next token and position) copied to the step buffers. Padding rows write the null cache row
   (block 0, never a request's).
2. One draft position, one graph per (padded head count N, key span S): the heads' forward at their
   positions, attending over key positions 0 .. S - 1 of their block tables (masked past each head's own
   position: what the eager forward attends to, padded), the greedy tokens, and the next position's inputs
   written back into the step buffers (token, feature, position + 1). A chain of depth d replays it d times,
   each time with the head count of the heads that draft that far (heads are sorted by depth), so mixed
   depths in one step replay too. Padding heads have all-zero block tables: their rows go to the null block.
   A DFlash draft's block is one such graph replayed once: each head's B rows at P .. P + B - 1 (its anchor
   token, then mask tokens) over its context (key positions < P, the span padding masked) and, non-causally,
   the block's own keys (not written); its B - 1 greedy tokens. Its catch-up writes every layer's context keys.

Key spans S are a ladder of block multiples up to ``max_model_len + k``; a span's graphs exist only for the head
counts whose gathered keys stay within ``MAX_KEY_BYTES`` (the attention gathers [N, S] keys in fp32: a long
span at a large batch would hold gigabytes in the graphs' pool). A step that fits no captured graph (more
rows, more heads, a longer span) runs eagerly (``DraftExecutor``).

K3's MTP layers (``model/mtp.py``) replay the same way, through the target's own modules as its decode graphs hold
them (``cuda_graphs.DecodeGraphs``): a draft position of N heads is a decode step over a fixed ``ForwardBatch`` (one
row a head, context its position, its block table [N, W] int32, ``max_seq_len`` the one span: the MLA decode kernel
reads each head's own keys, so there is no span ladder), the MLA layer's latents written at the row (a padding head:
block 0's null row), a KDA layer's state advanced in place at the row's state slot (a padding head: the null slot
0), then the MoE or dense MLP, the shared head and the greedy pick. Catch-up writes the first layer's latents (an
MLA first layer) and the heads' first inputs. The state slots follow the eager executor's: a KDA first layer's
first position advances each head's live slot over the committed row it computes, and the drafts past it run on
scratch slots made, in the second position's graph, as copies of the live ones (a KDA layer past the first: zeros),
so a rejected draft never touches a live state. Hence up to three graphs per (layer, N): the first position, the
second (which makes the scratch slots) and later ones (``mtp_phase``; one without KDA layers). A KDA first layer's
catch-up advances each sequence's live state over its committed rows in order (but a head's last, its first
position's): graphs of r rounds over S padded sequences (``catch_up_rounds``), round i a decode step of the layer
over each sequence's i-th row (a sequence with fewer rows, and padding: the null slot), for up to k rows a sequence;
a step with the target's state copies or resets, prefix checkpoints, a sequence without history or more rows (a
prompt's) runs that catch-up eagerly before the replays (``DraftExecutor._recurrent_catch_up``: one chunked pass,
equal up to rounding). A step with a head at position 0 (an eager prefill row) runs eagerly.

Under tensor parallelism every rank captures its own graphs at once, their collectives inside (the attention's
and MLP's / MoE's all-reduces, the greedy pick's all-gather), and all keep them only if every rank succeeded
(``parallel/worker.py``); a step's plan depends only on its ``DraftWork`` and the captured keys, the same on every
rank, so every rank replays the same graphs in the same order (or all run the step eagerly). Under expert
parallelism an MTP draft's MoE blocks run their share in fixed shapes in what the graphs record (``fixed``:
``moe.fixed_shape_experts``), as the target's decode graphs do.

Inputs reach the graphs through fixed buffers filled before the replays (one host-to-device copy each); the
drafts come back in one device-to-host copy, as the eager executor's do. ``record`` captures one function
on CUDA; a subclass records the function itself (tests replay it eagerly over the same buffers on a CPU).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kimik3.model.batch import ForwardBatch
from kimik3.model.cuda_graphs import (capture_graph, captured_or_none, garbage_collection_paused, graph_batch_sizes,
                                     padded_batch_size)
from kimik3.model.dflash import DFlashDraft, DFlashLayer
from kimik3.model.draft_attention import DraftBatch
from kimik3.model.eagle3 import Eagle3Draft, Eagle3Layer
from kimik3.model.moe import fixed_shape_experts, moe_blocks
from kimik3.model.mtp import MTPDraft, MTPLayer

logger = logging.getLogger(__name__)

DRAFT_GRAPH_MAX_SEQS = 32          # drafting heads per graph (as the target's verify graphs: VERIFY_GRAPH_MAX_SEQS)
MAX_KEY_BYTES = 256 << 20          # a step graph's gathered keys and values (fp32) at most
MIN_SPAN = 256                     # the shortest key span (positions), before rounding to whole blocks


@dataclass(frozen=True)
class StepPlan:
    """What ``DraftGraphs.launch`` replays for one step's ``DraftWork`` (``DraftGraphs.step_plan``)."""

    rows: int                           # padded catch-up rows R: graph ("rows", R)
    chain: list[tuple]                  # the graph key of each draft position (``step_key``)
    rounds: tuple[int, int] | None      # a KDA first layer's catch-up (padded sequences, rounds) in graphs, or None:
    #                                     eagerly before the replays (``rounds_for``; always None without one)


def span_ladder(max_len: int, block_size: int, min_span: int = MIN_SPAN) -> list[int]:
    """Key spans (multiples of ``block_size``): ``min_span`` doubling while below ``max_len``, then ``max_len``
    rounded up to a whole block."""
    top = -(-max_len // block_size) * block_size
    spans, s = [], -(-min(min_span, top) // block_size) * block_size
    while s < top:
        spans.append(s)
        s *= 2
    return spans + [top]


class DraftGraphs:
    """Captured draft steps of one Eagle3, DFlash or MTP ``draft`` over its ``cache`` (a paged key/value tensor, or
    MTP's ``HybridCache``; module docstring)."""

    def __init__(self, draft, cache, block_size: int, max_num_seqs: int, max_model_len: int, k: int,
                 states_dtype: torch.dtype, min_span: int = MIN_SPAN):
        if not self.can_capture(draft):
            raise ValueError(f"draft graphs hold Eagle3, DFlash and MTP drafts, not {type(draft).__name__}")
        self.draft, self.cache, self.block_size, self.k = draft, cache, block_size, k
        self.max_num_seqs, self.max_model_len, self.min_span = max_num_seqs, max_model_len, min_span
        self.device = next(draft.parameters()).device
        # DFlash: B rows a head (keys of its context alone); Eagle3: one, whose keys reach k - 1 past the context
        self.dflash_rows = draft.cfg.block_size if isinstance(draft, DFlashDraft) else 0
        self.mtp = isinstance(draft, MTPDraft)
        # MTP whose first layer is KDA: its catch-up in rounds (``catch_up_rounds``) or eagerly (``rounds_for``)
        self.recurrent = self.mtp and draft.layer(0).is_kda
        self.sizes = graph_batch_sizes(min(max_num_seqs, DRAFT_GRAPH_MAX_SEQS))
        self.row_sizes = graph_batch_sizes(max_num_seqs * (k + 1))
        if self.mtp:        # the MLA decode kernel reads each head's own keys: one span, every position
            top = max_model_len + k
            self.spans = span_ladder(top, block_size, top)
            self.steps_keys = [(n, self.spans[-1]) for n in self.sizes]
            hidden, dtype = draft.cfg.hidden_size, draft.layer(0).eh_proj.weight.dtype
        else:
            self.spans = span_ladder(max_model_len + (0 if self.dflash_rows else k), block_size, min_span)
            attn = draft.layers[0].self_attn
            # fp32 bytes a key position costs a step graph: its key and value, and the scores of its query rows
            per_key = 4 * (2 * attn.num_kv_heads * attn.head_dim + attn.num_heads * max(self.dflash_rows, 1))
            self.steps_keys = [(n, s) for s in self.spans for n in self.sizes if n * s * per_key <= MAX_KEY_BYTES]
            hidden, dtype = draft.cfg.target_hidden_size, draft.fc.weight.dtype
        R, N, W = self.row_sizes[-1], self.sizes[-1], self.spans[-1] // block_size
        self.max_position = self.spans[-1] + self.dflash_rows   # the rotary tables cover it: no graph regrows them
        as_long = dict(dtype=torch.int64, device=self.device)
        self.rows = torch.zeros(4, R, **as_long)    # next ids, positions, cache slots, the target step's row
        self.heads = torch.zeros(4, N, **as_long)   # each head's catch-up row, position, MTP's live and scratch slot
        # a step of N heads over span S reads [:N * S / bs] as [N, S / bs] (MTP: int32, the target's tables)
        table_dtype = torch.int32 if self.mtp else torch.int64
        self.tables = torch.zeros(N * W, dtype=table_dtype, device=self.device)
        self.span_index = torch.arange(max(self.spans[-1], self.dflash_rows, N + 1), **as_long)
        self.states = torch.zeros(R, len(draft.aux_layer_ids) * hidden, dtype=states_dtype, device=self.device)
        self.step_ids = torch.zeros(N, **as_long)
        self.step_pos = torch.zeros(N, **as_long)
        self.step_hidden = torch.zeros(N, draft.cfg.hidden_size, dtype=dtype, device=self.device)
        self.tokens = torch.zeros(max(k, self.dflash_rows - 1, 1), N, **as_long)
        self.own_keys = torch.ones(N, self.dflash_rows, self.dflash_rows, dtype=torch.bool, device=self.device)
        # a KDA first layer's catch-up in rounds (``catch_up_rounds``): round i's row of each sequence (its row in
        # ``states``, next id, position, state slot), up to k rounds of N sequences
        self.rounds = torch.zeros(k if self.recurrent else 0, 4, N, **as_long)
        pinned = self.device.type == "cuda"
        self.rounds_host = torch.zeros(self.rounds.shape, dtype=torch.int64, pin_memory=pinned)
        self.rows_host = torch.zeros(self.rows.shape, dtype=torch.int64, pin_memory=pinned)
        self.heads_host = torch.zeros(self.heads.shape, dtype=torch.int64, pin_memory=pinned)
        self.tables_host = torch.zeros(self.tables.shape, dtype=table_dtype, pin_memory=pinned)
        self.staged = torch.cuda.Event() if pinned else None     # when the last copies out of them were made
        self.tokens_host = torch.zeros(self.tokens.shape, dtype=torch.int64, pin_memory=pinned)
        self.copied = torch.cuda.Event() if pinned else None     # when the drafts reached ``tokens_host``
        self.graphs: dict[tuple, object] = {}
        self.moes = moe_blocks(draft)       # an MTP draft's: their expert-parallel share in fixed shapes (``record``)
        self.num_replays = 0
        self._keep: tuple = ()

    @staticmethod
    def can_capture(draft) -> bool:
        """An Eagle3, DFlash or MTP draft (its layers the plain ones; whole or split over tensor-parallel ranks) runs
        from fixed buffers."""
        layer = {Eagle3Draft: Eagle3Layer, DFlashDraft: DFlashLayer, MTPDraft: MTPLayer}.get(type(draft))
        layers = draft.model.layers.values() if type(draft) is MTPDraft else getattr(draft, "layers", ())
        return layer is not None and all(type(m) is layer for m in layers)

    def mtp_phase(self, j: int) -> int:
        """Which graph of an MTP layer draft position j replays: 0 the first (a KDA layer 0 on the live slots), 1 the
        second (its heads' scratch slots made first: copies of the live ones, or zeros), 2 later ones (on the scratch
        slots). A draft without KDA layers has one kind."""
        return min(j, 2) if self.draft.kda_layer_ids else 0

    def step_key(self, N: int, span: int, j: int) -> tuple:
        """The graph of draft position j of N heads over key positions < ``span``."""
        if self.mtp:
            return "step", N, span, j % self.draft.num_layers, self.mtp_phase(j)
        return "step", N, span

    # ---- the captured functions --------------------------------------------------------------------------
    def catch_up(self, R: int) -> None:
        """R catch-up rows (padded: the null row) and every head's first inputs (DFlash: its anchor token and
        the block's first position)."""
        ids, pos, slots = self.rows[0, :R], self.rows[1, :R], self.rows[2, :R]
        if self.mtp:        # the first layer's latents (a KDA first layer's catch-up: rounds, or eagerly before)
            feats = self.states[:R]
            if not self.recurrent:
                self.draft.layer(0).write(ids, feats, pos, slots, None, self.cache)
            rows = self.heads[0].clamp(max=R - 1)
            self.step_ids.copy_(ids[rows])
            self.step_hidden.copy_(feats[rows])
            self.step_pos.copy_(self.heads[1])
            return
        if self.dflash_rows:
            self.draft.write_context([self.states[:R]], pos, slots, self.cache, self.max_position)
            self.step_ids.copy_(ids[self.heads[0].clamp(max=R - 1)])
            self.step_pos.copy_(self.heads[1] + 1)
            return
        feats = self.draft.combine([self.states[:R]])
        self.draft.write(ids, feats, pos, slots, self.cache, self.max_position)
        rows = self.heads[0]
        self.step_ids.copy_(ids[rows.clamp(max=R - 1)])
        self.step_hidden.copy_(feats[rows.clamp(max=R - 1)])
        self.step_pos.copy_(self.heads[1])

    def step(self, N: int, span: int) -> None:
        """One draft position of heads 0 .. N - 1 over key positions < ``span``; inputs of the next one (DFlash:
        the block, its drafts into ``tokens``)."""
        bs, W = self.block_size, span // self.block_size
        pos, tables = self.step_pos[:N], self.tables[:N * W].view(N, W)
        keys = self.span_index[:span]
        key_rows = tables.gather(1, (keys // bs)[None].expand(N, -1)) * bs + keys % bs
        if self.dflash_rows:
            B = self.dflash_rows
            in_ctx = (keys[None] < pos[:, None])[:, None].expand(N, B, span)
            batch = DraftBatch((pos[:, None] + self.span_index[:B]).view(-1), list(range(0, N * B + 1, B)), [0] * N,
                               tables, None, bs, causal=False, key_rows=key_rows,
                               visible=torch.cat([in_ctx, self.own_keys[:N]], dim=-1), max_position=self.max_position)
            self.tokens[:B - 1, :N].copy_(self.draft.greedy(self.draft(self.step_ids[:N], batch, self.cache)).T)
            return
        slots = tables.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
        batch = DraftBatch(pos, list(range(N + 1)), [0] * N, tables, slots, bs, key_rows=key_rows,
                           visible=(keys[None] <= pos[:, None])[:, None], max_position=self.max_position)
        logits, hidden = self.draft(self.step_ids[:N], self.step_hidden[:N], batch, self.cache)
        self.step_ids[:N].copy_(self.draft.greedy(logits))
        self.step_hidden[:N].copy_(hidden)
        self.step_pos[:N].add_(1)

    def catch_up_rounds(self, S: int, r: int) -> None:
        """A KDA first layer's catch-up of S sequences (padded: the null slot 0) as r decode steps of the layer (its
        state advanced in place, ``MTPLayer.write``): round i writes each sequence's i-th row (``rounds_for``)."""
        for i in range(r):
            rows, ids, pos, slots = self.rounds[i, :, :S]
            batch = ForwardBatch(cu_seqlens=self.span_index[:S + 1], context_lens=pos, state_slots=slots,
                                 block_tables=self.tables[:S].view(S, 1), slot_mapping=slots, query_lens_cpu=[1] * S,
                                 context_lens_cpu=[1] * S, max_seq_len=self.spans[-1])
            self.draft.layer(0).write(ids, self.states[rows], pos, None, batch, self.cache)

    def mtp_step(self, N: int, span: int, layer: int, phase: int) -> None:
        """One draft position of heads 0 .. N - 1 through MTP layer ``layer`` (``mtp_phase``: which state slots its
        KDA layers use), as a decode step over the heads' block tables; the next position's inputs."""
        bs, W = self.block_size, span // self.block_size
        pos, tables = self.step_pos[:N], self.tables[:N * W].view(N, W)
        if phase == 1:
            self.fork(N)
        batch = ForwardBatch(cu_seqlens=self.span_index[:N + 1], context_lens=pos,
                             state_slots=self.heads[2 if phase == 0 else 3, :N], block_tables=tables,
                             slot_mapping=tables.gather(1, (pos // bs)[:, None])[:, 0].long() * bs + pos % bs,
                             query_lens_cpu=[1] * N, context_lens_cpu=[1] * N, max_seq_len=span)
        logits, hidden = self.draft(layer, self.step_ids[:N], self.step_hidden[:N], pos, batch, self.cache)
        self.step_ids[:N].copy_(self.draft.greedy(logits))
        self.step_hidden[:N].copy_(hidden)
        self.step_pos[:N].add_(1)

    def fork(self, N: int) -> None:
        """The KDA states the drafts past the first run on (heads 0 .. N - 1's scratch slots; the null slot 0 for the
        padding and shallower heads): copies of the live ones (a KDA first layer, whose first draft position
        advanced them over the committed row), else zeros (a later KDA layer sees its chain's rows alone). The live
        slots keep the committed rows alone, as the eager executor's."""
        live, scratch = self.heads[2, :N], self.heads[3, :N]
        conv, state = self.cache.kda_conv, self.cache.kda_state
        if self.recurrent:
            conv[:, scratch] = conv[:, live]
            state[:, scratch] = state[:, live]
        else:
            conv[:, scratch] = 0
            state[:, scratch] = 0

    # ---- capture -----------------------------------------------------------------------------------------
    def record(self, fn):
        """Capture ``fn`` (after a warm-up run off the capture) into the graphs' pool: an object with ``replay``."""
        graph, _ = capture_graph(fn, self._pool)
        self._pool = graph.pool()
        return graph

    def fixed(self, fn):
        """``fn`` with the draft's MoE blocks under expert parallelism in fixed shapes (``moe.fixed_shape_experts``:
        no host synchronisation), what ``capture`` records."""
        def run():
            with fixed_shape_experts(self.moes):
                return fn()
        return run

    @torch.inference_mode()
    @garbage_collection_paused()
    def capture(self) -> None:
        """Every catch-up row count and every (head count, span), largest first, in one pool. The buffers hold
        zeros (the null block) while capturing."""
        for t in (self.rows, self.heads, self.tables):
            t.zero_()
        self._pool = None
        keep = []
        for layer in () if self.mtp else self.draft.layers:        # (MTP's MLA has no rotary)
            rotary = layer.self_attn.rotary
            rotary(self.step_hidden.new_zeros(1, 1, rotary.head_dim), self.step_pos[:1], self.max_position)
            keep += [rotary.cos, rotary.sin]
        self._keep = tuple(keep)        # the tables the graphs read stay alive if an eager step regrows them
        for R in sorted(self.row_sizes, reverse=True):
            self.graphs["rows", R] = self.record(self.fixed(lambda R=R: self.catch_up(R)))
        for S in sorted(self.sizes, reverse=True) if self.recurrent else ():
            for r in range(self.k, 0, -1):
                self.graphs["rounds", S, r] = self.record(self.fixed(lambda S=S, r=r: self.catch_up_rounds(S, r)))
        kinds = sorted({self.step_key(1, 1, j)[3:] for j in range(max(self.k, 1))})   # MTP: (layer, phase) a position
        for N, S in sorted(self.steps_keys, key=lambda key: -key[0] * key[1]):
            for kind in kinds:
                for t in (self.step_ids, self.step_pos, self.step_hidden):     # a warm-up advances them: no run while
                    t.zero_()                                                  # capturing reads past its span
                fn = (lambda N=N, S=S, kind=kind: self.mtp_step(N, S, *kind)) if kind else \
                    (lambda N=N, S=S: self.step(N, S))
                self.graphs[("step", N, S, *kind)] = self.record(self.fixed(fn))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        logger.info("captured CUDA graphs of the draft's steps: catch-up rows %s, heads x key spans %s",
                    self.row_sizes, self.steps_keys)

    # ---- replay ------------------------------------------------------------------------------------------
    def rounds_for(self, work) -> tuple[int, int] | None:
        """(padded sequences, rounds) of a KDA first layer's catch-up in graphs (``catch_up_rounds``), or None: it
        runs eagerly (the target step's state copies or resets, prefix checkpoints, a sequence restored from one, a
        sequence without history, more rows than k or more sequences than the largest step graph). The rows of a
        sequence are caught up one round each; a head's last row is its first draft position's."""
        if not self.recurrent or work.state_copies or work.state_resets or work.checkpoints or work.resumed:
            return None
        heads, first, r = set(work.head_seqs), 0, 0
        for s, n in enumerate(work.seq_lens):
            m = n - (s in heads)
            if m and work.positions[first] == 0:
                return None
            r, first = max(r, m), first + n
        S = padded_batch_size(len(work.seq_lens), self.sizes)
        return (S, r) if S is not None and r <= self.k else None

    def fits(self, work, states: torch.Tensor) -> bool:
        """Whether ``launch`` replays ``work`` (else it does nothing and the step runs eagerly)."""
        return self.step_plan(work, states) is not None

    def step_plan(self, work, states: torch.Tensor) -> StepPlan | None:
        """What ``launch`` replays for ``work`` (``plan`` and, a KDA first layer, ``rounds_for``), worked out once a
        step: the executor passes it on to ``launch``. None: no graph fits (the step runs eagerly)."""
        if states.dtype != self.states.dtype:
            return None
        plan = self.plan(work)
        return None if plan is None else StepPlan(*plan, self.rounds_for(work))

    def plan(self, work) -> tuple[int, list[tuple]] | None:
        """(padded rows, the graph key of each draft position: ``step_key``) for ``work``, or None (eager)."""
        R = padded_batch_size(len(work.rows), self.row_sizes)
        if R is None or not work.rows or len(work.heads) > self.sizes[-1] or max(work.depths, default=0) > self.k:
            return None
        if not work.heads:
            return R, []
        if self.mtp and min(work.positions[h] for h in work.heads) == 0:
            return None         # a head at position 0 attends as a prefill row eagerly (no history, no state)
        # the last key position + 1: Eagle3's last draft row; DFlash's context (its block's keys are its own)
        reach = max(work.positions[h] + (1 if self.dflash_rows else d) for h, d in zip(work.heads, work.depths))
        span = next((s for s in self.spans if s >= reach), None)
        if span is None:
            return None
        if self.dflash_rows:
            N = padded_batch_size(len(work.heads), self.sizes)
            return (R, [("step", N, span)]) if ("step", N, span) in self.graphs else None
        chain = []
        for j in range(work.depths[0]):
            key = self.step_key(padded_batch_size(sum(d > j for d in work.depths), self.sizes), span, j)
            if key not in self.graphs:
                return None
            chain.append(key)
        return R, chain

    def stage_rounds(self, work, plan: tuple[int, int] | None) -> tuple[int, int] | None:
        """A KDA first layer's catch-up rounds of ``work`` copied in (``plan``: its ``rounds_for``); None where it ran
        eagerly."""
        if plan is None or not plan[1]:
            return plan
        rounds = self.rounds_host
        rounds.zero_()
        heads, first = set(work.head_seqs), 0
        for s, n in enumerate(work.seq_lens):
            for i in range(n - (s in heads)):
                row = first + i
                rounds[i, :, s] = torch.tensor([row, work.next_ids[row], work.positions[row], work.seq_slots[s]])
            first += n
        self.rounds.copy_(rounds, non_blocking=True)
        return plan

    def run(self, work, states: torch.Tensor) -> list[list[int]] | None:
        """The drafts of each head of ``work`` (as ``DraftExecutor.run``), or None where no graph fits."""
        collect = self.launch(work, states)
        return None if collect is None else collect()

    @torch.inference_mode()
    def launch(self, work, states: torch.Tensor, plan: StepPlan | None = None):
        """Queue ``work``'s replays and the copy of its drafts to the host; a function that waits for them and returns
        the drafts of each head, or None where no graph fits (nothing queued: ``fits``). ``plan``: ``work``'s
        ``step_plan`` where the caller has it (else worked out here). Call it before the next launch (the buffers are
        reused). An MTP draft with a KDA first layer: its catch-up in rounds, or (where ``plan.rounds`` is None) ran
        before, eagerly (``DraftExecutor._recurrent_catch_up``)."""
        if plan is None:
            plan = self.step_plan(work, states)
        if plan is None:
            return None
        R, chain = plan.rows, plan.chain
        T, n = len(work.rows), len(work.heads)
        if self.staged is not None:
            self.staged.synchronize()           # the last step's copies out of the staging buffers are done
        rows, heads = self.rows_host, self.heads_host           # whole (small) buffers: contiguous copies
        rows.zero_()
        rows[:, :T] = torch.tensor([work.next_ids, work.positions, work.slots, work.rows], dtype=torch.int64)
        heads.zero_()
        if n:
            heads[:2, :n] = torch.tensor([work.heads, [work.positions[h] for h in work.heads]], dtype=torch.int64)
        if n and self.mtp:          # MTP's state slots: live (a KDA first layer) and scratch (heads drafting past one)
            if self.recurrent:
                heads[2, :n] = torch.tensor([work.seq_slots[s] for s in work.head_seqs], dtype=torch.int64)
            deeper = min(sum(d > 1 for d in work.depths), len(work.scratch_slots))
            heads[3, :deeper] = torch.tensor(work.scratch_slots[:deeper], dtype=torch.int64)
        self.rows.copy_(rows, non_blocking=True)
        self.heads.copy_(heads, non_blocking=True)
        if chain:                                       # [N, W] tables, padding heads all zeros
            N, span = chain[0][1:3]
            W = span // self.block_size
            tables = self.tables_host[:N * W].view(N, W).numpy()
            tables.fill(0)
            for i, t in enumerate(work.tables):          # blocks past the span hold no position it reads
                tables[i, :min(len(t), W)] = t[:W]
            self.tables[:N * W].copy_(self.tables_host[:N * W], non_blocking=True)
        rounds = self.stage_rounds(work, plan.rounds)
        if self.staged is not None:
            self.staged.record()
        torch.index_select(states, 0, self.rows[3, :T], out=self.states[:T])    # the caught-up rows' states
        if rounds is not None and rounds[1]:
            self.graphs["rounds", *rounds].replay()
        self.graphs["rows", R].replay()
        for j, key in enumerate(chain):
            self.graphs[key].replay()
            if not self.dflash_rows:
                self.tokens[j, :key[1]].copy_(self.step_ids[:key[1]])
        self.num_replays += 1
        if not chain:
            return list
        depths = list(work.depths)
        out = self.tokens_host[:depths[0]]                    # whole rows: a contiguous copy
        out.copy_(self.tokens[:depths[0]], non_blocking=True)
        if self.copied is not None:
            self.copied.record()

        def collect() -> list[list[int]]:
            if self.copied is not None:
                self.copied.synchronize()
            flat = out[:, :n].tolist()
            return [[flat[j][i] for j in range(d)] for i, d in enumerate(depths)]
        return collect


def capture_draft_or_none(graphs: DraftGraphs) -> DraftGraphs | None:
    """Capture the draft's graphs; a draft that cannot be captured drafts eagerly (one warning)."""
    return captured_or_none(graphs, "the draft's steps", "the draft runs eagerly")
