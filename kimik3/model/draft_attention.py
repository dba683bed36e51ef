"""The attention of draft models (Eagle3's decoder layer, DFlash's block layers): grouped-query attention
with rotary positions (NeoX halves), optional per-head q/k RMSNorm (Qwen3), over a paged key/value cache
that shares the target's block tables.

A draft's cache row for position p lives where the target's latent for p lives (same block id and
offset, its own tensor), so prefix hits, preemption and the end of a request free it with the target's
blocks, and the rows a rejected draft wrote are rewritten when the accepted tokens are caught up, as
the target's MLA latents are (token-mixers §3.4). Rows past the request's allocated blocks (a draft
chain's look-ahead) go to scratch blocks at the end of the draft cache (``DraftBatch.build``).
Shapes: T packed rows of N sequences; KVH key/value heads of width hd; the cache is
[num_blocks, block_size, 2 (k|v), KVH, hd].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kimik3.model.layers import RMSNorm, linear


@dataclass
class DraftBatch:
    """Rows of one draft forward: sequence n owns rows cu[n]:cu[n+1] at positions context_lens[n] ..
    (consecutive); they attend to the cache's first context_lens[n] positions and, causally (or all of
    them, ``causal=False``: a parallel drafter's block), to each other. ``slot_mapping``: the cache row
    each row's key/value is written to (None: not kept, a block that is thrown away after the step)."""

    positions: torch.Tensor          # [T] int64
    cu_seqlens: list[int]            # [N + 1] host
    context_lens: list[int]          # [N] host
    block_tables: torch.Tensor       # [N, W] int64, every block the rows and their context touch
    slot_mapping: torch.Tensor | None
    block_size: int
    causal: bool = True

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @staticmethod
    def build(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int,
              scratch: list[list[int]] | None = None, device="cpu", causal: bool = True, write: bool = True) -> DraftBatch:
        """From host lists. A position whose block sequence n's table lacks takes the next of ``scratch[n]``
        (blocks of the draft cache past the target's, this step's alone); none left: an error naming the row."""
        tables = extend_tables(query_lens, context_lens, block_tables, block_size, scratch)
        slots, positions, cu = [], [], [0]
        for q, c, table in zip(query_lens, context_lens, tables):
            for p in range(c, c + q):
                positions.append(p)
                slots.append(table[p // block_size] * block_size + p % block_size)
            cu.append(cu[-1] + q)
        width = max((len(t) for t in tables), default=1) or 1
        padded = [t + [0] * (width - len(t)) for t in tables]
        as_long = dict(dtype=torch.int64, device=device)
        return DraftBatch(torch.tensor(positions, **as_long), cu, list(context_lens), torch.tensor(padded, **as_long),
                          torch.tensor(slots, **as_long) if write else None, block_size, causal)


def extend_tables(query_lens: list[int], context_lens: list[int], block_tables, block_size: int,
                  scratch: list[list[int]] | None = None) -> list[list[int]]:
    """Each sequence's blocks for positions < context + query: its table, then its scratch blocks."""
    out = []
    for n, (q, c, table) in enumerate(zip(query_lens, context_lens, block_tables)):
        table = [b for b in table if b >= 0]
        free = list(scratch[n]) if scratch else []
        need = -(-(c + q) // block_size)
        while len(table) < need:
            if not free:
                raise ValueError(f"draft rows of sequence {n} reach position {c + q - 1}, past its "
                                 f"{len(table)} block(s) of {block_size}, and no scratch block is left")
            table.append(free.pop(0))
        out.append(table[:max(need, 1)])
    return out


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, NeoX layout (the two halves of each head rotate together): x [T, H, d]."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)
    angle = positions.to(torch.float64)[:, None] * inv_freq[None]                  # [T, d/2]
    acc = torch.promote_types(x.dtype, torch.float32)
    cos, sin = angle.cos().to(acc)[:, None], angle.sin().to(acc)[:, None]
    x1, x2 = x.to(acc).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: DraftBatch, cache: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q [T, H, hd], the rows' own k, v [T, KVH, hd] -> [T, H, hd]: each row over its sequence's cached
    context and the batch's rows of its sequence (causally unless ``batch.causal``); softmax in fp32. All
    sequences at once, padded to the longest: keys [N, context + rows] gathered from the cache by position."""
    H, KVH, hd = q.shape[1], k.shape[1], q.shape[2]
    N, dev, bs = batch.num_seqs, q.device, batch.block_size
    acc = torch.promote_types(q.dtype, torch.float32)
    qlens = [batch.cu_seqlens[n + 1] - batch.cu_seqlens[n] for n in range(N)]
    Q, C = max(qlens), max(batch.context_lens)
    row_seq = torch.repeat_interleave(torch.arange(N, device=dev), torch.tensor(qlens, device=dev), output_size=q.shape[0])
    row_off = torch.arange(q.shape[0], device=dev) - torch.tensor(batch.cu_seqlens[:-1], device=dev)[row_seq]
    ctx = torch.tensor(batch.context_lens, device=dev)
    pos = torch.arange(C, device=dev)
    rows = batch.block_tables.gather(1, (pos // bs).clamp(max=batch.block_tables.shape[1] - 1)[None].expand(N, -1))
    keys_ctx = cache.view(-1, *cache.shape[2:])[rows * bs + pos % bs]                   # [N, C, 2, KVH, hd]
    new_k = q.new_zeros(N, Q, KVH, hd, dtype=k.dtype)
    new_v = q.new_zeros(N, Q, KVH, hd, dtype=v.dtype)
    new_k[row_seq, row_off], new_v[row_seq, row_off] = k, v
    keys = torch.cat([keys_ctx[:, :, 0].to(acc), new_k.to(acc)], 1).repeat_interleave(H // KVH, dim=2)
    vals = torch.cat([keys_ctx[:, :, 1].to(acc), new_v.to(acc)], 1).repeat_interleave(H // KVH, dim=2)
    qp = q.new_zeros(N, Q, H, hd, dtype=acc)
    qp[row_seq, row_off] = q.to(acc)
    s = torch.einsum("nqhd,nkhd->nhqk", qp, keys) * scale                                 # [N, H, Q, C + Q]
    kpos = torch.arange(C + Q, device=dev)
    visible = torch.where(kpos[None, :] < C, kpos[None, :] < ctx[:, None], kpos[None, :] - C < torch.tensor(qlens, device=dev)[:, None])
    visible = visible[:, None, :].expand(N, Q, C + Q)
    if batch.causal:
        visible = visible & ((kpos[None, None, :] - C) <= torch.arange(Q, device=dev)[None, :, None])
    s = s.masked_fill(~visible[:, None], float("-inf"))
    o = torch.einsum("nhqk,nkhd->nqhd", s.softmax(-1), vals)
    return o[row_seq, row_off].to(q.dtype)


class DraftAttention(nn.Module):
    """q/k/v/o projections (bias-free) of a draft layer; ``qk_norm_eps``: Qwen3's per-head norms."""

    def __init__(self, in_features: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope_theta: float, qk_norm_eps: float | None = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads "
                             f"({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim, self.rope_theta = num_heads, num_kv_heads, head_dim, rope_theta
        self.q_proj = linear(in_features, num_heads * head_dim)
        self.k_proj = linear(in_features, num_kv_heads * head_dim)
        self.v_proj = linear(in_features, num_kv_heads * head_dim)
        self.o_proj = linear(num_heads * head_dim, hidden_size)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)

    def key_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, in] -> the rows' k (normed, rotated), v [T, KVH, hd]."""
        k = self.k_proj(x).view(x.shape[0], self.num_kv_heads, self.head_dim)
        if hasattr(self, "k_norm"):
            k = self.k_norm(k)
        return rope(k, positions, self.rope_theta), self.v_proj(x).view(x.shape[0], self.num_kv_heads, self.head_dim)

    def write(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor) -> None:
        """Store the key/values of rows ``x`` (at ``positions``) in cache rows ``slot_mapping`` (a parallel
        drafter's context: the target's states, written as the target computes them)."""
        k, v = self.key_values(x, positions)
        cache.view(-1, *cache.shape[2:])[slot_mapping] = torch.stack([k, v], dim=1).to(cache.dtype)

    def forward(self, x: torch.Tensor, batch: DraftBatch, cache: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q)
        q = rope(q, batch.positions, self.rope_theta)
        k, v = self.key_values(x, batch.positions)
        if batch.slot_mapping is not None:
            cache.view(-1, *cache.shape[2:])[batch.slot_mapping] = torch.stack([k, v], dim=1).to(cache.dtype)
        o = paged_attention(q, k, v, batch, cache, self.head_dim ** -0.5)
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))
