"""Varlen bidirectional attention over packed items: each item's rows attend to all of its own rows and
to no other (MoonViT's block-diagonal attention, spec vision-multimodal §3.4).

Reference: one softmax attention per item (SDPA) in float32 (float64 for float64 inputs). CUDA:
torch's varlen flash-attention forward (``aten._flash_attention_forward`` with cumulative sequence
lengths, the kernel spec vision §3.10 names), all items in one launch; its inputs are device tensors
and Python ints only, so a CUDA graph captures it (``model/encoder_graphs.py``). As an op alone on
the H200 it took 0.3-0.7x the time of our MLA prefill kernel reused with its causal bound past every
key at 256-2304 patches and 0.85-1.02x from 4096 (bench_vision.py at 2f99559): that path was dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kimik3.ops.backend import use_fast_path

KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                     scale: float) -> torch.Tensor:
    """q, k, v [P, H, dh]; cu_seqlens [n + 1] int32 on q's device: item i owns rows [cu[i], cu[i+1]),
    cu[0] = 0, cu[n] = P (empty items allowed); ``max_len`` bounds every item's length. Returns
    o [P, H, dh] in q's dtype: softmax(scale * q k^T) v within each item."""
    if q.ndim != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"varlen_attention needs q, k, v of one shape [P, H, dh], got {list(q.shape)}, "
                         f"{list(k.shape)}, {list(v.shape)}")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"varlen_attention needs cu_seqlens as int32 [n + 1], n >= 1, got {cu_seqlens.dtype} "
                         f"{list(cu_seqlens.shape)}")
    if use_fast_path(q) and kernel_takes(q.dtype, q.shape[-1], q.device):
        return torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, False,
                                                       False, scale=scale)[0]
    return _reference(q, k, v, cu_seqlens, max_len, scale)


def kernel_takes(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether inputs of this dtype and head dim on ``device`` take the flash kernel (else the
    reference, which reads ``cu_seqlens`` on the host and so cannot be captured in a CUDA graph): a
    CUDA sm80+ device, half types, a head dim that is a multiple of 8 up to 256."""
    device = torch.device(device)
    return (device.type == "cuda" and dtype in KERNEL_DTYPES and head_dim % 8 == 0 and head_dim <= 256
            and torch.cuda.get_device_capability(device) >= (8, 0))


def _reference(q, k, v, cu_seqlens, max_len, scale):
    bounds = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if bounds[0] != 0 or bounds[-1] != q.shape[0] or min(lengths) < 0 or max(lengths) > max_len:
        raise ValueError(f"varlen_attention: cu_seqlens {bounds} must rise from 0 to the {q.shape[0]} rows "
                         f"in steps of at most max_len={max_len}")
    ct = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty(q.shape, dtype=ct, device=q.device)
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            qi, ki, vi = (z[a:b].to(ct).transpose(0, 1) for z in (q, k, v))        # [H, L, dh]
            out[a:b] = F.scaled_dot_product_attention(qi, ki, vi, scale=scale).transpose(0, 1)
    return out.to(q.dtype)
