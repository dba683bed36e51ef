"""Gated NoPE MLA token mixer (spec token-mixers §4; text-backbone §2.8).

K3: q-LoRA (q_a_proj -> q_a_layernorm -> q_b_proj) and a sigmoid output gate before o_proj.
Kimi-Linear: plain q_proj, no output gate. Neither applies any rotary embedding.
"""

from __future__ import annotations

import torch
from torch import nn

from kimik3.distributed import ParallelContext
from kimik3.model.batch import ForwardBatch
from kimik3.model.layers import MergedLinear, RMSNorm, linear, tp_shards
from kimik3.ops.mla import cache_latent, mla_decode_attention, mla_prefill_attention


class MLAAttention(nn.Module):
    """Under TP (spec parallelism §1.5) the module holds H/t heads: q_b (or q_proj), kv_b, g split
    by heads, o_proj row-parallel (partial all-reduced); q_a, kv_a and their norms replicated, so
    every rank computes and caches the same latent (the latent cache is replicated per rank)."""

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

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: torch.Tensor, plans: dict | None = None) -> torch.Tensor:
        """x [T, D] -> [T, D]; cache [num_blocks, block_size, kv_lora_rank + d_rope] of this layer:
        the new tokens' latents are written at ``batch.slot_mapping`` before attending. ``plans``: the forward
        step's decode plans, shared by its MLA layers (``ops.mla.mla_decode_attention``)."""
        T, H = x.shape[0], self.num_heads
        q, c, *gate = self.in_proj(x).split(list(self.in_proj.parts.values()), dim=-1)
        if hasattr(self, "q_b_proj"):
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(T, H, self.d_nope + self.d_rope)
        cache_latent(c, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, cache, batch.slot_mapping)   # [norm(c_kv) | k_pe]
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
            w = self.kv_b_proj.weight.view(H, self.d_nope + self.d_v, self.kv_lora_rank)
            w_uk, w_uv = w[:, :self.d_nope], w[:, self.d_nope:]                 # [H, d_nope|d_v, r]
            q_latent = torch.einsum("nhd,hdr->nhr", q[..., :self.d_nope], w_uk)
            lat = mla_decode_attention(q_latent, q[..., self.d_nope:], cache, tables, seq_lens,
                                       self.kv_lora_rank, self.scale, max_seq_len=max_len, plans=plans)
            o = torch.einsum("nhr,hvr->nhv", lat, w_uv)
        else:
            o = mla_prefill_attention(q, cache, batch.block_tables, self.kv_b_proj.weight, batch.query_lens_cpu,
                                      batch.context_lens_cpu, self.kv_lora_rank, self.d_v, self.scale)
        o = o.reshape(T, H * self.d_v)
        if gate:
            o = o * torch.sigmoid(gate[0])
        return self.par.all_reduce(self.o_proj(o))
