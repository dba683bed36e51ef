"""Kimi Delta Attention token mixer (spec token-mixers §2; text-backbone §2.7).

K3: full-rank output gate ``g_proj`` and bounded decay gate (lower bound -5).
Kimi-Linear: low-rank output gate ``g_a_proj``/``g_b_proj`` and the softplus decay gate.
"""

from __future__ import annotations

import itertools
import logging

import torch
from torch import nn

from kimik3.distributed import ParallelContext
from kimik3.model.batch import ForwardBatch
from kimik3.model.layers import MergedLinear, MergedWeight, linear, tp_shards
from kimik3.ops.conv import causal_conv1d_in_pool, causal_conv1d_rows_in_pool, conv_windows_at
from kimik3.ops.kda import LowRank, OutputNorm, dense, kda_attention, kda_attention_in_pool, kda_recurrent_in_pool

logger = logging.getLogger(__name__)


class KimiDeltaAttention(nn.Module):
    """Under TP (spec parallelism §1.4) the module holds its rank's H/t heads: q/k/v/g, f_b, b,
    conv, A_log, dt_bias split by heads (channels); f_a (and Kimi-Linear's g_a) and o_norm
    replicated; o_proj row-parallel, its partial all-reduced. Heads never talk to each other."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_size: int,
                 use_full_rank_gate: bool, gate_lower_bound: float | None, norm_eps: float,
                 parallel: ParallelContext | None = None):
        super().__init__()
        self.par = par = parallel or ParallelContext()
        self.head_start, H = par.split(num_heads, "KDA heads") if par.enabled else (0, num_heads)
        K = head_dim
        P = H * K
        self.num_heads, self.head_dim, self.lower_bound, self.norm_eps = H, K, gate_lower_bound, norm_eps
        # everything read from x in one GEMM: q, k, v [P each], f_a [K], then K3's b [H] and output gate
        # g [P], or Kimi-Linear's low-rank gate input g_a [K] (beside f_a) and b [H]
        tail = {"b_proj": H, "g_proj": P} if use_full_rank_gate else {"g_a_proj": K, "b_proj": H}
        self.in_proj = MergedLinear(hidden_size, {"q_proj": P, "k_proj": P, "v_proj": P, "f_a_proj": K, **tail})
        # the q, k, v short convs' weights [3P, 1, W] (checkpoint: {q,k,v}_conv1d.weight [P, 1, W] or [P, W])
        self.conv1d = MergedWeight((1, conv_size), {"q_conv1d": P, "k_conv1d": P, "v_conv1d": P})
        if use_full_rank_gate:
            self.f_b_proj = linear(K, P)
        else:
            # Kimi-Linear's two low-rank up-projections [P, K] as one weight: one batched GEMM of f_a | g_a
            self.fg_b_proj = MergedWeight((K,), {"f_b_proj": P, "g_b_proj": P})
        # A_log, dt_bias (and, by policy, conv and o_norm) stay fp32: see KimiForCausalLM.cast
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(P))
        self.o_norm = _NormWeight(K)
        self.o_proj = linear(P, hidden_size)
        self.tp_shards = tp_shards(par, q_proj__weight=0, k_proj__weight=0, v_proj__weight=0, f_b_proj__weight=0,
                                   b_proj__weight=0, g_proj__weight=0, g_b_proj__weight=0, q_conv1d__weight=0,
                                   k_conv1d__weight=0, v_conv1d__weight=0, dt_bias=0, o_proj__weight=1)

    def load_A_log(self, tensor: torch.Tensor, name: str) -> None:
        """Accept [H], Kimi-Linear's [1, 1, H, 1], or a longer vector; use entries 0..H-1 (D7),
        and of those this rank's heads."""
        flat = tensor.reshape(-1)
        H = self.num_heads * self.par.tp_size
        if flat.numel() < H or (tensor.dim() > 1 and flat.numel() != H):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not hold {H} heads "
                             f"(expected [{H}], [1, 1, {H}, 1] or a longer vector)")
        if flat.numel() > H and bool((flat[H:] != 0).any()):
            logger.warning("%s: %d stored entries, using the first %d; the discarded tail is non-zero",
                           name, flat.numel(), H)
        self.A_log.data.copy_(flat[:H][self.head_start:self.head_start + self.num_heads])

    def forward(self, x: torch.Tensor, batch: ForwardBatch, conv_pool: torch.Tensor,
                state_pool: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]. conv_pool [slots, 3P, W-1] and state_pool [slots, H, V, K] are
        this layer's pools, read at and written back to ``batch.state_slots``."""
        T = x.shape[0]
        H, K = self.num_heads, self.head_dim
        slots = batch.state_slots
        P = H * K
        # the up-projections of the low-rank gate inputs (f = f_a f_b^T; Kimi-Linear's gate = g_a g_b^T) stay
        # LowRank: a CUDA decode step computes them inside its KDA kernel, the other paths first (``ops.kda``)
        if hasattr(self, "f_b_proj"):                                           # K3: q|k|v, f_a, b, g
            raw, f_a, b, gate = self.in_proj(x).split([3 * P, K, H, P], dim=-1)   # raw: q|k|v [T, 3P]
            f, gate = LowRank(f_a, self.f_b_proj.weight), gate.view(T, H, K)
        else:                                                                   # Kimi-Linear: q|k|v, f_a|g_a, b
            raw, fg_a, b = self.in_proj(x).split([3 * P, 2 * K, H], dim=-1)
            f_b, g_b = self.fg_b_proj.weight.view(2, P, K)
            f, gate = LowRank(fg_a[:, :K], f_b), LowRank(fg_a[:, K:], g_b)
        weight = self.conv1d.weight.squeeze(1)                                  # [3P, W]
        out_norm = OutputNorm(self.o_norm.weight, gate, self.norm_eps, x.dtype)
        if batch.row_state_slots is not None:
            y = out_norm(self._attend_short(raw, weight, f, b, batch.context_lens > 0, batch, conv_pool, state_pool))
        elif batch.checkpoints:
            y = out_norm(self._attend_with_checkpoints(raw, weight, f, b, batch.context_lens > 0, batch, conv_pool,
                                                       state_pool))
        else:
            # the ops read the sequences' pool rows and write the new windows/states back in place
            # (None: every sequence has history, which a decode step's kernels take as given)
            has_state = None if batch.is_decode else batch.context_lens > 0
            q, k, v = (t.view(T, H, K) for t in causal_conv1d_in_pool(raw, weight, conv_pool, slots, has_state,
                                                                       batch.query_lens_cpu, batch.cu_seqlens, 3))
            y = kda_attention_in_pool(q, k, v, f, b, self.A_log, self.dt_bias, self.lower_bound, state_pool, slots,
                                      has_state, batch.query_lens_cpu, batch.cu_seqlens, decode=batch.is_decode,
                                      out_norm=out_norm)
        return self.par.all_reduce(self.o_proj(y.reshape(T, H * K)))

    def _attend_short(self, raw, weight, f, b, has_state, batch: ForwardBatch, conv_pool, state_pool):
        """A short step (speculative verify): one recurrent pass that leaves the state after each row
        in ``batch.row_state_slots`` (a scratch slot where none is kept), the conv window after each
        row in the same slot, and the final ones in the live slots. Graph-safe (device indices only)
        but for the checkpoints the table cannot name, which only eager steps have."""
        T, H, K = raw.shape[0], self.num_heads, self.head_dim
        slots, lens, table = batch.state_slots, batch.query_lens_cpu, batch.row_state_slots
        f = dense(f, H)
        q, k, v = (t.view(T, H, K) for t in causal_conv1d_rows_in_pool(raw, weight, conv_pool, slots, has_state, lens,
                                                                        batch.cu_seqlens, table, 3))
        o = kda_recurrent_in_pool(q, k, v, f, b, self.A_log, self.dt_bias, self.lower_bound, state_pool, table,
                                  lens, batch.cu_seqlens)
        # checkpoints the table could not name (a chunk's last row, or a second one at a row) are
        # copies of the slot that has that row's state
        named = {(c.seq, c.num_tokens): i for i, c in enumerate(batch.checkpoints) if c.num_tokens < lens[c.seq]}
        extra = [c for i, c in enumerate(batch.checkpoints) if named.get((c.seq, c.num_tokens)) != i]
        if extra:
            seq, row = (torch.tensor(v, device=raw.device) for v in zip(*[(c.seq, c.num_tokens - 1) for c in extra]))
            src, dst = table[seq, row], torch.tensor([c.slot for c in extra], device=raw.device)
            conv_pool[dst], state_pool[dst] = conv_pool[src], state_pool[src]
        return o

    def _attend_with_checkpoints(self, raw, weight, f, b, has_state, batch: ForwardBatch, conv_pool, state_pool):
        """An eager step with state checkpoints (prefix caching). The conv runs as in a plain step (in the
        pool: one kernel on CUDA), each checkpoint's window is gathered from the raw inputs. Checkpoints at
        the end of their chunk are the final states, copied once the plain chunked pass wrote them; the
        others cut their sequences into segments run in rounds, each round one varlen call whose initial
        states are the previous round's final states (a round of one sequence reads its rows in place)."""
        T, H, K = raw.shape[0], self.num_heads, self.head_dim
        slots, lens, cu = batch.state_slots, batch.query_lens_cpu, batch.cu_seqlens
        windows = conv_pool[slots].masked_fill(~has_state.view(-1, 1, 1), 0)   # before the conv writes the new
        q, k, v = (t.view(T, H, K) for t in causal_conv1d_in_pool(raw, weight, conv_pool, slots, has_state, lens,
                                                                   cu, 3))
        seq, rows, dst = (torch.tensor(v, device=raw.device) for v in zip(*[(c.seq, c.num_tokens, c.slot)
                                                                             for c in batch.checkpoints]))
        conv_pool[dst] = conv_windows_at(raw, windows, cu, seq, rows)   # the window only depends on raw inputs
        cuts: dict[int, dict[int, list[int]]] = {}        # seq -> offset inside its chunk -> checkpoint slots
        at_end = []                                       # (live slot index, checkpoint slot) at a chunk's end
        for c in batch.checkpoints:
            if c.num_tokens == lens[c.seq]:
                at_end.append((c.seq, c.slot))
            else:
                cuts.setdefault(c.seq, {}).setdefault(c.num_tokens, []).append(c.slot)
        if cuts:
            o = self._segments(q, k, v, dense(f, H), b, has_state, batch, state_pool, cuts)
        else:
            o = kda_attention_in_pool(q, k, v, f, b, self.A_log, self.dt_bias, self.lower_bound, state_pool, slots,
                                      has_state, lens, cu, decode=False)
        if at_end:
            n, dst = (torch.tensor(v, device=raw.device) for v in zip(*at_end))
            state_pool[dst] = state_pool[slots[n]]
        return o

    def _segments(self, q, k, v, f, b, has_state, batch: ForwardBatch, state_pool, cuts) -> torch.Tensor:
        """KDA over the step's sequences cut at ``cuts`` (seq -> offset -> checkpoint slots), in rounds: round
        r runs every sequence's r-th segment from the state the previous round left, and writes the states at
        the cuts it ends on. Returns o [T, H, V]; the final states go to the live slots."""
        slots, lens = batch.state_slots, batch.query_lens_cpu
        starts = [0, *itertools.accumulate(lens)]
        state = state_pool[slots].masked_fill(~has_state.view(-1, 1, 1, 1), 0)
        bounds = []
        for n, ql in enumerate(lens):
            edges = sorted({0, ql, *(off for off in cuts.get(n, {}) if 0 < off < ql)})
            bounds.append(list(zip(edges[:-1], edges[1:])))
        o = None
        for r in range(max(len(s) for s in bounds)):
            seqs = [n for n in range(len(bounds)) if r < len(bounds[n])]
            spans = [(starts[n] + bounds[n][r][0], starts[n] + bounds[n][r][1]) for n in seqs]
            if len(seqs) == 1:                # one sequence: its rows in place
                rows = slice(*spans[0])
            else:
                rows = torch.cat([torch.arange(a, z, device=q.device) for a, z in spans])
            out, fin = kda_attention(q[rows], k[rows], v[rows], f[rows], b[rows], self.A_log, self.dt_bias,
                                     self.lower_bound, state[seqs], [z - a for a, z in spans])
            if o is None:                     # the op's output dtype (q's on CUDA, fp32 or wider on the CPU)
                o = out.new_empty(q.shape[0], *out.shape[1:])
            o[rows] = out
            state[seqs] = fin
            for j, n in enumerate(seqs):
                for slot in cuts.get(n, {}).get(bounds[n][r][1], []):
                    state_pool[slot] = fin[j]
        state_pool[slots] = state
        return o


class _NormWeight(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
