"""CUDA graphs of a draft's steps (``draft_step.DraftWork``): the catch-up and each draft position (Eagle3) or
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
rows, more heads, a longer span) runs eagerly (``DraftExecutor``); so do MTP drafts (``can_capture``).

Under tensor parallelism every rank captures its own graphs at once, their collectives inside (the attention's
and MLP's all-reduces, the greedy pick's all-gather), and all keep them only if every rank succeeded
(``parallel/worker.py``); a step's plan depends only on its ``DraftWork`` and the captured keys, the same on every
rank, so every rank replays the same graphs in the same order (or all run the step eagerly).

Inputs reach the graphs through fixed buffers filled before the replays (one host-to-device copy each); the
drafts come back in one device-to-host copy, as the eager executor's do. ``record`` captures one function
on CUDA; a subclass records the function itself (tests replay it eagerly over the same buffers on a CPU).
"""

from __future__ import annotations

import logging

import torch

from kimik3.model.cuda_graphs import (capture_graph, captured_or_none, garbage_collection_paused, graph_batch_sizes,
                                     padded_batch_size)
from kimik3.model.dflash import DFlashDraft, DFlashLayer
from kimik3.model.draft_attention import DraftBatch
from kimik3.model.eagle3 import Eagle3Draft, Eagle3Layer

logger = logging.getLogger(__name__)

DRAFT_GRAPH_MAX_SEQS = 32          # drafting heads per graph (as the target's verify graphs: VERIFY_GRAPH_MAX_SEQS)
MAX_KEY_BYTES = 256 << 20          # a step graph's gathered keys and values (fp32) at most
MIN_SPAN = 256                     # the shortest key span (positions), before rounding to whole blocks


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
    """Captured draft steps of one Eagle3 or DFlash ``draft`` over its paged ``cache`` (module docstring)."""

    def __init__(self, draft, cache: torch.Tensor, block_size: int, max_num_seqs: int, max_model_len: int, k: int,
                 states_dtype: torch.dtype, min_span: int = MIN_SPAN):
        if not self.can_capture(draft):
            raise ValueError(f"draft graphs hold Eagle3 and DFlash drafts, not {type(draft).__name__}")
        self.draft, self.cache, self.block_size, self.k = draft, cache, block_size, k
        self.max_num_seqs, self.max_model_len, self.min_span = max_num_seqs, max_model_len, min_span
        self.device = cache.device
        # DFlash: B rows a head (keys of its context alone); Eagle3: one, whose keys reach k - 1 past the context
        self.dflash_rows = draft.cfg.block_size if isinstance(draft, DFlashDraft) else 0
        self.sizes = graph_batch_sizes(min(max_num_seqs, DRAFT_GRAPH_MAX_SEQS))
        self.row_sizes = graph_batch_sizes(max_num_seqs * (k + 1))
        self.spans = span_ladder(max_model_len + (0 if self.dflash_rows else k), block_size, min_span)
        attn = draft.layers[0].self_attn
        # fp32 bytes a key position costs a step graph: its key and value, and the scores of its query rows
        per_key = 4 * (2 * attn.num_kv_heads * attn.head_dim + attn.num_heads * max(self.dflash_rows, 1))
        self.steps_keys = [(n, s) for s in self.spans for n in self.sizes if n * s * per_key <= MAX_KEY_BYTES]
        R, N, W = self.row_sizes[-1], self.sizes[-1], self.spans[-1] // block_size
        self.max_position = self.spans[-1] + self.dflash_rows   # the rotary tables cover it: no graph regrows them
        as_long = dict(dtype=torch.int64, device=self.device)
        self.rows = torch.zeros(4, R, **as_long)    # next ids, positions, cache slots, the target step's row
        self.heads = torch.zeros(2, N, **as_long)   # each head's catch-up row and position
        self.tables = torch.zeros(N * W, **as_long)  # a step of N heads over span S reads [:N * S / bs] as [N, S / bs]
        self.span_index = torch.arange(max(self.spans[-1], self.dflash_rows), **as_long)
        width = len(draft.aux_layer_ids) * draft.cfg.target_hidden_size
        self.states = torch.zeros(R, width, dtype=states_dtype, device=self.device)
        self.step_ids = torch.zeros(N, **as_long)
        self.step_pos = torch.zeros(N, **as_long)
        self.step_hidden = torch.zeros(N, draft.cfg.hidden_size, dtype=draft.fc.weight.dtype, device=self.device)
        self.tokens = torch.zeros(max(k, self.dflash_rows - 1, 1), N, **as_long)
        self.own_keys = torch.ones(N, self.dflash_rows, self.dflash_rows, dtype=torch.bool, device=self.device)
        pinned = self.device.type == "cuda"
        self.rows_host = torch.zeros(self.rows.shape, dtype=torch.int64, pin_memory=pinned)
        self.heads_host = torch.zeros(self.heads.shape, dtype=torch.int64, pin_memory=pinned)
        self.tables_host = torch.zeros(self.tables.shape, dtype=torch.int64, pin_memory=pinned)
        self.staged = torch.cuda.Event() if pinned else None     # when the last copies out of them were made
        self.tokens_host = torch.zeros(self.tokens.shape, dtype=torch.int64, pin_memory=pinned)
        self.copied = torch.cuda.Event() if pinned else None     # when the drafts reached ``tokens_host``
        self.graphs: dict[tuple, object] = {}
        self.num_replays = 0
        self._keep: tuple = ()

    @staticmethod
    def can_capture(draft) -> bool:
        """An Eagle3 or DFlash draft (its layers the plain ones; whole or split over tensor-parallel ranks) runs from
        fixed buffers."""
        layer = {Eagle3Draft: Eagle3Layer, DFlashDraft: DFlashLayer}.get(type(draft))
        return layer is not None and all(type(m) is layer for m in draft.layers)

    # ---- the captured functions --------------------------------------------------------------------------
    def catch_up(self, R: int) -> None:
        """R catch-up rows (padded: the null row) and every head's first inputs (DFlash: its anchor token and
        the block's first position)."""
        ids, pos, slots = self.rows[0, :R], self.rows[1, :R], self.rows[2, :R]
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

    # ---- capture -----------------------------------------------------------------------------------------
    def record(self, fn):
        """Capture ``fn`` (after a warm-up run off the capture) into the graphs' pool: an object with ``replay``."""
        graph, _ = capture_graph(fn, self._pool)
        self._pool = graph.pool()
        return graph

    @torch.inference_mode()
    @garbage_collection_paused()
    def capture(self) -> None:
        """Every catch-up row count and every (head count, span), largest first, in one pool. The buffers hold
        zeros (the null block) while capturing."""
        for t in (self.rows, self.heads, self.tables):
            t.zero_()
        self._pool = None
        keep = []
        for layer in self.draft.layers:
            rotary = layer.self_attn.rotary
            rotary(self.step_hidden.new_zeros(1, 1, rotary.head_dim), self.step_pos[:1], self.max_position)
            keep += [rotary.cos, rotary.sin]
        self._keep = tuple(keep)        # the tables the graphs read stay alive if an eager step regrows them
        for R in sorted(self.row_sizes, reverse=True):
            self.graphs["rows", R] = self.record(lambda R=R: self.catch_up(R))
        for N, S in sorted(self.steps_keys, key=lambda key: -key[0] * key[1]):
            for t in (self.step_ids, self.step_pos, self.step_hidden):     # a warm-up advances them: no run while
                t.zero_()                                                  # capturing reads past its span
            self.graphs["step", N, S] = self.record(lambda N=N, S=S: self.step(N, S))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        logger.info("captured CUDA graphs of the draft's steps: catch-up rows %s, heads x key spans %s",
                    self.row_sizes, self.steps_keys)

    # ---- replay ------------------------------------------------------------------------------------------
    def plan(self, work) -> tuple[int, list[tuple[int, int]]] | None:
        """(padded rows, the (heads, span) graph of each draft position) for ``work``, or None (eager)."""
        R = padded_batch_size(len(work.rows), self.row_sizes)
        if R is None or not work.rows or len(work.heads) > self.sizes[-1] or max(work.depths, default=0) > self.k:
            return None
        if not work.heads:
            return R, []
        # the last key position + 1: Eagle3's last draft row; DFlash's context (its block's keys are its own)
        reach = max(work.positions[h] + (1 if self.dflash_rows else d) for h, d in zip(work.heads, work.depths))
        span = next((s for s in self.spans if s >= reach), None)
        if span is None:
            return None
        if self.dflash_rows:
            N = padded_batch_size(len(work.heads), self.sizes)
            return (R, [(N, span)]) if ("step", N, span) in self.graphs else None
        chain = []
        for j in range(work.depths[0]):
            N = padded_batch_size(sum(d > j for d in work.depths), self.sizes)
            if ("step", N, span) not in self.graphs:
                return None
            chain.append((N, span))
        return R, chain

    def run(self, work, states: torch.Tensor) -> list[list[int]] | None:
        """The drafts of each head of ``work`` (as ``DraftExecutor.run``), or None where no graph fits."""
        collect = self.launch(work, states)
        return None if collect is None else collect()

    @torch.inference_mode()
    def launch(self, work, states: torch.Tensor):
        """Queue ``work``'s replays and the copy of its drafts to the host; a function that waits for them and returns
        the drafts of each head, or None where no graph fits (nothing queued). Call it before the next launch (the
        buffers are reused)."""
        plan = self.plan(work) if states.dtype == self.states.dtype else None
        if plan is None:
            return None
        R, chain = plan
        T, n = len(work.rows), len(work.heads)
        if self.staged is not None:
            self.staged.synchronize()           # the last step's copies out of the staging buffers are done
        rows, heads = self.rows_host, self.heads_host           # whole (small) buffers: contiguous copies
        rows.zero_()
        rows[:, :T] = torch.tensor([work.next_ids, work.positions, work.slots, work.rows], dtype=torch.int64)
        heads.zero_()
        if n:
            heads[:, :n] = torch.tensor([work.heads, [work.positions[h] for h in work.heads]], dtype=torch.int64)
        self.rows.copy_(rows, non_blocking=True)
        self.heads.copy_(heads, non_blocking=True)
        if chain:                                       # [N, W] tables, padding heads all zeros
            (N, span), W = chain[0], chain[0][1] // self.block_size
            tables = self.tables_host[:N * W].view(N, W).numpy()
            tables.fill(0)
            for i, t in enumerate(work.tables):          # blocks past the span hold no position it reads
                tables[i, :min(len(t), W)] = t[:W]
            self.tables[:N * W].copy_(self.tables_host[:N * W], non_blocking=True)
        if self.staged is not None:
            self.staged.record()
        torch.index_select(states, 0, self.rows[3, :T], out=self.states[:T])    # the caught-up rows' states
        self.graphs["rows", R].replay()
        for j, (N, span) in enumerate(chain):
            self.graphs["step", N, span].replay()
            if not self.dflash_rows:
                self.tokens[j, :N].copy_(self.step_ids[:N])
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
