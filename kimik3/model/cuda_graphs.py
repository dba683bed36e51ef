"""CUDA graphs of decode and verify steps: one graph per padded batch size and query length.

A decode step runs one token of every sequence, each with history, and no KDA checkpoint; a
verify step (speculative decoding) runs L = 1 + d tokens of every sequence (its last token and d
drafts, the same d for all), with the KDA snapshots after each of the first d rows as its only
checkpoints (a short step, ``ForwardBatch.row_state_slots``). Its n sequences are padded to the
next size of a ladder (1, 2, 4, 8, ... up to max_num_seqs; verify steps up to 32 sequences); larger
steps, prefills and mixed steps run eagerly. Each graph holds ``forward_step`` and
``compute_logits``; its inputs are views of static device buffers updated in place before
replay: one int64 [5, B * L] block (input ids,
context lens, state slots, slot mapping, the [B, L] row state slots), block tables [B, max_blocks]
int32, and cu_seqlens (fixed: 0, L, 2L, ..). MLA decode sizes its splits from ``max_seq_len``,
pinned to max_model_len so a replay attends over any context length.

With a draft model (``aux_layers``: the target layers whose input states the draft reads) every graph also
writes those states of its rows into one fixed buffer (``aux_states``, outside the graphs' pool), read after
the replay as the eager step's ``forward_step(aux_layers=...)`` output is.

While capturing, the MoE layers get a second stream (``KimiForCausalLM.use_side_stream``): the
graphs run the router and the shared experts beside the routed path (measured faster at every
captured size, benchmarks/RESULTS.md); eager steps stay on one stream, where the extra stream
switches cost more host time than the overlap saves.

Under expert parallelism the MoE blocks run their share in fixed shapes inside ``step``
(``moe.fixed_shape_experts``: every (token, expert) pair, other ranks' at weight 0), as a capture
needs: the eager steps' local pairs alone bring their count to the host.

Padding rows are token 0, context 0, state slot 0 and block 0. The ops do not skip them: fla's
pool decode (``ssm_state_indices``), the conv window write and the latent write all read and
write index 0. Slot 0 and block 0 are the null entries that the cache manager never hands to a
sequence (live slots start at 1, block 0 is never allocated), so padding only touches scratch.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import logging
from array import array

import numpy as np
import torch

from kimik3.model.batch import ForwardBatch, HybridCache
from kimik3.model.moe import fixed_shape_experts, moe_blocks
from kimik3.ops import ceil_div

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def garbage_collection_paused():
    """Python's cyclic garbage collector run once, then kept off inside: an unreachable object freed
    during a capture (an earlier engine's graphs, say) calls CUDA functions that a capture forbids
    (``cudaGraphExecDestroy``) and invalidates it. Seen on the H200: an engine built after another
    one lost its verify graphs."""
    gc.collect()
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes to capture: powers of two below ``max_num_seqs``, then ``max_num_seqs``."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    sizes = []
    b = 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_seqs]


def padded_batch_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size holding ``n`` sequences; None when ``n`` exceeds them all."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


META_ROWS = 5       # input ids, context lens, state slots, slot mapping, row state slots
# Verify steps of more sequences run eagerly: the graphs' logits outputs stay allocated (at 163840
# tokens of vocabulary, sizes 1..32 at L = 2..4 hold 371 MB; every ladder size up to 256 at
# L = 1..4, 3.3 GB) and speculation pays least in large batches.
VERIFY_GRAPH_MAX_SEQS = 32


def pack_decode_inputs(token_ids: list[int] | list[list[int]], context_lens: list[int], state_slots: list[int],
                       block_tables: list[list[int]], block_size: int, size: int,
                       row_state_slots: list[list[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Host inputs of one decode step (``token_ids``: one per sequence) or verify step (a list of L
    per sequence, and ``row_state_slots``: L slots per sequence) padded to ``size`` sequences.

    Returns meta int64 [5, size * L] (rows: input ids, context lens, state slots, slot mapping, row
    state slots as [size, L]; the per-sequence rows use the first ``size`` columns) and block tables
    int32 [size, width] (width = longest table; short tables end in block 0). Padding is all zeros:
    token 0, context 0, null slot 0, null block 0.
    """
    n = len(token_ids)
    if not (n == len(context_lens) == len(state_slots) == len(block_tables)):
        raise ValueError("token_ids, context_lens, state_slots and block_tables need one entry per sequence")
    if not 0 < n <= size:
        raise ValueError(f"{n} sequences do not fit a decode graph of {size} rows")
    L = len(token_ids[0]) if isinstance(token_ids[0], list) else 1
    try:
        ids = np.asarray(token_ids, dtype=np.int64).reshape(n, L)      # ragged or mixed rows raise
    except (ValueError, TypeError):
        ids = None
    if ids is None or (L > 1) != (row_state_slots is not None):
        raise ValueError("a verify step needs the same number of tokens for every sequence and its row state slots")
    # whole-batch numpy (a Python loop over the sequences cost ~3 us each on a busy CPU, the largest share of a
    # batch-128 step's batch building): the tables in one copy, the slot mapping gathered from them
    lens = np.fromiter(map(len, block_tables), np.int64, n)
    ctx = np.asarray(context_lens, dtype=np.int64)
    pos = ctx[:, None] + np.arange(L)                               # [n, L] positions written
    short = np.flatnonzero(pos[:, -1] // block_size >= lens)
    if short.size:
        i = int(short[0])
        raise ValueError(f"block table has {lens[i]} blocks, none for position {int(pos[i, -1])} "
                         f"(block size {block_size})")
    tables = np.zeros((size, int(lens.max())), dtype=np.int32)
    tables[:n][np.arange(tables.shape[1]) < lens[:, None]] = _concat_tables(block_tables, int(lens.sum()))
    slot_mapping = np.zeros((size, L), dtype=np.int64)
    slot_mapping[:n] = tables[np.arange(n)[:, None], pos // block_size].astype(np.int64) * block_size + pos % block_size
    meta = np.zeros((META_ROWS, size * L), dtype=np.int64)
    meta[0, :n * L] = ids.reshape(-1)
    meta[1, :n], meta[2, :n], meta[3] = ctx, state_slots, slot_mapping.reshape(-1)
    if row_state_slots is not None:
        meta[4, :n * L] = np.asarray(row_state_slots, dtype=np.int64).reshape(-1)
    return torch.from_numpy(meta), torch.from_numpy(tables)


def _concat_tables(block_tables, total: int) -> np.ndarray:
    """Every table's ids in order, int32: int32 arrays (``BlockTable``) joined as bytes in one call, else
    element by element."""
    if isinstance(block_tables[0], array) and block_tables[0].itemsize == 4:
        try:
            flat = np.frombuffer(b"".join(block_tables), dtype=np.int32)
            if flat.size == total:
                return flat
        except TypeError:           # a list among the arrays
            pass
    return np.fromiter(itertools.chain.from_iterable(block_tables), np.int32, total)


class DecodeGraphs:
    """Captured decode steps (query length 1) and verify steps (2 .. ``max_query_len``) of one model
    over one cache, keyed by (padded batch size, query length)."""

    def __init__(self, model, cache: HybridCache, max_num_seqs: int, max_model_len: int, max_query_len: int = 1,
                 aux_layers: tuple[int, ...] = ()):
        self.model, self.cache = model, cache
        self.aux_layers = tuple(aux_layers)
        self.moes = moe_blocks(model)       # their expert-parallel share in fixed shapes while a step is captured
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_model_len, self.max_query_len = max_model_len, max_query_len
        device = torch.device(model.device)
        largest = self.sizes[-1]
        self.meta = torch.zeros(META_ROWS, largest * max_query_len, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(largest, ceil_div(max_model_len, cache.block_size), dtype=torch.int32,
                                        device=device)
        self.cu_seqlens = torch.arange(largest + 1, dtype=torch.int64, device=device)   # times L in a verify step
        # pinned staging copies of the inputs: the host-to-device copies then run asynchronously;
        # ``staged`` marks when the last ones were read, before the staging is written again
        pinned = device.type == "cuda"
        self.meta_host = torch.zeros(self.meta.shape, dtype=torch.int64, pin_memory=pinned)
        self.block_tables_host = torch.zeros(self.block_tables.shape, dtype=torch.int32, pin_memory=pinned)
        self.staged = torch.cuda.Event() if pinned else None
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.batches = {(size, L): self.batch(size, L) for size in self.sizes for L in range(1, max_query_len + 1)
                        if L == 1 or size <= VERIFY_GRAPH_MAX_SEQS}
        # a draft model's states (``aux_layers``): every graph writes its rows' states here, [rows, n * D]
        self.aux_states: torch.Tensor | None = None
        if self.aux_layers:
            width = len(self.aux_layers) * model.config.text.hidden_size
            self.aux_states = torch.zeros(max(s * L for s, L in self.batches), width, dtype=model.dtype, device=device)

    def size_for(self, n: int) -> int | None:
        return padded_batch_size(n, self.sizes)

    def batch(self, size: int, L: int = 1) -> ForwardBatch:
        """The static batch of ``size`` sequences of L tokens (views of the static buffers; dummy host
        context lengths). Built before capture: a verify step's ``cu_seqlens`` is a fresh tensor."""
        T = size * L
        return ForwardBatch(cu_seqlens=self.cu_seqlens[:size + 1] * L, context_lens=self.meta[1, :size],
                            state_slots=self.meta[2, :size], block_tables=self.block_tables[:size],
                            slot_mapping=self.meta[3, :T], query_lens_cpu=[L] * size,
                            context_lens_cpu=[1] * size, max_seq_len=self.max_model_len,
                            row_state_slots=self.meta[4, :T].view(size, L) if L > 1 else None)

    def step(self, size: int, L: int = 1) -> torch.Tensor:
        """One step over the static inputs of ``size`` sequences of L tokens: logits [size * L, vocab]. With
        ``aux_layers`` the states the draft reads are written to rows 0 .. size * L of ``aux_states``, a fixed
        buffer outside the graphs' pool. The MoE blocks under expert parallelism run in fixed shapes
        (``moe.fixed_shape_experts``)."""
        with fixed_shape_experts(self.moes):
            return self._step(size, L)

    def _step(self, size: int, L: int) -> torch.Tensor:
        T = size * L
        if not self.aux_layers:
            return self.model.compute_logits(self.model.forward_step(self.meta[0, :T], self.batches[size, L], self.cache))
        hidden, aux = self.model.forward_step(self.meta[0, :T], self.batches[size, L], self.cache, self.aux_layers)
        D = aux[0].shape[-1]
        for i, a in enumerate(aux):
            self.aux_states[:T, i * D:(i + 1) * D].copy_(a)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    @garbage_collection_paused()
    def capture(self) -> None:
        """Capture every size, largest first, in one memory pool. The static inputs hold padding
        while capturing, so the warm-up runs write only the null slot and block.

        Runs under ``garbage_collection_paused``."""
        self.meta.zero_()
        self.block_tables.zero_()
        pool = None
        self.model.use_side_stream(torch.cuda.Stream())
        try:
            for size, L in sorted(self.batches, key=lambda k: -k[0] * k[1]):
                graph, logits = capture_graph(lambda: self.step(size, L), pool)
                pool = graph.pool()
                self.graphs[size, L] = (graph, logits)
        finally:
            self.model.use_side_stream(None)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs of decode steps for batch sizes %s%s", self.sizes,
                    f" and of verify steps of 2..{self.max_query_len} tokens" if self.max_query_len > 1 else "")

    def run(self, meta: torch.Tensor, block_tables: torch.Tensor, num_seqs: int,
            input_ids: torch.Tensor | None = None, drafts: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Copy the host inputs (from ``pack_decode_inputs``) in and replay: logits [num_seqs * L, vocab]
        (a view of the graph's output, valid until the next replay; so are ``states``). ``input_ids``: [num_seqs] device
        tokens that replace the host ones at each sequence's first row (async scheduling: the previous
        step's samples). ``drafts``: (input rows, tokens) on the device written over the host ones (a draft model's
        drafts still on the device)."""
        (size, width), cols = block_tables.shape, meta.shape[1]
        L = cols // size
        if self.staged is not None:
            self.staged.synchronize()
        self.meta_host[:, :cols].copy_(meta)
        self.block_tables_host[:size, :width].copy_(block_tables)
        self.meta[:, :cols].copy_(self.meta_host[:, :cols], non_blocking=True)
        self.block_tables[:size, :width].copy_(self.block_tables_host[:size, :width], non_blocking=True)
        if input_ids is not None:
            self.meta[0, :cols].view(size, L)[:num_seqs, 0].copy_(input_ids)
        if drafts is not None:
            self.meta[0].index_copy_(0, *drafts)
        if self.staged is not None:
            self.staged.record()
        graph, logits = self.graphs[size, L]
        graph.replay()
        return None if logits is None else logits[:num_seqs * L]      # None: a tensor-parallel worker

    def states(self, num_seqs: int, L: int) -> torch.Tensor | None:
        """The last replay's draft-model states of its ``num_seqs`` sequences of L rows, [num_seqs * L, n * D]
        (a view of the fixed buffer, valid until the next replay); None without ``aux_layers``."""
        return None if self.aux_states is None else self.aux_states[:num_seqs * L]


def capture_or_none(graphs: DecodeGraphs, decode_only_retry: bool = True) -> DecodeGraphs | None:
    """Capture the graphs; a model that cannot be captured runs eagerly (one warning). When verify
    graphs were asked for, a failure retries with decode graphs alone (``decode_only_retry``; under
    tensor parallelism every rank must hold the same graphs, so the ranks agree on None instead)."""
    retry = decode_only_retry and graphs.max_query_len > 1
    fallback = ("verify steps run eagerly, decode steps are captured again alone" if retry
                else "decode steps run eagerly")
    if captured_or_none(graphs, "the model's steps", f"{fallback}. Pass enforce_eager to skip the attempt") is not None:
        return graphs
    if retry:
        return capture_or_none(type(graphs)(graphs.model, graphs.cache, graphs.sizes[-1], graphs.max_model_len,
                                            aux_layers=graphs.aux_layers), decode_only_retry=False)
    return None


def capture_graph(fn, pool=None):
    """``fn`` captured into a CUDA graph (in ``pool``: another graph's ``pool()``, or None for a new one) after one
    warm-up run on a side stream, off the capture (kernel compiles, autotuning): (the graph, ``fn``'s output)."""
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        fn()
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def captured_or_none(graphs, what: str, fallback: str):
    """``graphs.capture()`` and ``graphs``, or None after one warning (``what`` failed; ``fallback`` runs instead)
    with the half-captured graphs dropped (capture errors come as RuntimeError or torch.AcceleratorError)."""
    try:
        graphs.capture()
        return graphs
    except Exception as exc:
        logger.warning("CUDA graph capture of %s failed (%s: %s); %s", what, type(exc).__name__,
                       str(exc).splitlines()[0] if str(exc) else "", fallback)
        graphs.graphs.clear()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return None
