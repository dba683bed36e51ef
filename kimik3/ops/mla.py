"""MLA attention over the paged latent cache (spec token-mixers §4).

Cache rows hold e = [c_hat (kv_lora_rank) | k_pe (rope dim)] per token, one "KV head" shared by
all heads. Two forms compute the same function:
  * naive (prefill): up-project the cached latents with kv_b into per-head k_nope / v, attend with
    keys [k_nope | k_pe] (k_pe shared, never rotated), causal with the sequence's context offset;
  * absorbed (decode; prefill of short query runs): q_lat = W_UK^T q_nope, scores against e
    directly, latent output l = sum p c_hat, head output W_UV l.
Prefill walks the keys in pieces of at most ``KernelTuning.mla_prefill_block`` positions and merges the pieces'
softmax results by their log-sum-exps (``merge_attention``).

FP8 cache (``--kv-cache-dtype fp8``): rows are float8_e4m3fn codes with one float32 scale per token
(``cache_scale`` [num_blocks, block_size], ``kimik3.ops.fp8.quantize_rows``), written by
``cache_latent`` from the row in the model dtype. Decode's Triton kernel loads the codes and the
scales and applies them to the scores and probabilities; prefill dequantises while it gathers a
piece's rows (the kernel reads that packed copy, not the paged cache); the references dequantise.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from kimik3.ops.backend import use_fast_kernel, use_fast_path
from kimik3.ops.fp8 import dequantize_rows, quantize_rows
from kimik3.ops.norm import acc_dtype, rms_norm
from kimik3.ops.options import tuning


def cache_latent(c: torch.Tensor, norm_weight: torch.Tensor, eps: float, cache: torch.Tensor,
                 slots: torch.Tensor, cache_scale: torch.Tensor | None = None) -> None:
    """New cache rows: c [T, R + P] (kv_a_proj_with_mqa's output) -> row slots[t] of the flattened cache
    [..., R + P] = [rms_norm(c[t, :R]) (kv_a_layernorm: ``kimik3.ops.norm.rms_norm``) | c[t, R:]], in the
    cache's dtype; with ``cache_scale`` (an FP8 cache) the row in c's dtype quantised, its scale at
    slots[t] of the flattened scales. CUDA (c in the cache's dtype, or any kernel dtype for an FP8 cache):
    one Triton kernel (the norm, the copy, the quantisation and the scatter)."""
    R = norm_weight.shape[0]
    same = c.dtype == cache.dtype if cache_scale is None else cache.dtype == torch.float8_e4m3fn
    if use_fast_kernel(c, norm_weight) and same and c.stride(-1) == 1 and cache.is_contiguous() and \
            (cache_scale is None or cache_scale.is_contiguous()):
        from kimik3.ops.triton.norm import cache_latent_triton
        return cache_latent_triton(c, norm_weight, eps, cache, slots, cache_scale)
    latent = torch.cat([rms_norm(c[:, :R], norm_weight, eps), c[:, R:]], dim=-1)
    if cache_scale is None:
        cache.view(-1, cache.shape[-1])[slots] = latent.to(cache.dtype)
        return
    codes, scale = quantize_rows(latent)
    cache.view(-1, cache.shape[-1])[slots] = codes
    cache_scale.view(-1)[slots] = scale


def cache_rows(cache: torch.Tensor, cache_scale: torch.Tensor | None, rows: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """Rows ``rows`` of the flattened cache in ``dtype``: as stored, or an FP8 row times its scale."""
    e = cache.view(-1, cache.shape[-1])[rows]
    return e.to(dtype) if cache_scale is None else dequantize_rows(e, cache_scale.reshape(-1)[rows], dtype)


def gather_latents(cache: torch.Tensor, block_table: torch.Tensor, length: int,
                   cache_scale: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rows 0..length-1 of one sequence from the paged cache [num_blocks, block_size, D_c], in ``dtype``
    (None: as stored; an FP8 cache needs a dtype and its ``cache_scale``)."""
    bs = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    rows = block_table[pos // bs].long() * bs + pos % bs
    if dtype is None:
        if cache_scale is not None:
            raise ValueError("gather_latents: an FP8 cache's rows are read in a dtype (dtype=...)")
        return cache.view(-1, cache.shape[-1])[rows]
    return cache_rows(cache, cache_scale, rows, dtype)


# The prefill piece (``KernelTuning.mla_prefill_block``) and the absorbed form's reach
# (``KernelTuning.mla_absorbed_max_query_len``): ``options.py``, with their reasons.

FORMS = ("naive", "absorbed")


def prefill_form(query_len: int, context_len: int) -> str:
    """The form ``mla_prefill_attention`` gives one sequence when the caller names none."""
    return "absorbed" if context_len > 0 and query_len < tuning().mla_absorbed_max_query_len else "naive"


def merge_attention(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                    lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two softmax attention results over disjoint key sets: o [..., D] each
    normalised over its own keys, lse [...] their natural-log log-sum-exps (-inf: no key, o 0).
    Computed in the inputs' dtype (float64 in the CPU tests, float32 on CUDA)."""
    m = torch.maximum(lse1, lse2)
    m = m.masked_fill(m == float("-inf"), 0.0)                       # neither saw a key
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2
    inv = 1.0 / total.masked_fill(total == 0, 1.0)
    o = torch.addcmul(o1 * (w1 * inv).unsqueeze(-1), o2, (w2 * inv).unsqueeze(-1))
    return o, m + torch.log(total)


def prefill_pieces(query_lens: list[int], context_lens: list[int], block: int) -> list[tuple[list[int], list[int]]]:
    """Key positions 0..context+query-1 of every sequence (none for a sequence without queries),
    packed in order into pieces of at most ``block`` keys in all, each holding one contiguous run
    per sequence: [(k_lens, k_pos0)] with k_lens[n] keys of sequence n from position k_pos0[n]."""
    N = len(query_lens)
    pieces, k_lens, k_pos0, room = [], [0] * N, [0] * N, block
    for n, (ql, cl) in enumerate(zip(query_lens, context_lens)):
        pos, end = 0, (cl + ql) if ql else 0
        while pos < end:
            take = min(room, end - pos)
            k_lens[n], k_pos0[n] = take, pos
            pos, room = pos + take, room - take
            if room == 0:
                pieces.append((k_lens, k_pos0))
                k_lens, k_pos0, room = [0] * N, [0] * N, block
    if room < block:
        pieces.append((k_lens, k_pos0))
    return pieces


def mla_prefill_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                          kv_b_weight: torch.Tensor, query_lens: list[int], context_lens: list[int],
                          kv_lora_rank: int, v_head_dim: int, scale: float, form: str | None = None,
                          cache_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed queries over their sequences' cached latents (new tokens
    included: write them to the cache first).

    q [T, H, d_nope + d_rope]; cache [num_blocks, block_size, D_c]; block_tables [N, max_blocks];
    kv_b_weight [H * (d_nope + d_v), kv_lora_rank]. Returns o [T, H, d_v] in q's dtype.
    cache_scale [num_blocks, block_size]: an FP8 cache's per-token scales (rows dequantised as gathered).
    form: "naive" (per-head K/V up-projected from each piece's latents), "absorbed" (attention in
    the latent space: q_lat = W_UK^T q_nope, output W_UV l) for every sequence, or None: each
    sequence by ``prefill_form`` (a step mixing long chunks and decode-like rows runs both,
    so the decode rows never re-expand their whole history).

    The keys are processed in pieces of at most ``KernelTuning.mla_prefill_block`` positions over all sequences
    (``prefill_pieces``), each attended with the causal bound as numbers and merged into a running
    (o, lse) exactly; memory O(T x H x d + ``KernelTuning.mla_prefill_block`` x H x d), never O(T x context x H).
    CUDA: one varlen Triton launch per piece (split-K over the keys when the queries are too few
    to fill the GPU; head dims that are powers of two >= 16); otherwise a per-sequence torch loop per piece.
    """
    T, H, _ = q.shape
    if len(query_lens) != len(context_lens) or sum(query_lens) != T:
        raise ValueError(f"mla_prefill_attention: query_lens (sum {sum(query_lens)}, {len(query_lens)} sequences) "
                         f"must sum to q's {T} tokens and match context_lens ({len(context_lens)})")
    if form is not None and form not in FORMS:
        raise ValueError(f"mla_prefill_attention: form must be one of {FORMS} or None, got {form!r}")
    forms = [form or prefill_form(ql, cl) for ql, cl in zip(query_lens, context_lens)]
    if len(set(forms)) <= 1:
        return _prefill(q, cache, block_tables, kv_b_weight, query_lens, context_lens, kv_lora_rank, v_head_dim,
                        scale, forms[0] if forms else "naive", cache_scale)
    out = q.new_empty(T, H, v_head_dim)
    starts = [0, *itertools.accumulate(query_lens)]
    for f in FORMS:
        seqs = [n for n, fn in enumerate(forms) if fn == f]
        rows = torch.tensor([t for n in seqs for t in range(starts[n], starts[n + 1])], device=q.device)
        out[rows] = _prefill(q[rows], cache, block_tables[torch.tensor(seqs, device=q.device)], kv_b_weight,
                             [query_lens[n] for n in seqs], [context_lens[n] for n in seqs], kv_lora_rank,
                             v_head_dim, scale, f, cache_scale)
    return out


def _prefill(q, cache, block_tables, kv_b_weight, query_lens, context_lens, kv_lora_rank, v_head_dim, scale, form,
             cache_scale=None):
    """``mla_prefill_attention`` with one form for every sequence."""
    T, H, _ = q.shape
    R, dv = kv_lora_rank, v_head_dim
    d_nope = kv_b_weight.shape[0] // H - dv
    d_rope = q.shape[-1] - d_nope
    fast = use_fast_path(q)
    if fast:        # head dims (qa / qb / v) the kernel does not take (small test models) use the reference
        from kimik3.ops.triton.mla_prefill import mla_prefill_triton, takes_head_dims
        fast = takes_head_dims(*((d_nope, d_rope, dv) if form == "naive" else (R, d_rope)))
    dt = q.dtype if fast else acc_dtype(q.dtype)
    kv_b = kv_b_weight.to(dt)
    w = kv_b.view(H, d_nope + dv, R)
    qa = torch.einsum("thd,hdr->thr", q[..., :d_nope].to(dt), w[:, :d_nope]) if form == "absorbed" else q[..., :d_nope]
    qa, qb = qa.to(dt), q[..., d_nope:].to(dt)
    pieces = prefill_pieces(query_lens, context_lens, tuning().mla_prefill_block)
    if fast:
        cu_q, q_pos0 = _device_ints([0, *itertools.accumulate(query_lens)], context_lens, q.device)
        # a single piece is the answer: no merge, straight to the output dtype
        part_dtype = (q.dtype if form == "naive" else dt) if len(pieces) == 1 else torch.float32
    o = lse = None
    for k_lens, k_pos0 in pieces:
        cu_k, k_start = _device_ints([0, *itertools.accumulate(k_lens)], k_pos0, q.device)
        e = _gather_piece(cache, cache_scale, block_tables, cu_k, k_start, sum(k_lens), dt)   # [S, D_c]
        if form == "naive":
            kv = F.linear(e[:, :R], kv_b).view(-1, H, d_nope + dv)
            ka, v = kv[..., :d_nope], kv[..., d_nope:]
        else:
            ka, v = e[:, :R].unsqueeze(1), None                                     # one latent head; v = c_hat
        kb = e[:, R:].unsqueeze(1)                                                   # k_pe, shared by all heads
        if fast:
            ob, lseb = mla_prefill_triton(qa, qb, ka, kb, v, cu_q, cu_k, q_pos0, k_start, max(query_lens), scale,
                                          part_dtype, max_key_len=max(k_lens))
        else:
            ob, lseb = _attend_piece_reference(qa, qb, ka, kb, v, query_lens, context_lens, k_lens, k_pos0, scale)
        o, lse = (ob, lseb) if o is None else merge_attention(o, lse, ob, lseb)
    if o is None:                                                                    # no tokens
        return q.new_empty(0, H, dv)
    if form == "absorbed":
        o = torch.einsum("thr,hvr->thv", o.to(dt), w[:, d_nope:])
    return o.to(q.dtype)


def _device_ints(a: list[int], b: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two int32 lists on the device in one copy, the second from a 16-byte boundary: Triton
    specialises a pointer on its alignment, so an offset that follows the batch size (N + 1 entries)
    compiled a second variant of the prefill kernel for half the batch sizes (3.4 s of a served first
    pass at 3dd9428)."""
    off = -(-len(a) // 4) * 4
    both = torch.tensor(a + [0] * (off - len(a)) + b, dtype=torch.int32).to(device, non_blocking=True)
    return both[:len(a)], both[off:]


def _gather_piece(cache: torch.Tensor, cache_scale: torch.Tensor | None, block_tables: torch.Tensor,
                  cu_k: torch.Tensor, k_pos0: torch.Tensor, S: int, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows of one piece in ``dtype``, packed: sequence n's positions k_pos0[n] .. k_pos0[n] + k_len - 1
    at rows cu_k[n] .. cu_k[n + 1] - 1 (cu_k [N + 1], k_pos0 [N] on the cache's device)."""
    bs, N = cache.shape[1], k_pos0.numel()
    seq = torch.repeat_interleave(torch.arange(N, device=cache.device), cu_k[1:] - cu_k[:-1], output_size=S)
    pos = torch.arange(S, device=cache.device) - cu_k[seq] + k_pos0[seq]
    slot = block_tables[seq, pos // bs].long() * bs + pos % bs
    return cache_rows(cache, cache_scale, slot, dtype)


def _heads(x: torch.Tensor, H: int) -> torch.Tensor:
    """[S, Hk, D] -> [S, H, D]: query head h reads kv head h // (H / Hk)."""
    return x.expand(-1, H, -1) if x.shape[1] == 1 else x.repeat_interleave(H // x.shape[1], dim=1)


def _attend_piece_reference(qa, qb, ka, kb, v, query_lens, q_pos0, k_lens, k_pos0, scale):
    """Torch counterpart of ``mla_prefill_triton`` (same arguments, host lists): per sequence,
    scores over its keys of the piece with the causal bound, softmax, (o, lse) per row."""
    T, H, _ = qa.shape
    v = ka if v is None else v
    o = qa.new_zeros(T, H, v.shape[-1])
    lse = qa.new_full((T, H), float("-inf"))
    qs = ks = 0
    for ql, cl, kl, k0 in zip(query_lens, q_pos0, k_lens, k_pos0):
        if ql and kl:
            keys = slice(ks, ks + kl)
            s = (torch.einsum("qhd,khd->hqk", qa[qs:qs + ql], _heads(ka[keys], H))
                 + torch.einsum("qhd,khd->hqk", qb[qs:qs + ql], _heads(kb[keys], H))) * scale
            visible = torch.arange(k0, k0 + kl, device=qa.device).view(1, kl) <= \
                torch.arange(cl, cl + ql, device=qa.device).view(ql, 1)
            s = s.masked_fill(~visible, float("-inf"))
            m = torch.logsumexp(s, dim=-1)                                           # [H, ql]
            p = torch.exp(s - m.masked_fill(m == float("-inf"), 0.0).unsqueeze(-1))
            o[qs:qs + ql] = torch.einsum("hqk,khd->qhd", p, _heads(v[keys], H))
            lse[qs:qs + ql] = m.t()
        qs, ks = qs + ql, ks + kl
    return o, lse


def mla_decode_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: list[int] | torch.Tensor, kv_lora_rank: int,
                         scale: float, max_seq_len: int | None = None, plans: dict | None = None,
                         return_lse: bool = False, cache_scale: torch.Tensor | None = None):
    """Absorbed decode: one query per sequence against its whole cached latent history.

    q_latent [N, H, kv_lora_rank] (= W_UK^T q_nope); q_pe [N, H, d_rope]; seq_lens [N] (host list
    or device tensor) include the new token; max_seq_len bounds them (CUDA sizes its splits with
    it; taken from seq_lens when None). Returns the latent output l [N, H, kv_lora_rank] in
    q_latent's dtype. CUDA: split-K Triton kernel over the paged blocks, or DeepSeek's FlashMLA (opt-in,
    64-token blocks: ``cuda/flash_mla.py``). ``plans``: a dict that lives for one forward step, whose MLA layers
    all attend over the same sequence lengths: FlashMLA's split schedule of those lengths is computed by the first
    layer and kept there for the others (one launch a step instead of one a layer).
    ``return_lse``: also return each (sequence, head)'s natural-log log-sum-exp of its scaled scores [N, H]
    (float32; float64 for a float64 model), to merge partial results over disjoint keys (``merge_attention``:
    decode context parallelism); a sequence of length 0 gives output 0 and lse -inf. FlashMLA is not used then.
    cache_scale [num_blocks, block_size]: an FP8 cache's per-token scales (FlashMLA's dense decode reads
    bf16 rows only: an FP8 cache runs our kernel, which says so once).
    """
    if use_fast_path(q_latent):
        from kimik3.ops.cuda.flash_mla import flash_mla_applies, flash_mla_decode, flash_mla_schedule
        from kimik3.ops.triton.mla_decode import mla_decode_triton
        if not torch.is_tensor(seq_lens):
            max_seq_len = max(seq_lens) if max_seq_len is None else max_seq_len
            seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=q_latent.device)
        if not return_lse and flash_mla_applies(q_latent, q_pe, cache, scaled=cache_scale is not None):
            plans = {} if plans is None else plans
            key = ("flash_mla_schedule", q_latent.shape[1])
            if key not in plans:
                plans[key] = flash_mla_schedule(seq_lens, q_latent.shape[1])
            return flash_mla_decode(q_latent, q_pe, cache, block_tables, seq_lens, scale, plans[key])
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        return mla_decode_triton(q_latent, q_pe, cache, block_tables, seq_lens, max_seq_len, scale,
                                 return_lse=return_lse, cache_scale=cache_scale)
    if torch.is_tensor(seq_lens):
        seq_lens = seq_lens.tolist()
    acc = acc_dtype(q_latent.dtype)
    mqa_q = torch.cat([q_latent, q_pe], dim=-1).to(acc)                      # [N, H, D_c]
    N, H = q_latent.shape[:2]
    out = q_latent.new_zeros(N, H, kv_lora_rank, dtype=acc)
    lse = q_latent.new_full((N, H), float("-inf"), dtype=acc)
    for group in _length_groups(seq_lens):
        _decode_group(mqa_q, cache, block_tables, seq_lens, group, kv_lora_rank, scale, cache_scale, out, lse)
    return (out.to(q_latent.dtype), lse) if return_lse else out.to(q_latent.dtype)


DECODE_GROUP_ROWS = 1 << 16     # the CPU decode path gathers at most this many latent rows at once


def _length_groups(seq_lens: list[int]) -> list[list[int]]:
    """Sequences of length > 0 in groups (by length, longest first) whose padded gathers stay within
    ``DECODE_GROUP_ROWS`` rows (a long sequence alone when it needs more)."""
    order = sorted((n for n, length in enumerate(seq_lens) if length > 0), key=lambda n: -seq_lens[n])
    groups: list[list[int]] = []
    for n in order:
        if groups and (len(groups[-1]) + 1) * seq_lens[groups[-1][0]] <= DECODE_GROUP_ROWS:
            groups[-1].append(n)
        else:
            groups.append([n])
    return groups


def _decode_group(mqa_q, cache, block_tables, seq_lens, group, R, scale, cache_scale, out, lse) -> None:
    """``mla_decode_attention``'s CPU path for the sequences ``group``, padded to the longest of them."""
    dev, bs = mqa_q.device, cache.shape[1]
    idx = torch.tensor(group, device=dev)
    lens = torch.tensor([seq_lens[n] for n in group], device=dev)
    L = seq_lens[group[0]]
    pos = torch.arange(L, device=dev)
    tables = block_tables[idx].long()
    blocks = tables.gather(1, (pos // bs).clamp(max=tables.shape[1] - 1)[None].expand(len(group), -1))
    valid = pos[None] < lens[:, None]                                        # [G, L]
    rows = (blocks.clamp(min=0) * bs + pos % bs).masked_fill(~valid, 0)
    e = cache_rows(cache, cache_scale, rows.reshape(-1), mqa_q.dtype).view(len(group), L, -1)
    e = e.masked_fill(~valid[..., None], 0.0)                               # rows past a sequence: not read
    s = torch.einsum("ghd,gld->ghl", mqa_q[idx], e) * scale                  # [G, H, L]
    s = s.masked_fill(~valid[:, None], float("-inf"))
    m = torch.logsumexp(s, dim=-1)                                           # [G, H]
    lse[idx] = m
    out[idx] = torch.einsum("ghl,glr->ghr", torch.exp(s - m.unsqueeze(-1)), e[..., :R])
