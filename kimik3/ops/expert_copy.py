"""Copy the experts a batch routes to from a host pool into their rows of a GPU pool (expert offload,
``kimik3.model.expert_offload``).

``copy_experts(src, dst, experts, rows, used)``: for each j with ``used[experts[j]]``, ``dst[rows[j]] =
src[experts[j]]``; the other rows are left alone. ``src`` [E, n] and ``dst`` [R, n] are byte rows (any
dtype, same on both). The reference indexes on the host (the CPU path: a "host" pool and a "device" pool
both in CPU memory). CUDA: one Triton program per (row, chunk) reads the pinned host rows through unified
addressing and returns at once for an unused row, so the copy is device work whose size follows the
routing: no host synchronisation, and decode steps with offloaded experts capture into CUDA graphs.
"""

from __future__ import annotations

import torch

from kimik3.ops.backend import use_fast_path


def byte_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` [E, ...] (contiguous) as [E, n] words: int32 when the row's bytes allow, else uint8."""
    rows = t.view(t.shape[0], -1).view(torch.uint8)
    return rows.view(torch.int32) if rows.shape[1] % 4 == 0 else rows


def copy_experts(src: torch.Tensor, dst: torch.Tensor, experts: torch.Tensor, rows: torch.Tensor,
                 used: torch.Tensor) -> None:
    """src [E, n] (host pool), dst [R, n]; experts, rows [M] int64; used [E] bool (routed this batch)."""
    if src.dtype != dst.dtype or src.shape[1] != dst.shape[1]:
        raise ValueError(f"copy_experts: rows of {src.dtype} x {src.shape[1]} cannot go into {dst.dtype} x {dst.shape[1]}")
    if experts.numel() == 0:
        return
    if use_fast_path(dst):
        from kimik3.ops.triton.expert_copy import copy_experts_triton
        return copy_experts_triton(src, dst, experts, rows, used)
    need = used[experts].nonzero().view(-1)
    if need.numel():
        dst.index_copy_(0, rows[need], src.index_select(0, experts[need].to(src.device)).to(dst.device))
