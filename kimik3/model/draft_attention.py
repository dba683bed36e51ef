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

A row's key and value depend on the row's own input only, so a draft catches its cache up with the
target's positions by writing them (``DraftAttention.write``) without attending; a forward whose rows are
written (``slot_mapping``) writes them first and then reads every key it attends to from the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kimik3.distributed import ParallelContext
from kimik3.model.layers import RMSNorm, linear
from kimik3.ops.linear import linear as linear_op


@dataclass
class DraftBatch:
    """Rows of one draft forward: sequence n owns rows cu[n]:cu[n+1] at positions context_lens[n] ..
    (consecutive); they attend to the cache's first context_lens[n] positions and, causally (or all of
    them, ``causal=False``: a parallel drafter's block), to each other. ``slot_mapping``: the cache row
    each row's key/value is written to (None: not kept, a block that is thrown away after the step).
    ``key_rows`` [N, L]: the cache row of each key position a sequence reads (its context, and its own
    rows when they are written; padded with a row of its own); ``visible`` [N, Q, L (+ Q when not written)]:
    which keys each query row (padded to Q) sees."""

    positions: torch.Tensor          # [T] int64
    cu_seqlens: list[int]            # [N + 1] host
    context_lens: list[int]          # [N] host
    block_tables: torch.Tensor       # [N, W] int64, every block the rows and their context touch
    slot_mapping: torch.Tensor | None
    block_size: int
    causal: bool = True
    key_rows: torch.Tensor | None = None
    visible: torch.Tensor | None = None
    max_position: int = 0            # host bound of ``positions`` (rotary tables)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def query_lens(self) -> list[int]:
        return [b - a for a, b in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:])]

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
        padded = [t + [t[0] if t else 0] * (width - len(t)) for t in tables]
        as_long = dict(dtype=torch.int64, device=device)
        table_t = torch.tensor(padded, **as_long)
        # the keys each sequence reads: its context, and its own rows when they are written first
        ends = [c + q for c, q in zip(context_lens, query_lens)] if write else list(context_lens)
        L, Q = max(max(ends, default=0), 1), max(max(query_lens, default=0), 1)
        pos = torch.arange(L, device=device)
        key_rows = table_t.gather(1, (pos // block_size).clamp(max=width - 1)[None].expand(len(tables), -1)) \
            * block_size + pos % block_size
        ctx = torch.tensor(context_lens, **as_long)
        qlen = torch.tensor(query_lens, **as_long)
        qi = torch.arange(Q, device=device)
        if write:       # key position l is visible from query row i of sequence n: l <= its position (causal)
            last = ctx[:, None] + (qi[None] if causal else qlen[:, None] - 1)          # [N, Q]
            visible = pos[None, None] <= last[:, :, None]
        else:           # the context (l < context) and, non-causally or causally, the block's rows
            in_ctx = (pos[None] < ctx[:, None])[:, None].expand(-1, Q, -1)
            own = qi[None, None] < (qlen[:, None, None] if not causal else qi[None, :, None] + 1)
            visible = torch.cat([in_ctx, own.expand(len(tables), Q, Q)], dim=-1)
        return DraftBatch(torch.tensor(positions, **as_long), cu, list(context_lens), table_t,
                          torch.tensor(slots, **as_long) if write else None, block_size, causal, key_rows, visible,
                          max(positions, default=0))


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


class RotaryTable:
    """``rope`` by table lookup: [cos | cos] and [-sin | sin] of every position up to the largest seen (grown by
    doubling, float64 angles), in the accumulation dtype; x * C + roll(x, d/2) * S rotates both halves at once."""

    def __init__(self, head_dim: int, theta: float):
        self.head_dim, self.theta = head_dim, theta
        self.cos = self.sin = None

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, max_position: int) -> torch.Tensor:
        acc = torch.promote_types(x.dtype, torch.float32)
        if self.cos is None or self.cos.shape[0] <= max_position or self.cos.dtype != acc or self.cos.device != x.device:
            n = max(64, 1 << max_position.bit_length())
            inv_freq = self.theta ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=x.device)
                                      / self.head_dim)
            angle = torch.arange(n, dtype=torch.float64, device=x.device)[:, None] * inv_freq[None]
            cos, sin = angle.cos(), angle.sin()
            self.cos, self.sin = torch.cat([cos, cos], -1).to(acc), torch.cat([-sin, sin], -1).to(acc)
        xa = x.to(acc)
        out = xa * self.cos[positions][:, None] + xa.roll(self.head_dim // 2, -1) * self.sin[positions][:, None]
        return out.to(x.dtype)


class FusedWeight:
    """The row-wise concatenation of some projections' weights, for one GEMM where a step reads them all
    (inference only: rebuilt whenever one of them changes, in place or replaced)."""

    def __init__(self):
        self.key, self.weight = None, None

    def __call__(self, *mods) -> torch.Tensor | None:
        if torch.is_grad_enabled() or any(m.weight_scale is not None for m in mods):
            return None                                   # training, or FP8 weights: the projections one by one
        key = tuple((m.weight.data_ptr(), _version(m.weight)) for m in mods)
        if key != self.key:
            self.weight, self.key = torch.cat([m.weight for m in mods]), key
        return self.weight


def _version(t: torch.Tensor) -> int:
    """``t``'s in-place modification count (an inference tensor has none: -1)."""
    return -1 if t.is_inference() else t._version


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: DraftBatch, cache: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q [T, H, hd], the rows' own k, v [T, KVH, hd] -> [T, H, hd]: each row over its sequence's cached
    context and the batch's rows of its sequence (causally unless ``batch.causal``); softmax in fp32. All
    sequences at once, padded to the longest: keys [N, L] gathered from the cache by position (the rows' own
    keys too when ``batch.slot_mapping`` wrote them, else appended)."""
    T, H, hd = q.shape
    KVH, N = k.shape[1], batch.num_seqs
    G = H // KVH
    acc = torch.promote_types(q.dtype, torch.float32)
    qlens = batch.query_lens
    Q = batch.visible.shape[1]
    keys = cache.view(-1, *cache.shape[2:])[batch.key_rows]                  # [N, L, 2, KVH, hd]
    kk, vv = keys[:, :, 0].to(acc), keys[:, :, 1].to(acc)
    pad = None
    if Q * N != T:       # rows padded to Q per sequence
        seq = torch.repeat_interleave(torch.arange(N, device=q.device), torch.tensor(qlens, device=q.device),
                                      output_size=T)
        off = torch.arange(T, device=q.device) - torch.tensor(batch.cu_seqlens[:-1], device=q.device)[seq]
        pad = (seq, off)
    if batch.slot_mapping is None:                                            # the block's own keys
        kk = torch.cat([kk, _padded(k.to(acc), N, Q, pad)], 1)
        vv = torch.cat([vv, _padded(v.to(acc), N, Q, pad)], 1)
    qp = _padded(q.to(acc), N, Q, pad).view(N, Q, KVH, G, hd)
    s = torch.einsum("nqkgd,nlkd->nkgql", qp, kk) * scale                     # [N, KVH, G, Q, L]
    s = s.masked_fill(~batch.visible[:, None, None], float("-inf"))
    o = torch.einsum("nkgql,nlkd->nqkgd", s.softmax(-1), vv).reshape(N, Q, H, hd)
    o = o.view(T, H, hd) if pad is None else o[pad]
    return o.to(q.dtype)


def _padded(x: torch.Tensor, N: int, Q: int, pad) -> torch.Tensor:
    """Packed rows [T, ...] -> [N, Q, ...] (zeros in the padding)."""
    if pad is None:
        return x.view(N, Q, *x.shape[1:])
    out = x.new_zeros(N, Q, *x.shape[1:])
    out[pad] = x
    return out


class DraftAttention(nn.Module):
    """q/k/v/o projections (bias-free) of a draft layer; ``qk_norm_eps``: Qwen3's per-head norms.

    Under tensor parallelism (``parallel``) a rank holds H/t query heads and their key/value heads (KVH/t of them,
    or, with fewer key/value heads than ranks, the one its query heads read, replicated); o_proj is
    row-parallel, its partial sums all-reduced. ``tp_slices``: the loader's slice of each checkpoint tensor."""

    def __init__(self, in_features: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope_theta: float, qk_norm_eps: float | None = None, parallel: ParallelContext | None = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads "
                             f"({num_kv_heads})")
        self.par = par = parallel or ParallelContext()
        q_start, heads = par.split(num_heads, "the draft's num_attention_heads") if par.enabled else (0, num_heads)
        if num_kv_heads >= par.tp_size:
            kv_start, kv_heads = par.split(num_kv_heads, "the draft's num_key_value_heads") if par.enabled \
                else (0, num_kv_heads)
        elif par.tp_size % num_kv_heads:
            raise ValueError(f"the draft's num_key_value_heads ({num_kv_heads}) must divide the tensor parallel size "
                             f"({par.tp_size}) when it is smaller")
        else:                                  # each rank's query heads read one key/value head, replicated
            kv_start, kv_heads = q_start // (num_heads // num_kv_heads), 1
        self.num_heads, self.num_kv_heads, self.head_dim, self.rope_theta = heads, kv_heads, head_dim, rope_theta
        self.q_proj = linear(in_features, heads * head_dim)
        self.k_proj = linear(in_features, kv_heads * head_dim)
        self.v_proj = linear(in_features, kv_heads * head_dim)
        self.o_proj = linear(heads * head_dim, hidden_size)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        self.tp_slices = {} if not par.enabled else {
            "q_proj.weight": (0, q_start * head_dim, heads * head_dim),
            "k_proj.weight": (0, kv_start * head_dim, kv_heads * head_dim),
            "v_proj.weight": (0, kv_start * head_dim, kv_heads * head_dim),
            "o_proj.weight": (1, q_start * head_dim, heads * head_dim)}
        self.rotary = RotaryTable(head_dim, rope_theta)
        self.fused_qkv, self.fused_kv = FusedWeight(), FusedWeight()

    def _split_heads(self, y: torch.Tensor, heads: list[int]) -> list[torch.Tensor]:
        return [t.view(y.shape[0], h, self.head_dim) for t, h in
                zip(y.split([h * self.head_dim for h in heads], dim=-1), heads)]

    def _project(self, x: torch.Tensor, query: bool) -> list[torch.Tensor]:
        """[q,] k, v of rows x [T, in] (q, k normed where the layer norms them; not rotated)."""
        mods = [self.q_proj, self.k_proj, self.v_proj] if query else [self.k_proj, self.v_proj]
        heads = ([self.num_heads] if query else []) + [self.num_kv_heads, self.num_kv_heads]
        w = (self.fused_qkv if query else self.fused_kv)(*mods)
        parts = self._split_heads(linear_op(x, w), heads) if w is not None else \
            [m(x).view(x.shape[0], h, self.head_dim) for m, h in zip(mods, heads)]
        if hasattr(self, "q_norm"):
            if query:
                parts[0] = self.q_norm(parts[0])
            parts[-2] = self.k_norm(parts[-2])
        return parts

    def key_values(self, x: torch.Tensor, positions: torch.Tensor, max_position: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, in] -> the rows' k (normed, rotated), v [T, KVH, hd]."""
        k, v = self._project(x, query=False)
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else 0
        return self.rotary(k, positions, max_position), v

    def write(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor,
              max_position: int | None = None) -> None:
        """Store the key/values of rows ``x`` (at ``positions``) in cache rows ``slot_mapping`` (a draft's
        catch-up with the target's positions, or a parallel drafter's context: the target's states)."""
        k, v = self.key_values(x, positions, max_position)
        cache.view(-1, *cache.shape[2:])[slot_mapping] = torch.stack([k, v], dim=1).to(cache.dtype)

    def forward(self, x: torch.Tensor, batch: DraftBatch, cache: torch.Tensor) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        q, k, v = self._project(x, query=True)
        qk = self.rotary(torch.cat([q, k], dim=1), batch.positions, batch.max_position)     # one rotation
        q, k = qk[:, :H], qk[:, H:]
        if batch.slot_mapping is not None:
            cache.view(-1, *cache.shape[2:])[batch.slot_mapping] = torch.stack([k, v], dim=1).to(cache.dtype)
        o = paged_attention(q, k, v, batch, cache, self.head_dim ** -0.5)
        return self.par.all_reduce(self.o_proj(o.reshape(T, H * self.head_dim)))
