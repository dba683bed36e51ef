"""Gated NoPE MLA token mixer (spec token-mixers §4; text-backbone §2.8).

K3: q-LoRA (q_a_proj -> q_a_layernorm -> q_b_proj) and a sigmoid output gate before o_proj.
Kimi-Linear: plain q_proj, no output gate. Neither applies any rotary embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kimik3.distributed import ParallelContext
from kimik3.model.batch import ForwardBatch
from kimik3.model.layers import MergedLinear, RMSNorm, linear, tp_shards
from kimik3.ops.mla import cache_latent, merge_attention, mla_decode_attention, mla_prefill_attention


class MLAAttention(nn.Module):
    """Under TP (spec parallelism §1.5) the module holds H/t heads: q_b (or q_proj), kv_b, g split
    by heads, o_proj row-parallel (partial all-reduced); q_a, kv_a and their norms replicated, so
    every rank computes and caches the same latent (the latent cache is replicated per rank), or, under
    decode context parallelism, each rank of a DCP group caches its stripe of the positions."""

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 use_output_gate: bool, latent_norm_eps: float, parallel: ParallelContext | None = None):
        super().__init__()
        self.par = par = parallel or ParallelContext()
        _, H = par.split(num_heads, "MLA heads") if par.enabled else (0, num_heads)
        self.num_heads, self.kv_lora_rank = H, kv_lora_rank
        self.d_nope, self.d_rope, self.d_v = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        d_qk = qk_nope_head_dim + qk_rope_head_dim
        self.scale = d_qk ** -0.5
        # everything read from x in one GEMM: the query (q_a [q_lora_rank], or q [H d_qk]), the latent
        # with the rope key [kv_lora_rank + d_rope], and K3's output gate g [H d_v]
        query = {"q_a_proj": q_lora_rank} if q_lora_rank is not None else {"q_proj": H * d_qk}
        self.in_proj = MergedLinear(hidden_size, {**query, "kv_a_proj_with_mqa": kv_lora_rank + qk_rope_head_dim,
                                                  **({"g_proj": H * v_head_dim} if use_output_gate else {})})
        if q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(q_lora_rank, latent_norm_eps)
            self.q_b_proj = linear(q_lora_rank, H * d_qk)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, latent_norm_eps)
        self.kv_b_proj = linear(kv_lora_rank, H * (qk_nope_head_dim + v_head_dim))
        self.o_proj = linear(H * v_head_dim, hidden_size)
        self.tp_shards = tp_shards(par, q_b_proj__weight=0, q_proj__weight=0, kv_b_proj__weight=0, g_proj__weight=0,
                                   o_proj__weight=1)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: torch.Tensor, plans: dict | None = None,
                cache_scale: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, D] -> [T, D]; cache [num_blocks, block_size, kv_lora_rank + d_rope] of this layer:
        the new tokens' latents are written at ``batch.slot_mapping`` before attending. ``plans``: the forward
        step's decode plans, shared by its MLA layers (``ops.mla.mla_decode_attention``). ``cache_scale``
        [num_blocks, block_size]: an FP8 cache's per-token scales (``HybridCache.mla_scale``)."""
        T, H = x.shape[0], self.num_heads
        q, c, *gate = self.in_proj(x).split(list(self.in_proj.parts.values()), dim=-1)
        if hasattr(self, "q_b_proj"):
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(T, H, self.d_nope + self.d_rope)
        if self.par.dcp_size > 1:
            o = self._context_parallel(q, c, batch, cache, plans, cache_scale)
        else:
            o = self._attend(q, c, batch, cache, plans, cache_scale)
        o = o.reshape(T, H * self.d_v)
        if gate:
            o = o * torch.sigmoid(gate[0])
        return self.par.all_reduce(self.o_proj(o))

    def write_latent(self, x: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> None:
        """The latents of rows x [T, D] alone (what ``forward`` caches for them) into cache rows ``slots``:
        a draft layer's catch-up with positions it does not attend from."""
        c = self.in_proj(x).split(list(self.in_proj.parts.values()), dim=-1)[1]
        cache_latent(c, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, cache, slots)

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.num_heads, self.d_nope + self.d_v, self.kv_lora_rank)
        return w[:, :self.d_nope], w[:, self.d_nope:]                       # W_UK, W_UV [H, d_nope|d_v, r]

    def _attend(self, q, c, batch: ForwardBatch, cache: torch.Tensor, plans: dict | None,
                cache_scale: torch.Tensor | None) -> torch.Tensor:
        """Attention of q [T, H, d_qk] over the whole latent cache (written first) -> [T, H, d_v]."""
        cache_latent(c, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, cache, batch.slot_mapping,
                     cache_scale)                                                   # [norm(c_kv) | k_pe]
        if batch.is_decode or batch.row_state_slots is not None:
            # decode rows (device ops, no host sync); a short step's row j of a chunk attends like a
            # decode row over its context + j + 1 keys
            if batch.is_decode:
                tables, seq_lens = batch.block_tables, batch.context_lens + 1
            else:
                seq, offset = batch.row_positions()
                tables, seq_lens = batch.block_tables[seq], batch.context_lens[seq] + offset + 1
            max_len = batch.max_seq_len if batch.max_seq_len is not None else \
                max(c + q for c, q in zip(batch.context_lens_cpu, batch.query_lens_cpu))
            w_uk, w_uv = self._absorbed()
            q_latent = torch.einsum("nhd,hdr->nhr", q[..., :self.d_nope], w_uk)
            lat = mla_decode_attention(q_latent, q[..., self.d_nope:], cache, tables, seq_lens,
                                       self.kv_lora_rank, self.scale, max_seq_len=max_len, plans=plans,
                                       cache_scale=cache_scale)
            return torch.einsum("nhr,hvr->nhv", lat, w_uv)
        return mla_prefill_attention(q, cache, batch.block_tables, self.kv_b_proj.weight, batch.query_lens_cpu,
                                     batch.context_lens_cpu, self.kv_lora_rank, self.d_v, self.scale,
                                     cache_scale=cache_scale)

    def _context_parallel(self, q, c, batch: ForwardBatch, cache: torch.Tensor, plans: dict | None,
                          cache_scale: torch.Tensor | None) -> torch.Tensor:
        """Decode context parallelism (spec parallelism §4.4): this rank's cache holds the positions p with
        p % dcp == its DCP rank (``dcp_stripe``); it writes only its new tokens' latents, attends the absorbed
        queries of all the DCP group's heads over its positions (every row as a decode row whose keys are
        its positions <= the row's own), and the group merges each head's partials by their log-sum-exps
        (``merge_attention``, the split-KV merge). -> [T, H, d_v]"""
        par = self.par
        stripe = dcp_stripe(batch, cache.shape[1], par.dcp_size, par.dcp_rank, plans)
        cache_latent(c, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, cache, stripe.slots, cache_scale)
        w_uk, w_uv = self._absorbed()
        R = self.kv_lora_rank
        q_latent = torch.einsum("nhd,hdr->nhr", q[..., :self.d_nope], w_uk)
        qs = par.dcp_gather_heads(torch.cat([q_latent, q[..., self.d_nope:]], dim=-1))     # [T, c*H, R + P]
        lat, lse = mla_decode_attention(qs[..., :R], qs[..., R:], cache, stripe.tables, stripe.lens, R,
                                        self.scale, max_seq_len=stripe.max_len, return_lse=True,
                                        cache_scale=cache_scale)
        acc = lse.dtype
        parts = par.dcp_scatter_heads(torch.cat([lat.to(acc), lse.unsqueeze(-1)], dim=-1))  # [c, T, H, R + 1]
        o, m = parts[0, ..., :R], parts[0, ..., R]
        for part in parts[1:]:
            o, m = merge_attention(o, m, part[..., :R], part[..., R])
        return torch.einsum("nhr,hvr->nhv", o.to(q.dtype), w_uv)


@dataclass
class DCPStripe:
    """One forward step's view of this rank's latent stripe, shared by its MLA layers: the cache row of each
    new token this rank owns (the null row 0 for the others), and per packed row its sequence's block
    table, its keys here (positions <= the row's own on this rank) and their bound."""

    slots: torch.Tensor          # [T] int64
    tables: torch.Tensor         # [T, max_blocks]
    lens: torch.Tensor           # [T] int64
    max_len: int


def dcp_stripe(batch: ForwardBatch, rows_per_block: int, c: int, r: int, plans: dict | None) -> DCPStripe:
    """Position p of a sequence lives on DCP rank p % c, in block p // (c * rows_per_block) of its table (the
    engine's block of c * rows_per_block positions) at row (p % block) // c; the rank's keys up to p are the
    first (p + c - r) // c of its positions (device ops: a CUDA graph can hold them)."""
    key = ("dcp_stripe", c, r)
    if plans is not None and key in plans:
        return plans[key]
    seq, offset = batch.row_positions()
    pos = batch.context_lens[seq] + offset
    block = c * rows_per_block
    # a pure decode step's rows are its sequences; else each row copies its table (O(T x max_blocks): a long
    # prefill chunk under DCP would rather pass the row -> sequence index to the kernel)
    tables = batch.block_tables if batch.is_decode else batch.block_tables[seq]
    local = tables.gather(1, (pos // block).unsqueeze(1)).squeeze(1).long() * rows_per_block + (pos % block) // c
    bound = batch.max_seq_len if batch.max_seq_len is not None else \
        max((ctx + ql for ctx, ql in zip(batch.context_lens_cpu, batch.query_lens_cpu)), default=0)
    stripe = DCPStripe(torch.where(pos % c == r, local, torch.zeros_like(local)), tables, (pos + c - r) // c,
                       -(-bound // c))
    if plans is not None:
        plans[key] = stripe
    return stripe
