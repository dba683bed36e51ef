"""MLA attention over the paged latent cache (spec token-mixers §4).

Cache rows hold e = [c_hat (kv_lora_rank) | k_pe (rope dim)] per token, one "KV head" shared by
all heads. Two forms compute the same function:
  * prefill (naive): up-project the cached latents with kv_b into per-head k_nope / v, attend with
    keys [k_nope | k_pe] (k_pe shared, never rotated), causal with the sequence's context offset;
  * decode (absorbed): q_lat = W_UK^T q_nope, scores against e directly, latent output
    l = sum p c_hat, head output W_UV l.
"""

from __future__ import annotations

import torch

import torch.nn.functional as F

from kimik3.ops.backend import use_fast_path
from kimik3.ops.norm import acc_dtype


def gather_latents(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Rows 0..length-1 of one sequence from the paged cache [num_blocks, block_size, D_c]."""
    bs = cache.shape[1]
    n_blocks = -(-length // bs)
    return cache[block_table[:n_blocks].long()].reshape(-1, cache.shape[-1])[:length]


def mla_prefill_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                          kv_b_weight: torch.Tensor, query_lens: list[int], context_lens: list[int],
                          kv_lora_rank: int, v_head_dim: int, scale: float) -> torch.Tensor:
    """Causal attention of packed queries over their sequences' cached latents (new tokens
    included: write them to the cache first).

    q [T, H, d_nope + d_rope]; cache [num_blocks, block_size, D_c]; block_tables [N, max_blocks];
    kv_b_weight [H * (d_nope + d_v), kv_lora_rank]. Returns o [T, H, d_v] in q's dtype.
    """
    T, H, d_qk = q.shape
    d_nope = kv_b_weight.shape[0] // H - v_head_dim
    if use_fast_path(q):
        return _prefill_sdpa(q, cache, block_tables, kv_b_weight, query_lens, context_lens, kv_lora_rank,
                             v_head_dim, scale)
    acc = acc_dtype(q.dtype)
    outs, start = [], 0
    for n, (ql, cl) in enumerate(zip(query_lens, context_lens)):
        e = gather_latents(cache, block_tables[n], cl + ql)                 # [S, D_c]
        kv = (e[:, :kv_lora_rank] @ kv_b_weight.t()).view(-1, H, d_nope + v_head_dim)
        k_nope, v = kv[..., :d_nope], kv[..., d_nope:]
        k_pe = e[:, kv_lora_rank:].unsqueeze(1).expand(-1, H, -1)
        key = torch.cat([k_nope, k_pe], dim=-1)                              # [S, H, d_qk]
        qs = q[start:start + ql]
        scores = torch.einsum("qhd,shd->hqs", qs.to(acc), key.to(acc)) * scale
        pos_q = torch.arange(cl, cl + ql, device=q.device).view(ql, 1)
        scores = scores.masked_fill(torch.arange(cl + ql, device=q.device).view(1, -1) > pos_q, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        outs.append(torch.einsum("hqs,shd->qhd", p, v.to(acc)).to(q.dtype))
        start += ql
    return torch.cat(outs)


def mla_decode_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: list[int] | torch.Tensor, kv_lora_rank: int,
                         scale: float, max_seq_len: int | None = None) -> torch.Tensor:
    """Absorbed decode: one query per sequence against its whole cached latent history.

    q_latent [N, H, kv_lora_rank] (= W_UK^T q_nope); q_pe [N, H, d_rope]; seq_lens [N] (host list
    or device tensor) include the new token; max_seq_len bounds them (CUDA sizes its splits with
    it; taken from seq_lens when None). Returns the latent output l [N, H, kv_lora_rank] in
    q_latent's dtype. CUDA: split-K Triton kernel over the paged blocks.
    """
    if use_fast_path(q_latent):
        from kimik3.ops.triton.mla_decode import mla_decode_triton
        if not torch.is_tensor(seq_lens):
            max_seq_len = max(seq_lens) if max_seq_len is None else max_seq_len
            seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=q_latent.device)
        elif max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        return mla_decode_triton(q_latent, q_pe, cache, block_tables, seq_lens, max_seq_len, scale)
    if torch.is_tensor(seq_lens):
        seq_lens = seq_lens.tolist()
    acc = acc_dtype(q_latent.dtype)
    mqa_q = torch.cat([q_latent, q_pe], dim=-1).to(acc)                      # [N, H, D_c]
    outs = []
    for n, length in enumerate(seq_lens):
        e = gather_latents(cache, block_tables[n], length).to(acc)          # [S, D_c]
        p = torch.softmax((mqa_q[n] @ e.t()) * scale, dim=-1)               # [H, S]
        outs.append(p @ e[:, :kv_lora_rank])
    return torch.stack(outs).to(q_latent.dtype)


def _prefill_sdpa(q, cache, block_tables, kv_b_weight, query_lens, context_lens, kv_lora_rank, v_head_dim, scale):
    """The naive form per sequence through torch SDPA (fused attention kernels on CUDA)."""
    T, H, d_qk = q.shape
    d_nope = kv_b_weight.shape[0] // H - v_head_dim
    out = torch.empty(T, H, v_head_dim, dtype=q.dtype, device=q.device)
    start = 0
    for n, (ql, cl) in enumerate(zip(query_lens, context_lens)):
        S = cl + ql
        e = gather_latents(cache, block_tables[n], S).to(q.dtype)                # [S, D_c]
        kv = (e[:, :kv_lora_rank] @ kv_b_weight.t().to(q.dtype)).view(S, H, d_nope + v_head_dim)
        key = torch.cat([kv[..., :d_nope], e[:, kv_lora_rank:].unsqueeze(1).expand(S, H, -1)], dim=-1)
        qs = q[start:start + ql].transpose(0, 1).unsqueeze(0)                    # [1, H, ql, d_qk]
        # v zero-padded to d_qk: equal head dims let SDPA pick its flash kernel
        vs = F.pad(kv[..., d_nope:], (0, max(d_qk - v_head_dim, 0)))
        ks, vs = key.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)
        if cl == 0:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        else:
            allowed = torch.arange(S, device=q.device).view(1, S) <= torch.arange(cl, S, device=q.device).view(ql, 1)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale)
        out[start:start + ql] = o.squeeze(0).transpose(0, 1)[..., :v_head_dim]
        start += ql
    return out
