"""Causal depthwise short convolution + SiLU over packed varlen sequences (KDA q/k/v streams).

Conv state per sequence: the last W-1 raw inputs of every channel, oldest first, [C, W-1].
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from kimik3.ops.backend import use_fast_path
from kimik3.ops.norm import acc_dtype
from kimik3.ops.pool_rows import slot_range


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                  query_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """y_t[c] = silu(sum_j weight[c, j] * x_{t-W+1+j}[c]) with history from ``state``.

    x [T, C] (packed), weight [C, W], state [N, C, W-1] (zeros for a fresh sequence).
    Returns y [T, C] in x's dtype (accumulated in fp32 or wider) and the new state [N, C, W-1].
    """
    T, C = x.shape
    if weight.shape[0] != C or state.shape[1] != C or state.shape[2] != weight.shape[1] - 1:
        raise ValueError(f"conv shapes disagree: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"state {tuple(state.shape)}")
    acc = acc_dtype(x.dtype)
    w = weight.to(acc)
    width = w.shape[1]
    if len(query_lens) == T == state.shape[0] and all(q == 1 for q in query_lens):
        # a decode step: one row per sequence, all at once (the loop below cost ~6 ops a sequence: a quarter of
        # a 65-sequence step of the default model on a CPU)
        seq = torch.cat([state.to(x.dtype), x.unsqueeze(-1)], dim=-1)                 # [N, C, W]
        return F.silu((seq.to(acc) * w).sum(-1)).to(x.dtype), seq[..., 1:].to(state.dtype)
    N = state.shape[0]
    if N > 1 and T == N * query_lens[0] and query_lens == [query_lens[0]] * N:
        # every sequence the same rows (a verify step): the loop below at once, each window as it forms it
        y, seq = _equal_chunks(x, w, state)
        return y, seq[:, -(width - 1):].transpose(1, 2).to(state.dtype)
    outs, new_states = [], []
    start = 0
    for n, q in enumerate(query_lens):
        seq = torch.cat([state[n].to(x.dtype).t(), x[start:start + q]], dim=0)    # [W-1+q, C]
        windows = seq.unfold(0, width, 1)                                          # [q, C, W]
        outs.append(F.silu((windows.to(acc) * w).sum(-1)).to(x.dtype))
        new_states.append(seq[-(width - 1):].t())
        start += q
    return torch.cat(outs, dim=0), torch.stack(new_states).to(state.dtype)


def _equal_chunks(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``causal_conv1d`` of N sequences of T / N rows each, all at once: y [T, C] and the histories
    [N, W-1 + T/N, C] (oldest first) whose windows of W made it. w: the weight in the accumulation dtype."""
    N, C, W1 = state.shape
    seq = torch.cat([state.to(x.dtype).transpose(1, 2), x.view(N, -1, C)], dim=1)
    y = F.silu((seq.unfold(1, W1 + 1, 1).to(w.dtype) * w).sum(-1)).to(x.dtype)
    return y.view(x.shape), seq


def conv_windows_at(x: torch.Tensor, windows: torch.Tensor, cu_seqlens: torch.Tensor, seq: torch.Tensor,
                    num_rows: torch.Tensor) -> torch.Tensor:
    """Conv states after the first ``num_rows[i]`` rows of sequence ``seq[i]``'s chunk, one gather for
    all (device indices only: a CUDA graph can hold it). x [T, C] packed raw inputs; windows
    [N, C, W-1] the states before the chunks; cu_seqlens [N + 1]; seq, num_rows [M] int64.
    Returns [M, C, W-1]: the last W-1 of the sequence's history followed by its first rows."""
    return _history(x, windows, cu_seqlens, seq, num_rows, windows.shape[-1]).transpose(1, 2).to(windows.dtype)


def _history(x: torch.Tensor, windows: torch.Tensor, cu_seqlens: torch.Tensor, seq: torch.Tensor,
             num_rows: torch.Tensor, width: int) -> torch.Tensor:
    """The last ``width`` raw inputs [M, width, C] (x's dtype, oldest first) of sequence ``seq[i]``'s history
    followed by its chunk's first ``num_rows[i]`` rows (``width`` <= W: at most one more than a window)."""
    N, C, W1 = windows.shape
    hist = torch.cat([windows.transpose(1, 2).reshape(N * W1, C).to(x.dtype), x])      # [N*(W-1) + T, C]
    p = num_rows.unsqueeze(1) - width + torch.arange(width, device=x.device)             # positions in the chunk
    rows = torch.where(p < 0, (seq * W1 + W1).unsqueeze(1) + p, N * W1 + cu_seqlens[seq].unsqueeze(1) + p)
    return hist[rows]


def _windows(pool: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor | None,
             rows: torch.Tensor | None = None) -> torch.Tensor:
    """The conv windows of ``slots``: ``rows`` (their pool rows as a view, ``slot_range``: updated in place) or else a
    copy (CPU: ~5x faster than ``pool[slots]`` at 65 rows), zero where ``has_state`` is False (a sequence without
    history)."""
    windows = pool.index_select(0, slots) if rows is None else rows
    if has_state is not None:
        windows.masked_fill_(~has_state.view(-1, 1, 1), 0)
    return windows


def causal_conv1d_in_pool(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                          has_state: torch.Tensor | None, query_lens: list[int], cu_seqlens: torch.Tensor,
                          groups: int = 1) -> tuple[torch.Tensor, ...]:
    """``causal_conv1d`` with the history read from, and the new window written to, a state pool.

    x [T, C]; weight [C, W]; pool [num_slots, C, W-1] (rows ``slots`` [N] are read, then
    overwritten); has_state [N] bool (False: fresh sequence, zero history; None: every sequence has
    history, as in a decode step); cu_seqlens [N+1].
    Returns y in x's dtype as ``groups`` contiguous [T, C / groups] tensors (KDA: q, k, v, each
    packed as fla's kernels read them). CUDA: one Triton pass, no gather/scatter of the windows.
    """
    if use_fast_path(x):
        from kimik3.ops.triton.conv import causal_conv1d_pool_triton
        x = x if x.stride(-1) == 1 else x.contiguous()
        return causal_conv1d_pool_triton(x, weight, pool, slots, has_state, cu_seqlens, groups).unbind(0)
    rows = slot_range(pool, slots) if query_lens == [1] * len(query_lens) else None
    y, state1 = causal_conv1d(x, weight, _windows(pool, slots, has_state, rows), query_lens)
    if rows is None:
        pool[slots] = state1
    else:                           # a decode step of consecutive slots: their windows read and written in place
        rows.copy_(state1)
    return tuple(part.contiguous() for part in y.chunk(groups, dim=-1))


def causal_conv1d_rows_in_pool(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                               has_state: torch.Tensor | None, query_lens: list[int], cu_seqlens: torch.Tensor,
                               write_slots: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, ...]:
    """``causal_conv1d_in_pool`` that also keeps the window after every row (a speculative verify step, as
    ``ops.kda.kda_recurrent_in_pool`` keeps the states): the window after row t of sequence n goes to pool slot
    ``write_slots[n, t]`` ([N, max query_len] int64; the scratch slot where none is kept; the last row's slot,
    like ``slots[n]``, receives the final window). Device indices only (a CUDA graph can hold it).
    CPU, every sequence the same rows: the histories once (``_equal_chunks``), the kept windows views of them;
    ragged rows: each row's window gathered from the windows and the raw inputs (``_history``), its last W-1 the
    kept window. CUDA: the pool conv, then the kept windows gathered (``conv_windows_at``)."""
    N, T = len(query_lens), x.shape[0]
    L = max(query_lens, default=0)
    if not use_fast_path(x) and N and T == N * L and min(query_lens) == L:
        y, seq = _equal_chunks(x, weight.to(acc_dtype(x.dtype)), _windows(pool, slots, has_state))
        kept = seq[:, 1:].unfold(1, pool.shape[-1], 1)                  # [N, L, C, W-1]: after each row
        pool[write_slots[:, :L].reshape(-1)] = kept.reshape(N * L, *pool.shape[1:]).to(pool.dtype)
        pool[slots] = kept[:, -1].to(pool.dtype)
        return tuple(part.contiguous() for part in y.chunk(groups, dim=-1))
    if not use_fast_path(x):
        return _ragged_rows_in_pool(x, weight, pool, slots, has_state, query_lens, cu_seqlens, write_slots, groups)
    windows = _windows(pool, slots, has_state)                           # before the conv writes the new ones
    seq, offset = _row_positions(cu_seqlens, N, T)
    y = causal_conv1d_in_pool(x, weight, pool, slots, has_state, query_lens, cu_seqlens, groups)
    pool[write_slots[seq, offset]] = conv_windows_at(x, windows, cu_seqlens, seq, offset + 1)
    return y


def _row_positions(cu_seqlens: torch.Tensor, num_seqs: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each packed row's sequence and its offset in the sequence's chunk ([T] int64 each; device ops only)."""
    seq = torch.repeat_interleave(torch.arange(num_seqs, device=cu_seqlens.device), cu_seqlens[1:] - cu_seqlens[:-1],
                                  output_size=num_rows)
    return seq, torch.arange(num_rows, device=cu_seqlens.device) - cu_seqlens[seq]


def _ragged_rows_in_pool(x, weight, pool, slots, has_state, query_lens: list[int], cu_seqlens, write_slots,
                         groups: int) -> tuple[torch.Tensor, ...]:
    """``causal_conv1d_rows_in_pool`` on the CPU for ragged rows (a verify step where a few sequences carry
    drafts): each row's window of W inputs in one gather, so the cost follows the rows present; its last W-1 are
    the window kept after the row. The live windows are read and written in place where the slots are consecutive
    (``slot_range``), the non-final rows' windows scattered to their slots."""
    N, T = len(query_lens), x.shape[0]
    live = slot_range(pool, slots)
    windows = _windows(pool, slots, has_state, live)
    dev = x.device
    seq, offset = _row_positions(cu_seqlens, N, T)
    # (a view [T, C, W] with W outermost in memory, as ``causal_conv1d``'s unfold: the same sums, bit for bit)
    win = _history(x, windows, cu_seqlens, seq, offset + 1, weight.shape[1]).transpose(1, 2)
    acc = acc_dtype(x.dtype)
    y = F.silu((win.to(acc) * weight.to(acc)).sum(-1)).to(x.dtype)
    if live is None:
        pool[write_slots[seq, offset]] = win[..., 1:].to(pool.dtype)    # the last row's slot is the live one
    else:
        live.copy_(win[cu_seqlens[1:] - 1, :, 1:])
        starts = [0, *itertools.accumulate(query_lens)]
        inner = torch.tensor([starts[n] + t for n, q in enumerate(query_lens) for t in range(q - 1)], device=dev,
                             dtype=torch.int64)
        if len(inner):
            pool[write_slots[seq[inner], offset[inner]]] = win[inner, :, 1:].to(pool.dtype)
    return tuple(part.contiguous() for part in y.chunk(groups, dim=-1))
