"""Routed experts: y_t = sum_j weights[t, j] * E_{ids[t, j]}(x_t), E_e(x) = act(x W1_e^T, x W3_e^T) W2_e^T.

``fused_moe`` takes dense stacked weights, ``fused_moe_mxfp4`` MXFP4-packed experts. CUDA (bf16,
and fp16 for dense weights): one family of Triton grouped GEMMs (``kimik3.ops.triton.moe``) with
the weight format a compile-time parameter, the activation fused into the first GEMM and the fp32
combine; no host synchronisation, so decode steps capture into CUDA graphs. MXFP4 experts at decode sizes on
Hopper take ``kimik3.ops.triton.moe_wgmma`` (the weights as the tensor cores' register operand). Dense bf16 experts with
many rows per expert (prefill) run as ``torch._grouped_mm`` between the same sort, gating and combine
(``KernelTuning.grouped_mm_rows_per_expert``), where the library's tiles are faster. Reference (CPU, and
fp32/fp64 anywhere): a loop over the experts that received tokens (MXFP4: each used expert
dequantized first).

``slots`` (an expert cache, ``kimik3.model.expert_offload``): the weight tensors are a pool of rows and
expert e's weights are row ``slots[e]``. The result is the same as with the experts stacked in id order,
bit for bit: the kernels sort the assignments by expert id as before and look up only the weight rows, and
the reference loops over expert ids as before.
"""

from __future__ import annotations

import torch

from kimik3.ops import mxfp4
from kimik3.ops.activation import glu_activation
from kimik3.ops.backend import use_fast_path
from kimik3.ops.norm import acc_dtype


def fused_moe(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
              weights: torch.Tensor, ids: torch.Tensor, hidden_act: str, beta: float,
              linear_beta: float | None, combine_fp32: bool, slots: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, L]; w1, w3 [E, I, L]; w2 [E, L, I]; weights [T, k] fp32; ids [T, k].
    ``hidden_act`` "situ" (beta, linear_beta) or "silu".
    combine_fp32: each expert output (x's dtype) is scaled by its fp32 weight and summed in
    fp32, rounded once (official); else the sum is accumulated in x's dtype.
    CUDA (bf16/fp16 x and weights): the Triton kernels always combine in fp32 with one rounding.
    """
    act = glu_activation(hidden_act, beta, linear_beta)
    if use_fast_path(x) and x.dtype in (torch.bfloat16, torch.float16) and w1.dtype == x.dtype:
        from kimik3.ops.triton.moe import fused_moe_triton
        return fused_moe_triton(x, w1, w2, w3, weights, ids, hidden_act == "situ", beta, linear_beta, slots=slots)
    row = _rows(slots)
    return _expert_loop(x, lambda e, which: (w1, w2, w3)[which - 1][row(e)], weights, ids, act, combine_fp32)


def _rows(slots: torch.Tensor | None):
    """Expert id -> its row of the weight tensors (itself without an expert cache)."""
    if slots is None:
        return lambda e: e
    table = slots.tolist()
    return lambda e: table[e]


def fused_moe_mxfp4(x: torch.Tensor, w1: tuple[torch.Tensor, torch.Tensor], w2: tuple[torch.Tensor, torch.Tensor],
                    w3: tuple[torch.Tensor, torch.Tensor], weights: torch.Tensor, ids: torch.Tensor,
                    hidden_act: str, beta: float, linear_beta: float | None, combine_fp32: bool,
                    scale_max: int | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
    """Same function with MXFP4 experts: w1, w3 = (packed uint8 [E, I, L/2], scale uint8 [E, I, L/32]),
    w2 = (packed [E, L, I/2], scale [E, L, I/32]). ``hidden_act`` "situ" (beta, linear_beta) or "silu".
    ``scale_max``: the largest E8M0 scale code in the weights when known (None: any); the CUDA
    dequantization is one multiply cheaper when it is <= 128.
    CUDA (bf16 x): the Triton kernels always combine in fp32 with one rounding."""
    act = glu_activation(hidden_act, beta, linear_beta)
    if use_fast_path(x) and x.dtype == torch.bfloat16:
        from kimik3.ops.triton.moe import fused_moe_triton
        return fused_moe_triton(x, w1, w2, w3, weights, ids, hidden_act == "situ", beta, linear_beta,
                                high_scales=scale_max is None or scale_max > 128, slots=slots)
    row = _rows(slots)

    def weight(e, which):
        packed, scale = (w1, w2, w3)[which - 1]
        return mxfp4.dequantize(packed[row(e)], scale[row(e)], x.dtype, name=f"expert {e} w{which}")

    return _expert_loop(x, weight, weights, ids, act, combine_fp32)


def _expert_loop(x, weight, weights, ids, act, combine_fp32):
    """``weight(e, which)`` gives expert e's w1/w2/w3 ([I, L], [L, I], [I, L]) in x's dtype."""
    T, L = x.shape
    acc = acc_dtype(x.dtype) if combine_fp32 else x.dtype
    out = torch.zeros(T, L, dtype=acc, device=x.device)
    for e in torch.unique(ids.reshape(-1)).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[tok]
        ye = act(xe @ weight(e, 1).t(), xe @ weight(e, 3).t()) @ weight(e, 2).t()      # [n, L] in x's dtype
        out.index_add_(0, tok, ye.to(acc) * weights[tok, slot].unsqueeze(-1).to(acc))
    return out.to(x.dtype)
