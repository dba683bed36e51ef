"""``copy_experts`` on CUDA (``kimik3.ops.expert_copy``): program (j, c) copies chunk c of expert
``experts[j]``'s row into ``dst[rows[j]]`` when ``used[experts[j]]``, else returns. ``src`` may be pinned host
memory (read through unified addressing, Triton accepts such pointers)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096          # words a program moves (16 KiB of int32)


@triton.jit
def _copy_kernel(src, dst, experts, rows, used, n, CHUNK: tl.constexpr):
    j = tl.program_id(0)
    e = tl.load(experts + j)
    if tl.load(used + e) != 0:
        r = tl.load(rows + j)
        offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        mask = offs < n
        words = tl.load(src + e * n + offs, mask=mask)
        tl.store(dst + r * n + offs, words, mask=mask)


def copy_experts_triton(src: torch.Tensor, dst: torch.Tensor, experts: torch.Tensor, rows: torch.Tensor,
                        used: torch.Tensor) -> None:
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_experts: the pools must be contiguous")
    n = src.shape[1]
    grid = (experts.numel(), triton.cdiv(n, CHUNK))
    _copy_kernel[grid](src, dst, experts, rows, used.view(torch.uint8), n, CHUNK=CHUNK)
