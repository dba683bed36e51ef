"""Kimi Delta Attention (spec token-mixers §2.2, §6).

Per head, with key-major state S [K, V] (stored V-first as [V, K]):
    S <- diag(exp(g_t)) S;  delta = beta_t (v_t - S^T k_t);  S <- S + k_t delta^T;  o_t = S^T q_t
q and k are L2-normalised (eps 1e-6 on the sum of squares), q scaled by K^-1/2.

``kda_attention`` is the public op (shapes as fla's ``chunk_kda`` with ``state_v_first=True``):
the chunked form for prefill, the recurrence for single tokens. The naive functions are the
reference written as the equations read.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kimik3.ops.backend import import_fla_kda, use_fast_path
from kimik3.ops.cuda.flash_kda import flash_kda_applies, flash_kda_varlen
from kimik3.ops.linear import linear
from kimik3.ops.norm import acc_dtype, gated_rms_norm
from kimik3.ops.options import tuning
from kimik3.ops.pool_rows import slot_range


@dataclass(frozen=True)
class LowRank:
    """A layer's up-projection of a low-rank input, not yet computed: a [T, R] (unit inner stride, any row
    stride) times w [P, R]^T, rounded to a's dtype (the gate logits f from f_a and f_b, Kimi-Linear's output
    gate from g_a and g_b). The CUDA decode step computes each head's part inside its kernel (one launch
    fewer); every other path takes ``dense``."""
    a: torch.Tensor
    w: torch.Tensor

    def dense(self, heads: int) -> torch.Tensor:
        """[T, heads, P / heads]: ``ops.linear`` of a and w."""
        return linear(self.a, self.w).view(self.a.shape[0], heads, -1)


# A CUDA decode step of at most ``KernelTuning.decode_low_rank_max_seqs`` sequences computes ``LowRank`` operands
# inside its kernel (one launch fewer a KDA layer); larger ones compute them first (the measurement: ``options.py``).
# A CUDA decode step applies the layer's gated output norm inside its kernel at every batch size: a program then
# walks its head's [V, K] state 64 rows at a time (``triton/kda.py``), at or under the unfused step and the norm's
# own launch (H100, 96 heads, batch 1 / 8 / 32 / 128, bench_decode_ops.py at fc693bd: 9.6 / 44.6 / 156.4 / 598.4
# against 10.2 / 43.6 / 160.4 / 619.6 us; 32 heads: 9.8 / 12.9 / 59.5 / 224.4 against 10.1 / 16.4 / 58.2 / 218.7).


def dense(t: torch.Tensor | LowRank, heads: int) -> torch.Tensor:
    """A per-head operand [T, H, D] as a tensor, computing a ``LowRank`` one."""
    return t.dense(heads) if isinstance(t, LowRank) else t


@dataclass(frozen=True)
class OutputNorm:
    """A KDA layer's output norm: rmsnorm(o) * weight * sigmoid(gate) in fp32, rounded to ``dtype``
    (``gated_rms_norm``). weight [V]; gate [T, H, V], or a ``LowRank`` one."""
    weight: torch.Tensor
    gate: torch.Tensor | LowRank
    eps: float
    dtype: torch.dtype

    def __call__(self, o: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(o, self.weight, dense(self.gate, o.shape[-2]), self.eps, self.dtype)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
             lower_bound: float | None) -> torch.Tensor:
    """Log-decay g [T, H, K] from raw gate logits f [T, H, K], A_log [H], dt_bias [H*K].

    Bounded (K3):      g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias))   in (lb, 0)
    Softplus (Linear): g = -exp(A_log[h]) * softplus(f + dt_bias)        (identity above 20)
    """
    T, H, K = f.shape
    acc = acc_dtype(f.dtype)
    a = torch.exp(A_log.to(acc)).view(1, H, 1)
    z = f.to(acc) + dt_bias.to(acc).view(1, H, K)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * z)
    return -a * F.softplus(z, beta=1.0, threshold=20.0)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def naive_recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token by token. q, k [T, H, K] (normalised, q scaled), v [T, H, V],
    g [T, H, K] log-decay, beta [T, H], state [H, V, K] (V-first). Returns o [T, H, V], state."""
    S = state.transpose(-1, -2).clone()                     # [H, K, V] key-major for the math
    outs = []
    for t in range(q.shape[0]):
        S = S * torch.exp(g[t]).unsqueeze(-1)                          # decay rows (key channels)
        delta = beta[t].unsqueeze(-1) * (v[t] - torch.einsum("hkv,hk->hv", S, k[t]))
        S = S + k[t].unsqueeze(-1) * delta.unsqueeze(-2)               # S += k delta^T
        outs.append(torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(outs), S.transpose(-1, -2).contiguous()


def recurrent_kda_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``naive_recurrent_kda`` of N sequences of ``num_rows`` tokens each at once (the CPU path of verify steps
    where every sequence carries the same rows; ragged rows: ``_ragged_rows_in_pool``): q, k, v, g, beta packed
    rows (sequence n's rows n L .. n L + L - 1, L = ``num_rows``), ``state`` [N, H, V, K] the initial states (read
    only). Returns o [T, H, V] in packed order and the states after every step, [L, N, H, V, K]: [t, n] is
    sequence n's state after its token t (the last step holds every final state).

    The states stay V-first (the pool's layout). The operands are taken step-major once (views for one
    sequence, a copy for more); each step is one read of the previous state for S^T (decay * k), the decay
    written into the step's own state (no copy of it is kept apart), the rank-one update in place and one read
    for the output: the arithmetic of ``recurrent_kda_step``, bit for bit (``tests/ops/test_kda_cpu_step.py``)."""
    N, H, V, K = state.shape
    L = num_rows

    def step_major(x):
        x = x.view(N, L, *x.shape[1:]).transpose(0, 1)
        return x if N == 1 else x.contiguous()
    qs, ks, vs, gs, bs = map(step_major, (q, k, v, g, beta))
    dec = torch.exp(gs)                                                          # [L, N, H, K]
    dk = dec * ks
    states = state.new_empty(L, N, H, V, K)
    outs = q.new_empty(L, N, H, V)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta, state))

    def into(dst, fn, *args):       # fn(*args) written into dst: out= (a copy where autograd records the ops)
        return dst.copy_(fn(*args)) if grad else fn(*args, out=dst)
    prev = state
    for t in range(L):
        S = states[t]
        sk = torch.bmm(dk[t].view(N * H, 1, K), _keys_first(prev)).view(N, H, V)
        delta = bs[t].unsqueeze(-1) * (vs[t] - sk)
        into(S, torch.mul, prev, dec[t].unsqueeze(-2))
        S.view(N * H, V, K).baddbmm_(delta.view(N * H, V, 1), ks[t].view(N * H, 1, K))
        into(outs[t].view(N * H, 1, V), torch.bmm, qs[t].view(N * H, 1, K), _keys_first(S))
        prev = S
    return outs.transpose(0, 1).reshape(q.shape[0], H, V), states


def recurrent_kda_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       S: torch.Tensor) -> torch.Tensor:
    """One token of each of N sequences (row n of q, k, g [N, H, K], v [N, H, V], beta [N, H]; reference
    operands as ``naive_recurrent_kda`` takes them), S [N, H, V, K] updated in place. Returns o [N, H, V]."""
    N, H, V, K = S.shape
    dec = torch.exp(g)
    sk = torch.bmm((dec * k).view(N * H, 1, K), _keys_first(S)).view(N, H, V)
    delta = beta.unsqueeze(-1) * (v - sk)
    S.mul_(dec.unsqueeze(-2)).view(N * H, V, K).baddbmm_(delta.view(N * H, V, 1), k.reshape(N * H, 1, K))
    return torch.bmm(q.reshape(N * H, 1, K), _keys_first(S)).view(N, H, V)


def _keys_first(S: torch.Tensor) -> torch.Tensor:
    """V-first states [N, H, V, K] as the [N * H, K, V] operand of a row vector's product (x^T S^T = (S x)^T):
    a view. A CPU matrix-vector product runs several times faster this way than as S [V, K] times a column
    (default model, 4 heads of 64 x 64, one thread: 4.8 against 15.3 us at one sequence, 55 against 500 at 32)."""
    N, H, V, K = S.shape
    return S.view(N * H, V, K).transpose(1, 2)


def _decode_step(q, k, v, f, b, A_log, dt_bias, lower_bound, state: torch.Tensor, query_lens: list[int],
                 copy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU decode step (one token a sequence: row n is sequence n's) from ``state`` [N, H, V, K]: the
    reference operands, then ``recurrent_kda_step`` on ``state`` itself (``copy``: on a copy) in the
    accumulation dtype. Returns o [N, H, V] and the final states in ``state``'s dtype."""
    N = state.shape[0]
    if query_lens != [1] * N or q.shape[0] != N:
        raise ValueError(f"KDA decode step: one token per sequence, got lens {query_lens[:8]} and {q.shape[0]} "
                         f"rows for {N} states")
    qn, kn, vf, g, beta = _reference_inputs(q, k, v, f, b, A_log, dt_bias, lower_bound, state.dtype)
    S = state.to(qn.dtype, copy=copy)
    o = recurrent_kda_step(qn, kn, vf, g, beta, S)
    return o, S.to(state.dtype)


def chunk_kda_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, state: torch.Tensor, chunk_size: int = 64
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY) form of the same recurrence, one sequence (spec token-mixers §6.2).
    Same arguments as ``naive_recurrent_kda``; the last chunk may be short."""
    T, H, K = q.shape
    S = state.transpose(-1, -2).clone()                                 # [H, K, V]
    outs = []
    for s in range(0, T, chunk_size):
        qc, kc, vc = (x[s:s + chunk_size].transpose(0, 1) for x in (q, k, v))   # [H, n, *]
        gc, bc = g[s:s + chunk_size].transpose(0, 1), beta[s:s + chunk_size].transpose(0, 1)
        n = qc.shape[1]
        G = gc.cumsum(1)                                                # [H, n, K] inclusive
        diff = G.unsqueeze(2) - G.unsqueeze(1)                          # [H, i, j, K] = G_i - G_j
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = torch.exp(diff.masked_fill(~lower.unsqueeze(-1), float("-inf")))   # 0 above diagonal
        Akk = torch.einsum("hik,hjk,hijk->hij", kc, kc, decay).tril(-1) * bc.unsqueeze(-1)
        Aqk = torch.einsum("hik,hjk,hijk->hij", qc, kc, decay)
        eye = torch.eye(n, dtype=q.dtype, device=q.device).expand(H, n, n)
        Tm = torch.linalg.solve_triangular(eye + Akk, torch.diag_embed(bc), upper=False)
        W = Tm @ (torch.exp(G) * kc)                                    # [H, n, K]
        U = Tm @ vc                                                     # [H, n, V]
        Vn = U - W @ S
        outs.append(((qc * torch.exp(G)) @ S + Aqk @ Vn).transpose(0, 1))
        last = G[:, -1:, :]                                             # [H, 1, K]
        S = torch.exp(last).transpose(1, 2) * S + (kc * torch.exp(last - G)).transpose(1, 2) @ Vn
    return torch.cat(outs), S.transpose(-1, -2).contiguous()


def _reference_inputs(q, k, v, f, b, A_log, dt_bias, lower_bound, state_dtype):
    """The reference's operands in the accumulation dtype: q and k L2-normalised (q scaled by
    K^-1/2), v, the log-decay g and beta = sigmoid(b)."""
    acc = torch.promote_types(acc_dtype(q.dtype), state_dtype)
    return (l2_normalize(q.to(acc)) * q.shape[-1] ** -0.5, l2_normalize(k.to(acc)), v.to(acc),
            kda_gate(f, A_log, dt_bias, lower_bound).to(acc), torch.sigmoid(b.to(acc)))


def kda_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                  A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None,
                  initial_state: torch.Tensor, query_lens: list[int], chunk_size: int = 64
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA over packed varlen sequences.

    q, k [T, H, K] post-conv (not normalised); v [T, H, V]; f [T, H, K] raw gate logits;
    b [T, H] raw beta logits; A_log [H]; dt_bias [H*K]; initial_state [N, H, V, K] fp32 (V-first).
    Returns o [T, H, V] (fp32 or wider; q's dtype on CUDA) and final_state [N, H, V, K].
    CUDA: fla-core's ``chunk_kda`` (gate, beta sigmoid and q/k L2 norm in kernel), or FlashKDA (opt-in,
    ``cuda/flash_kda.py``).
    """
    T, H, K = q.shape
    if initial_state.shape[0] != len(query_lens) or sum(query_lens) != T:
        raise ValueError(f"kda_attention: {len(query_lens)} sequences / {sum(query_lens)} tokens, but "
                         f"initial_state has {initial_state.shape[0]} rows and q has {T} tokens")
    if use_fast_path(q):
        cu = torch.tensor([0, *query_lens], device=q.device).cumsum(0)
        return _chunk_kda_cuda(q, k, v, f, b, A_log, dt_bias, lower_bound, initial_state.contiguous(), cu,
                               chunk_size)
    if all(ql == 1 for ql in query_lens):          # a decode step: every sequence's one token at once
        return _decode_step(q, k, v, f, b, A_log, dt_bias, lower_bound, initial_state, query_lens, copy=True)
    qn, kn, vf, g, beta = _reference_inputs(q, k, v, f, b, A_log, dt_bias, lower_bound, initial_state.dtype)
    acc = qn.dtype
    outs, finals = [], []
    start = 0
    for n, ql in enumerate(query_lens):
        sl = slice(start, start + ql)
        s0 = initial_state[n].to(acc)
        args = (qn[sl], kn[sl], vf[sl], g[sl], beta[sl], s0)
        o, s = naive_recurrent_kda(*args) if ql == 1 else chunk_kda_ref(*args, chunk_size=chunk_size)
        outs.append(o)
        finals.append(s)
        start += ql
    return torch.cat(outs), torch.stack(finals).to(initial_state.dtype)


def _chunk_kda_cuda(q, k, v, f, b, A_log, dt_bias, lower_bound, initial_state, cu_seqlens, chunk_size=64):
    """Chunked KDA on CUDA over packed varlen tokens; initial_state [N, H, V, K] fp32 (V-first).
    FlashKDA where ``KIMIK3_FLASH_KDA`` names its library and the call fits it (``cuda/flash_kda.py``),
    else fla-core's ``chunk_kda``, q and k L2-normalised by our kernel first (``triton/l2norm.py``:
    fla's autotunes per size bucket)."""
    if flash_kda_applies(q, v, lower_bound):
        return flash_kda_varlen(q, k, v, f, b, A_log, dt_bias, lower_bound, initial_state, cu_seqlens)
    from kimik3.ops.triton.l2norm import l2norm_triton
    chunk_kda, _ = import_fla_kda()
    if initial_state.dtype != torch.float32:
        raise ValueError(f"the CUDA KDA path keeps fp32 states, got {initial_state.dtype}")
    q, k = l2norm_triton(q), l2norm_triton(k)
    q, k, v, f = (t.contiguous().unsqueeze(0) for t in (q, k, v, f))     # fla assumes packed rows
    o, final = chunk_kda(q, k, v, f, b.float().contiguous().unsqueeze(0),
                         initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=False,
                         use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                         safe_gate=lower_bound is not None, lower_bound=lower_bound, state_v_first=True,
                         cu_seqlens=cu_seqlens, A_log=A_log.float(), dt_bias=dt_bias.float(), chunk_size=chunk_size)
    return o.squeeze(0), final


def kda_recurrent_in_pool(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                          A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None,
                          state_pool: torch.Tensor, write_slots: torch.Tensor, query_lens: list[int],
                          cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Short chunks of sequences that have a state (a speculative verify step: the last token and its
    drafts), token by token, with the state after every row kept: the state after row t of sequence
    n goes to pool slot ``write_slots[n, t]`` ([N, max query_len] int64; a row whose state is not
    wanted names the scratch slot 0). The initial state is read from ``write_slots[n, query_len - 1]``,
    the sequence's live slot, which receives the final state. Shapes as ``kda_attention``; returns
    o [T, H, V]. CUDA: fla's recurrent kernel in one launch (per-token state indices, as vLLM's
    speculative decoding uses it)."""
    if use_fast_path(q):
        _, fused_recurrent_kda_fwd = import_fla_kda()
        q, k, v, f = (t.contiguous().unsqueeze(0) for t in (q, k, v, f))     # [1, T, ...] packed rows
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        o, _ = fused_recurrent_kda_fwd(q, k, v, f, b.float().contiguous().unsqueeze(0), A_log=A_log.float(),
                                       dt_bias=dt_bias.float(), initial_state=state_pool, inplace_final_state=True,
                                       state_v_first=True, cu_seqlens=cu_seqlens, ssm_state_indices=write_slots,
                                       num_accepted_tokens=lens, use_qk_l2norm_in_kernel=True,
                                       use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                       lower_bound=lower_bound)
        return o.squeeze(0)
    qn, kn, vf, g, beta = _reference_inputs(q, k, v, f, b, A_log, dt_bias, lower_bound, state_pool.dtype)
    N, L = len(query_lens), max(query_lens, default=0)
    if N == 0:
        return qn.new_empty(0, *v.shape[1:])
    # the state after row t of sequence n into slot write_slots[n, t], all at once (only the scratch slot may
    # repeat in the table); the live slot, named at the last row, receives the final state
    dst = write_slots[:, :L].t()
    if min(query_lens) == L:
        o, states = recurrent_kda_rows(qn, kn, vf, g, beta, state_pool[dst[-1]].to(qn.dtype), L)
        state_pool[dst.reshape(-1)] = states.view(L * N, *states.shape[2:]).to(state_pool.dtype)
        return o
    return _ragged_rows_in_pool(qn, kn, vf, g, beta, state_pool, write_slots, query_lens)


def _ragged_rows_in_pool(qn, kn, vf, g, beta, state_pool: torch.Tensor, write_slots: torch.Tensor,
                         query_lens: list[int]) -> torch.Tensor:
    """``kda_recurrent_in_pool``'s CPU recurrence for sequences of different lengths (a verify step where a few
    requests carry drafts), on the reference operands, so the cost follows the rows present: step t runs the
    decode step (``recurrent_kda_step``) on the sequences with a row t, the first on all of them in place on the
    live states (the pool rows themselves where the live slots are consecutive, ``slot_range``: no gather, no
    scatter; else one copy), a later one on a gathered copy of its few; the states after non-final rows go to
    their slots as they form. Returns o [T, H, V] in packed order."""
    N, L = len(query_lens), max(query_lens)
    starts = [0, *itertools.accumulate(query_lens)]
    dev = qn.device
    live = write_slots[torch.arange(N, device=dev), torch.tensor(query_lens, device=dev) - 1]
    rows = slot_range(state_pool, live) if state_pool.dtype == qn.dtype else None
    S = state_pool.index_select(0, live).to(qn.dtype) if rows is None else rows
    o = qn.new_empty(qn.shape[0], *vf.shape[1:])
    for t in range(L):
        seqs = [n for n in range(N) if query_lens[n] > t]
        packed = torch.tensor([starts[n] + t for n in seqs], device=dev)
        idx = None if len(seqs) == N else torch.tensor(seqs, device=dev)
        St = S if idx is None else S.index_select(0, idx)
        o[packed] = recurrent_kda_step(*(x.index_select(0, packed) for x in (qn, kn, vf, g, beta)), St)
        if idx is not None:
            S.index_copy_(0, idx, St)
        more = [n for n in seqs if query_lens[n] > t + 1]
        if more:                                    # sequences with a later row: the state after this one
            m = torch.tensor(more, device=dev)
            state_pool[write_slots[m, t]] = S.index_select(0, m).to(state_pool.dtype)
    if rows is None:
        state_pool[live] = S.to(state_pool.dtype)
    return o


def kda_attention_in_pool(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor | LowRank, b: torch.Tensor,
                          A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None,
                          state_pool: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor | None,
                          query_lens: list[int], cu_seqlens: torch.Tensor, decode: bool,
                          out_norm: OutputNorm | None = None) -> torch.Tensor:
    """``kda_attention`` with the states read from and written back to a pool.

    state_pool [num_slots, H, V, K] fp32 (V-first): rows ``slots`` [N] are the initial states
    (zeros where ``has_state`` [N] is False; None: every sequence has one) and receive the final
    states. ``decode``: every sequence has one token and a state (then CUDA updates the pool rows in
    place with our one-kernel step, ``triton/kda.py``: no gather/scatter; a ``LowRank`` f or output gate is
    computed inside it up to ``KernelTuning.decode_low_rank_max_seqs`` sequences). Returns o [T, H, V], or ``out_norm(o)`` (in its dtype) when given: on the CUDA
    decode step inside the same kernel, from o rounded to the
    layer's dtype as every other path hands it to the norm.
    """
    if use_fast_path(q) and decode:
        from kimik3.ops.triton.kda import kda_decode_triton, low_rank_fits

        def operand(t):           # the kernel takes a low-rank operand as its pair (a, w), of a rank it fits
            if isinstance(t, LowRank) and q.shape[0] <= tuning().decode_low_rank_max_seqs and low_rank_fits(t.a.shape[-1]):
                return t.a, t.w
            return dense(t, q.shape[1])
        norm = None if out_norm is None else (out_norm.weight, operand(out_norm.gate), out_norm.eps, out_norm.dtype)
        return kda_decode_triton(q, k, v, operand(f), b, A_log, dt_bias, lower_bound, state_pool, slots, norm=norm)
    f = dense(f, q.shape[1])
    fast = use_fast_path(q)
    step = not fast and query_lens == [1] * len(query_lens)      # a CPU decode step
    # the sequences' rows: a view where the slots are consecutive (a CPU decode step updates them in place), else
    # a copy, this call's to update (CPU: ~5x pool[slots])
    rows = slot_range(state_pool, slots) if step else None
    state0 = state_pool.index_select(0, slots) if rows is None else rows
    if has_state is not None:
        state0.masked_fill_(~has_state.view(-1, 1, 1, 1), 0)
    if fast:
        o, state1 = _chunk_kda_cuda(q, k, v, f, b, A_log, dt_bias, lower_bound, state0, cu_seqlens)
    elif step:                                          # on state0 in place
        o, state1 = _decode_step(q, k, v, f, b, A_log, dt_bias, lower_bound, state0, query_lens, copy=False)
    else:
        o, state1 = kda_attention(q, k, v, f, b, A_log, dt_bias, lower_bound, state0, query_lens)
    if rows is None:
        state_pool[slots] = state1
    elif state1.data_ptr() != rows.data_ptr():          # the step ran in a wider dtype than the pool's
        rows.copy_(state1)
    return o if out_norm is None else out_norm(o)
