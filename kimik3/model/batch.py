"""The runner -> model contract: one packed varlen step and the hybrid cache it reads/writes.

Shapes use one alphabet: N sequences, T packed new tokens, H heads, K/V head dims,
P = H*K KDA channels, W conv width, L_kda / L_mla cached layers, D_c = kv_lora_rank + rope dim.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from kimik3.ops import ceil_div
from kimik3.ops.fp8 import FP8

SHORT_CHUNK_MAX = 16    # new tokens per sequence up to which a step with history runs as a short step


@dataclass(frozen=True)
class StateCheckpoint:
    """Snapshot a sequence's KDA state (conv window + recurrent state, every KDA layer)
    after ``num_tokens`` of its new tokens in this step, into pool slot ``slot``.
    Used by prefix caching to keep block-boundary states."""

    seq: int          # index of the sequence in the batch
    num_tokens: int   # 1..query_len: the snapshot covers context + num_tokens tokens
    slot: int         # destination slot in the KDA state pool


@dataclass
class ForwardBatch:
    """Metadata of one forward step over N sequences packed into T tokens.

    Sequence n owns packed rows cu_seqlens[n]:cu_seqlens[n+1]; those are its tokens at
    positions context_lens[n] ... context_lens[n] + query_len - 1.
    """

    cu_seqlens: torch.Tensor        # [N+1] int64, offsets of each sequence's new tokens
    context_lens: torch.Tensor      # [N] int64, tokens already cached before this step
    state_slots: torch.Tensor       # [N] int64, KDA state-pool slot of each sequence
    block_tables: torch.Tensor      # [N, max_blocks] int32 MLA latent-cache block ids (-1 = none)
    slot_mapping: torch.Tensor      # [T] int64, latent-cache row (block * block_size + offset) per token
    query_lens_cpu: list[int]       # host copies, for loops and kernel launch decisions
    context_lens_cpu: list[int]
    checkpoints: tuple[StateCheckpoint, ...] = ()
    # A short step (every sequence has history and at most SHORT_CHUNK_MAX new tokens, some more than
    # one: a speculative verify step) has [N, max query_len] KDA pool slots that keep the state after
    # each row (``kda_recurrent_in_pool``): a checkpoint's slot at its row, the live slot at the
    # sequence's last row, scratch slot 0 elsewhere; its MLA rows attend as decode rows. None otherwise.
    row_state_slots: torch.Tensor | None = None
    # Bound on context + query length of every sequence (MLA decode sizes its splits with it):
    # the batch's own maximum when eager; max_model_len in a CUDA graph, whose inputs change on replay.
    max_seq_len: int | None = None
    # Multimodal: rows of the packed input whose embeddings are replaced (image features).
    embed_rows: torch.Tensor | None = None    # [M] int64 packed row indices
    embeds: torch.Tensor | None = None        # [M, D] model dtype

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_cpu))

    def row_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per packed row: its sequence's index and its offset in the chunk, [T] each (device ops
        with a host-known size, so a CUDA graph can hold them)."""
        T = self.num_tokens
        lens = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        seq = torch.repeat_interleave(torch.arange(self.num_seqs, device=lens.device), lens, output_size=T)
        return seq, torch.arange(T, device=lens.device) - self.cu_seqlens[seq]

    @property
    def is_decode(self) -> bool:
        """Every sequence has exactly one new token and some history (pure decode step)."""
        return all(q == 1 for q in self.query_lens_cpu) and all(c > 0 for c in self.context_lens_cpu)

    def slice_rows(self, lo: int, hi: int) -> ForwardBatch:
        """Packed rows [lo, hi) as a batch of their own (a pipeline micro-batch, ``kimik3.parallel.pipeline``): the
        sequences they touch, a sequence cut at ``lo`` starting later in its chunk (its earlier rows are then
        history, written by the micro-batch before), checkpoints renumbered; in a short step a sequence cut before
        its end keeps its state in its live slot at its last row here. The device tensors are views of this
        batch's, but for the offsets and a short step's slot table."""
        if not 0 <= lo < hi <= self.num_tokens:
            raise ValueError(f"rows [{lo}, {hi}) outside the batch's {self.num_tokens} rows")
        starts = np.cumsum([0, *self.query_lens_cpu]).tolist()
        s0 = int(np.searchsorted(starts, lo, side="right")) - 1
        s1 = int(np.searchsorted(starts, hi, side="left"))
        skip = [max(lo - starts[n], 0) for n in range(s0, s1)]          # each sequence's rows before ``lo``
        q = [min(hi, starts[n + 1]) - starts[n] - k for n, k in zip(range(s0, s1), skip)]
        c = [self.context_lens_cpu[n] + k for n, k in zip(range(s0, s1), skip)]
        checkpoints = tuple(dataclasses.replace(ck, seq=ck.seq - s0, num_tokens=ck.num_tokens - skip[ck.seq - s0])
                            for ck in self.checkpoints if s0 <= ck.seq < s1
                            and 0 < ck.num_tokens - skip[ck.seq - s0] <= q[ck.seq - s0])
        device = self.cu_seqlens.device
        as_long = dict(dtype=torch.int64, device=device)
        rows = None
        if self.row_state_slots is not None and max(q) > 1:      # a short step's per-row slots, shifted for a cut
            rows = self.row_state_slots[s0:s1].clone()
            rows[0, :q[0]] = self.row_state_slots[s0, skip[0]:skip[0] + q[0]]
            rows[0, q[0]:] = 0
            if skip[-1] + q[-1] < self.query_lens_cpu[s1 - 1]:     # cut before its end: its last row keeps the state
                rows[-1, q[-1] - 1] = self.state_slots[s1 - 1]
            rows = rows[:, :max(q)]
        out = ForwardBatch(cu_seqlens=torch.tensor(np.cumsum([0, *q]).tolist(), **as_long),
                           context_lens=torch.tensor(c, **as_long), state_slots=self.state_slots[s0:s1],
                           block_tables=self.block_tables[s0:s1], slot_mapping=self.slot_mapping[lo:hi],
                           query_lens_cpu=q, context_lens_cpu=c, checkpoints=checkpoints, row_state_slots=rows,
                           max_seq_len=max(a + b for a, b in zip(q, c)))
        if self.embed_rows is not None:     # a later pipeline stage has the rows but not the embeddings
            keep = (self.embed_rows >= lo) & (self.embed_rows < hi)
            out.embed_rows = self.embed_rows[keep] - lo
            out.embeds = None if self.embeds is None else self.embeds[keep]
        return out

    @staticmethod
    def build(query_lens: list[int], context_lens: list[int], state_slots: list[int],
              block_tables: list[list[int]], block_size: int, device: torch.device | str = "cpu",
              checkpoints: tuple[StateCheckpoint, ...] = ()) -> ForwardBatch:
        """Build a batch from host lists (block tables must cover context + query tokens)."""
        if not (len(query_lens) == len(context_lens) == len(state_slots) == len(block_tables)):
            raise ValueError("query_lens, context_lens, state_slots and block_tables must have one entry per sequence")
        cu = [0]
        width = max((len(t) for t in block_tables), default=0)
        tables = np.full((len(block_tables), max(width, 1)), -1, dtype=np.int32)
        slot_mapping = []
        for i, (q, c, table) in enumerate(zip(query_lens, context_lens, block_tables)):
            if q <= 0:
                raise ValueError(f"every sequence needs at least one new token, got query_len={q}")
            need = ceil_div(c + q, block_size)
            if len(table) < need:
                raise ValueError(f"block table has {len(table)} blocks, {need} needed for {c + q} tokens")
            cu.append(cu[-1] + q)
            tables[i, :len(table)] = np.asarray(table, dtype=np.int32)
            pos = np.arange(c, c + q)
            slot_mapping.append(tables[i, pos // block_size].astype(np.int64) * block_size + pos % block_size)
        as_long = dict(dtype=torch.int64, device=device)
        return ForwardBatch(
            cu_seqlens=torch.tensor(cu, **as_long),
            context_lens=torch.tensor(context_lens, **as_long),
            state_slots=torch.tensor(state_slots, **as_long),
            block_tables=torch.from_numpy(tables).to(device),
            slot_mapping=torch.from_numpy(np.concatenate(slot_mapping) if slot_mapping else np.zeros(0, np.int64)).to(device),
            query_lens_cpu=list(query_lens),
            context_lens_cpu=list(context_lens),
            checkpoints=tuple(checkpoints),
            row_state_slots=row_state_table(query_lens, context_lens, state_slots, checkpoints, device),
            max_seq_len=max((c + q for q, c in zip(query_lens, context_lens)), default=0),
        )


def row_state_table(query_lens: list[int], context_lens: list[int], state_slots: list[int],
                    checkpoints, device) -> torch.Tensor | None:
    """``ForwardBatch.row_state_slots`` from host lists (None unless a short step)."""
    if not 1 < max(query_lens, default=0) <= SHORT_CHUNK_MAX or min(context_lens) == 0:
        return None
    return torch.from_numpy(row_state_rows(query_lens, state_slots, checkpoints)).to(device)


def row_state_rows(query_lens: list[int], state_slots: list[int], checkpoints) -> np.ndarray:
    """[N, max query_len] int64: the live slot at each sequence's last row, a checkpoint's slot at its
    row, scratch slot 0 elsewhere. A checkpoint at a chunk's last row is not in the table: the KDA
    layer copies the live slot there."""
    table = np.zeros((len(query_lens), max(query_lens)), dtype=np.int64)
    for n, (q, slot) in enumerate(zip(query_lens, state_slots)):
        table[n, q - 1] = slot
    for c in checkpoints:
        if c.num_tokens < query_lens[c.seq]:
            table[c.seq, c.num_tokens - 1] = c.slot
    return table


@dataclass
class HybridCache:
    """Per-sequence inference state of the whole text model.

    kda_conv[l]  [num_slots, 3*P, W-1]  last W-1 raw (pre-conv) q|k|v projections, oldest first
    kda_state[l] [num_slots, H, V, K]   fp32 recurrent state (fp64 for a float64 model), V-first
                                        (fla ``state_v_first=True``)
    mla_latent[l] [num_blocks, block_size / c, D_c]  normalised c_kv (kv_lora_rank) | k_pe (rope dim); under
                                        decode context parallelism (c = ``mla_cache_stripes`` ranks) this rank's
                                        positions p % c == its DCP rank of each block, at row (p % block_size) // c
    ``block_size`` is the engine's (positions per block table entry), whatever the stripes.
    mla_latent rows are in the model dtype, or FP8 (``--kv-cache-dtype fp8``) with
    mla_scale[l]  [num_blocks, block_size / c]   one float32 scale per token row (``kimik3.ops.fp8``);
                                        None for a cache in the model dtype

    FP8 latents take one scale per token (row), not per block: a token's row is written once, by the step
    that computes it (decode appends one row at a time), so a per-token scale needs no read-modify-write of
    a shared block scale and a row's bytes never depend on which tokens share its block (prefix-cache blocks
    stay bit-identical whoever fills them). The scale costs 4 B per 576 B row (0.7%); the dequantisation is
    one multiply per score and per probability in the decode kernel.
    """

    kda_conv: torch.Tensor
    kda_state: torch.Tensor
    mla_latent: torch.Tensor
    block_size: int
    layer_index: dict[int, int] = field(default_factory=dict)  # model layer id -> row in its stack
    mla_scale: torch.Tensor | None = None

    @staticmethod
    def allocate(text_cfg, num_slots: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 latent_dtype: torch.dtype | None = None) -> HybridCache:
        """``latent_dtype``: the MLA latent rows' dtype (None: ``dtype``; float8_e4m3fn adds ``mla_scale``)."""
        kda, mla = text_cfg.cached_layer_ids("kda"), text_cfg.cached_layer_ids("mla")
        k = text_cfg.kda
        conv = torch.zeros(len(kda), num_slots, 3 * k.num_heads * k.head_dim, k.conv_size - 1,
                           dtype=dtype, device=device)
        state = torch.zeros(len(kda), num_slots, k.num_heads, k.head_dim, k.head_dim,
                            dtype=torch.promote_types(dtype, torch.float32), device=device)
        stripes = text_cfg.mla_cache_stripes
        if block_size % stripes:
            raise ValueError(f"block size {block_size} must be a multiple of the decode context parallel size "
                             f"{stripes} (each rank holds block_size / {stripes} positions of every block)")
        latent_dtype = check_latent_dtype(latent_dtype or dtype)
        latent = torch.zeros(len(mla), num_blocks, block_size // stripes, text_cfg.mla_cache_dim, dtype=latent_dtype,
                             device=device)
        scale = None
        if latent_dtype == FP8:
            scale = torch.ones(len(mla), num_blocks, block_size // stripes, dtype=torch.float32, device=device)
        index = {lid: i for i, lid in enumerate(kda)} | {lid: i for i, lid in enumerate(mla)}
        return HybridCache(conv, state, latent, block_size, index, scale)

    def latent_scale(self, row: int) -> torch.Tensor | None:
        """MLA layer ``row``'s per-token scales [num_blocks, block_size] (None: latents in the model dtype)."""
        return None if self.mla_scale is None else self.mla_scale[row]

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        """Copy one sequence's KDA state (all layers) between pool slots."""
        self.kda_conv[:, dst_slot].copy_(self.kda_conv[:, src_slot])
        self.kda_state[:, dst_slot].copy_(self.kda_state[:, src_slot])

    def reset_state(self, slot: int) -> None:
        self.kda_conv[:, slot].zero_()
        self.kda_state[:, slot].zero_()

    def apply_state_ops(self, copies: list[tuple[int, int]], resets: list[int]) -> None:
        """A step's KDA state copies (src, dst), in order, then its resets."""
        for src, dst in copies:
            self.copy_state(src, dst)
        for slot in resets:
            self.reset_state(slot)

    @staticmethod
    def bytes_per_slot(text_cfg, dtype: torch.dtype) -> int:
        k = text_cfg.kda
        n = len(text_cfg.cached_layer_ids("kda"))
        conv = 3 * k.num_heads * k.head_dim * (k.conv_size - 1) * torch.finfo(dtype).bits // 8
        state = k.num_heads * k.head_dim * k.head_dim * torch.finfo(torch.promote_types(dtype, torch.float32)).bits // 8
        return n * (conv + state)

    @staticmethod
    def bytes_per_block(text_cfg, block_size: int, dtype: torch.dtype, latent_dtype: torch.dtype | None = None) -> int:
        """MLA latent bytes of one block over every MLA layer (``latent_dtype`` None: ``dtype``; an FP8 row
        carries its float32 scale); under decode context parallelism this rank's stripe."""
        latent_dtype = check_latent_dtype(latent_dtype or dtype)
        per_rank = block_size // text_cfg.mla_cache_stripes       # decode context parallelism: this rank's stripe
        row = text_cfg.mla_cache_dim * torch.finfo(latent_dtype).bits // 8 + (4 if latent_dtype == FP8 else 0)
        return len(text_cfg.cached_layer_ids("mla")) * per_rank * row


# --kv-cache-dtype: the MLA latent rows' dtype (vLLM's names); KDA states stay float32 (conv windows in the
# model dtype) whatever it says.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": FP8, "fp8_e4m3": FP8}


def latent_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The latent cache's dtype for a ``--kv-cache-dtype`` name and the model dtype."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or dtype


def check_latent_dtype(latent_dtype: torch.dtype) -> torch.dtype:
    if latent_dtype.is_floating_point and latent_dtype.itemsize == 1 and latent_dtype != FP8:
        raise ValueError(f"an FP8 latent cache is float8_e4m3fn (kv_cache_dtype fp8 / fp8_e4m3), got {latent_dtype}")
    return latent_dtype
