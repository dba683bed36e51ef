"""Batch building: the scheduler's decision (``SchedulerOutput``) as the model's inputs.

Eager steps get packed input ids [T], a ``ForwardBatch`` and the packed rows that need logits: the sampling
rows first (a chunk that reaches its last token; a speculative chunk needs every row, row j verifying draft
j + 1), then the rows that score prompt tokens (``prompt_logprobs``). A chunk whose positions hold media
pads gets those pads' embedding rows (``encoder_cache.ImageEncoder``).

Decode steps and speculative verify steps whose chunks all carry the same number of drafts (``graph_size``
says which) can replay a CUDA graph instead, their inputs packed padded to the graph's size
(``cuda_graphs.pack_decode_inputs``, which copies each request's int32 ``BlockTable``).
An async-scheduled chunk's input token (``input_pending``: still on the device) is a 0 here (its drafts, if
any, follow it); the runner puts the device tokens in its place.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import torch

from kimik3.engine.images.encoder_cache import ImageEncoder
from kimik3.model.batch import ForwardBatch, row_state_rows
from kimik3.model.cuda_graphs import DecodeGraphs, pack_decode_inputs


@dataclass
class StepInputs:
    input_ids: torch.Tensor     # [T] int64, packed new tokens
    batch: ForwardBatch
    rows: list[int]             # packed rows that need logits: sampling rows, then prompt-scoring rows
    prompt_rows: list[tuple]    # (request, position) of each prompt-scoring row (the last rows of ``rows``)
    pending_rows: list[int]     # packed rows of the ``input_pending`` chunks' first tokens, in chunk order


def prompt_logprob_positions(c) -> range:
    """Positions of chunk ``c`` whose logits score the next prompt token (prompt_logprobs not yet
    recorded there; a recompute after preemption records nothing twice)."""
    req = c.req
    if req.params.prompt_logprobs is None:
        return range(0)
    lo = max(c.start, len(req.out.prompt_logprobs) - 1)
    return range(lo, min(c.start + c.num_tokens, req.num_prompt_tokens - 1))


_LIVE_SLOT, _BLOCK_IDS = attrgetter("req.cache.state_slot"), attrgetter("req.cache.block_ids")


def chunk_state_slot(c) -> int:
    """The KDA state slot chunk ``c`` reads and writes: its own (``ScheduledChunk.state_slot``) or its request's."""
    return c.req.cache.state_slot if c.state_slot is None else c.state_slot


class BatchBuilder:
    def __init__(self, block_size: int, device: torch.device, images: ImageEncoder):
        self.block_size = block_size
        self.device = device
        self.images = images

    def build(self, out) -> StepInputs:
        """The eager step's inputs."""
        ids, rows, scored, scored_rows, pending = [], [], [], [], []  # scored: (request, position) per prompt-scoring row
        for c in out.chunks:
            for p in prompt_logprob_positions(c):
                scored.append((c.req, p))
                scored_rows.append(len(ids) + p - c.start)
            if c.input_pending:
                pending.append(len(ids))
            ids.extend([0] if c.input_pending else c.req.token_ids[c.start:c.start + c.num_tokens - len(c.draft)])
            ids.extend(c.draft)
            if c.samples:
                rows.extend(range(len(ids) - 1 - len(c.draft), len(ids)))
        batch = ForwardBatch.build(
            query_lens=[c.num_tokens for c in out.chunks], context_lens=[c.start for c in out.chunks],
            state_slots=[chunk_state_slot(c) for c in out.chunks],
            block_tables=[c.req.cache.block_ids for c in out.chunks],
            block_size=self.block_size, device=self.device, checkpoints=tuple(out.checkpoints))
        if any(c.req.mm is not None for c in out.chunks):
            batch.embed_rows, batch.embeds = self.images.rows(out.chunks)
        return StepInputs(torch.tensor(ids, dtype=torch.int64, device=self.device), batch, rows + scored_rows, scored,
                          pending)

    @staticmethod
    def graph_size(out, graphs: DecodeGraphs | None) -> int | None:
        """Padded size of the graph that runs this step, or None (eager): a graph step has L tokens per
        sequence, each with history: one (decode; no KDA checkpoint) or its last token and L - 1 drafts
        (verify, L up to the graphs' max query length; the speculative snapshots its only checkpoints),
        and no media pad or prompt scoring."""
        if graphs is None or not out.chunks:
            return None
        if out.plain_decode:            # one token each, with history, past the prompt; no checkpoint
            size = graphs.size_for(len(out.chunks))
            return size if (size, 1) in graphs.batches else None
        L = out.chunks[0].num_tokens
        prefix_checkpoints = any(h is not None for h in out.checkpoint_hashes)
        if L > graphs.max_query_len or (out.checkpoints and L == 1) or prefix_checkpoints:
            return None
        for c in out.chunks:
            req = c.req
            if (c.num_tokens != L or len(c.draft) != L - 1 or c.start == 0
                    or (req.params.prompt_logprobs is not None and prompt_logprob_positions(c))
                    or (req.mm is not None and req.mm.items_in(c.start, c.start + L))):
                return None
        size = graphs.size_for(len(out.chunks))
        return size if (size, L) in graphs.batches else None

    def build_decode(self, out, size: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """A graph step's host inputs padded to ``size`` sequences, and the rows that sample (each
        sampling chunk's L rows)."""
        chunks = out.chunks
        if out.plain_decode:        # pending tokens (the runner puts them in), the requests' own slots
            starts = list(map(attrgetter("start"), chunks))
            meta, tables = pack_decode_inputs([0] * len(chunks), starts, list(map(_LIVE_SLOT, chunks)),
                                              list(map(_BLOCK_IDS, chunks)), self.block_size, size)
            return meta, tables, list(range(len(chunks)))
        L = chunks[0].num_tokens
        first = [0 if c.input_pending else c.req.token_ids[c.start] for c in chunks]
        slots = [chunk_state_slot(c) for c in chunks]
        meta, tables = pack_decode_inputs(
            first if L == 1 else [[t, *c.draft] for t, c in zip(first, chunks)], [c.start for c in chunks], slots,
            [c.req.cache.block_ids for c in chunks], self.block_size, size,
            None if L == 1 else row_state_rows([L] * len(chunks), slots, out.checkpoints).tolist())
        return meta, tables, [i * L + j for i, c in enumerate(chunks) if c.samples for j in range(L)]
