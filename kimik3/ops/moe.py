"""Routed experts: y_t = sum_j weights[t, j] * E_{ids[t, j]}(x_t), E_e(x) = act(x W1_e^T, x W3_e^T) W2_e^T.

``fused_moe`` takes dense stacked weights, ``fused_moe_mxfp4`` MXFP4-packed experts. CUDA (bf16,
and fp16 for dense weights): one family of Triton grouped GEMMs (``kimik3.ops.triton.moe``) with
the weight format a compile-time parameter, the activation fused into the first GEMM and the fp32
combine; no host synchronisation, so decode steps capture into CUDA graphs. MXFP4 experts at decode sizes on
Hopper take ``kimik3.ops.triton.moe_wgmma`` (the weights as the tensor cores' register operand). Dense bf16 experts with
many rows per expert (prefill) run as ``torch._grouped_mm`` between the same sort, gating and combine
(``KernelTuning.grouped_mm_rows_per_expert``), where the library's tiles are faster. Reference (CPU, and
fp32/fp64 anywhere): a loop over the experts that received tokens (MXFP4: each used expert
dequantized first), ``_expert_loop``; what runs there is ``_grouped_experts``, the same products with the
per-expert work cut to its GEMMs (a CPU decode or verify step of a small model is bound by per-op overhead).

FP8 activations (``kimik3.ops.fp8.round_trip_groups``: per row and ``group`` columns, power-of-two scales):
``fused_moe_fp8`` (FP8 experts, ``--quantization fp8`` of bf16 experts) quantises them per 128 columns from
``KernelTuning.fp8_experts_quant_rows_per_expert`` rows per expert (prefill), the products then on the FP8
tensor cores; below, the E4M3 weights are widened in the kernel and the activations stay as they are.
``fused_moe_mxfp4`` under ``KernelOptions.w4a8_moe`` quantises them per 32 (MXFP8) from
``KernelTuning.w4a8_rows_per_expert`` rows per expert (W4A8). The references round the same way and multiply
in float32 (float64 for float64 activations), rounding to x's dtype where the kernels do: each gate / up
product, the activation's output, each expert's output.

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
from kimik3.ops.fp8 import MX_GROUP, WEIGHT_BLOCK, dequantize_weight, round_trip_groups
from kimik3.ops.linear import linear
from kimik3.ops.norm import acc_dtype
from kimik3.ops.options import kernel_options, tuning


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
    return _grouped_experts(x, lambda e, which: (w1, w2, w3)[which - 1][row(e)], weights, ids, act, combine_fp32)


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
    w4a8 = w4a8_applies(ids, w1[0].shape[0] if slots is None else slots.shape[0])
    if use_fast_path(x) and x.dtype == torch.bfloat16:
        from kimik3.ops.triton.moe import fused_moe_triton
        return fused_moe_triton(x, w1, w2, w3, weights, ids, hidden_act == "situ", beta, linear_beta,
                                high_scales=scale_max is None or scale_max > 128, slots=slots,
                                act_group=MX_GROUP if w4a8 else None)
    row = _rows(slots)

    def weight(e, which, dtype=x.dtype):
        packed, scale = (w1, w2, w3)[which - 1]
        return mxfp4.dequantize(packed[row(e)], scale[row(e)], dtype, name=f"expert {e} w{which}")

    if w4a8:
        return _quantized_expert_loop(x, weight, weights, ids, act, combine_fp32, MX_GROUP)
    return _grouped_experts(x, weight, weights, ids, act, combine_fp32)


def w4a8_applies(ids: torch.Tensor, num_experts: int) -> bool:
    """MXFP4 experts take MXFP8 activations (W4A8) for this routing: ``KernelOptions.w4a8_moe`` on and at
    least ``KernelTuning.w4a8_rows_per_expert`` rows per expert on average."""
    return kernel_options().w4a8_moe and ids.numel() >= tuning().w4a8_rows_per_expert * num_experts


def fp8_act_group(ids: torch.Tensor, num_experts: int) -> int | None:
    """FP8 experts: the activations' quantisation group for this routing (128 from
    ``KernelTuning.fp8_experts_quant_rows_per_expert`` rows per expert on average, else None: not quantised)."""
    return WEIGHT_BLOCK if ids.numel() >= tuning().fp8_experts_quant_rows_per_expert * num_experts else None


def fused_moe_fp8(x: torch.Tensor, w1: tuple[torch.Tensor, torch.Tensor], w2: tuple[torch.Tensor, torch.Tensor],
                  w3: tuple[torch.Tensor, torch.Tensor], weights: torch.Tensor, ids: torch.Tensor, hidden_act: str,
                  beta: float, linear_beta: float | None, combine_fp32: bool,
                  slots: torch.Tensor | None = None) -> torch.Tensor:
    """Same function with FP8 experts: w1, w3 = (E4M3 codes [E, I, L], float32 scale [E, I] per output
    channel), w2 = (codes [E, L, I], scale [E, L]); expert e's weight is codes[e] * scale[e][:, None].
    The activations are quantised per 128 columns at prefill sizes (``fp8_act_group``).
    CUDA (bf16 / fp16 x): the Triton kernels (fp32 combine, one rounding); elsewhere the reference."""
    act = glu_activation(hidden_act, beta, linear_beta)
    for name, (codes, scale) in zip(("w1", "w2", "w3"), (w1, w2, w3)):
        if codes.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32 or scale.shape != codes.shape[:2]:
            raise ValueError(f"fused_moe_fp8: {name} must be (float8_e4m3fn codes [E, N, K], float32 scale [E, N]), "
                             f"got {codes.dtype} {tuple(codes.shape)} and {scale.dtype} {tuple(scale.shape)}")
    group = fp8_act_group(ids, w1[0].shape[0] if slots is None else slots.shape[0])
    if use_fast_path(x) and x.dtype in (torch.bfloat16, torch.float16):
        from kimik3.ops.triton.moe import fused_moe_triton
        return fused_moe_triton(x, w1, w2, w3, weights, ids, hidden_act == "situ", beta, linear_beta, slots=slots,
                                act_group=group)
    row = _rows(slots)

    def weight(e, which, dtype):
        codes, scale = (w1, w2, w3)[which - 1]
        return dequantize_weight(codes[row(e)], scale[row(e)].unsqueeze(-1), dtype)

    return _quantized_expert_loop(x, weight, weights, ids, act, combine_fp32, group)


def _quantized_expert_loop(x, weight, weights, ids, act, combine_fp32, group: int | None):
    """The reference of the FP8 kernels: ``weight(e, which, dtype)`` gives expert e's w1/w2/w3 dequantised in
    ``dtype``; products in float32 (float64 for float64 x), each rounded to x's dtype where the kernels round it
    (gate, up, the activation's output, the expert's output); ``group``: the activations (x and the
    activation's output) are read through ``round_trip_groups`` first (None: as they are)."""
    T, L = x.shape
    prec = torch.promote_types(x.dtype, torch.float32)
    acc = acc_dtype(x.dtype) if combine_fp32 else x.dtype
    out = torch.zeros(T, L, dtype=acc, device=x.device)

    def read(a):
        return (a if group is None else round_trip_groups(a, group)).to(prec)

    for e in torch.unique(ids.reshape(-1)).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = read(x[tok])
        gate, up = ((xe @ weight(e, which, prec).t()).to(x.dtype) for which in (1, 3))
        ye = (read(act(gate, up)) @ weight(e, 2, prec).t()).to(x.dtype)
        out.index_add_(0, tok, ye.to(acc) * weights[tok, slot].unsqueeze(-1).to(acc))
    return out.to(x.dtype)


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


def _grouped_experts(x, weight, weights, ids, act, combine_fp32):
    """``_expert_loop``'s sum with fewer ops (the CPU path): the (token, slot) assignments sorted by expert once
    (stable: a token's experts stay in id order), the tokens gathered once, each used expert's three GEMMs on its
    rows (joined by one cat per projection), then the activation, the weighting and the combine once for all rows.
    Every row is the product ``_expert_loop`` forms for it (the same GEMM shapes per expert, through
    ``ops.linear``'s host GEMMs; elementwise activation; the combine adding a token's experts in id order), up to
    the GEMM's rounding. CPU, the default model's experts (8 of 256 x 128, top-2, SITU; one
    thread, this box's EPYC): 164 against 202 us at 1 token, 342 / 613 at 5, 646 / 1101 at 32, 1830 / 2297 at
    160."""
    T, L = x.shape
    acc = acc_dtype(x.dtype) if combine_fp32 else x.dtype
    out = torch.zeros(T, L, dtype=acc, device=x.device)
    flat = ids.reshape(-1)
    if flat.numel() == 0:
        return out.to(x.dtype)
    order = torch.argsort(flat, stable=True)
    tok = order // ids.shape[1]
    xs = x.index_select(0, tok)
    spans, start, gate, up = [], 0, [], []
    for e, n in enumerate(torch.bincount(flat).tolist()):
        if n:
            rows = slice(start, start + n)
            gate.append(linear(xs[rows], weight(e, 1)))
            up.append(linear(xs[rows], weight(e, 3)))
            spans.append((e, rows))
        start += n
    h = act(torch.cat(gate), torch.cat(up))
    y = torch.cat([linear(h[rows], weight(e, 2)) for e, rows in spans])
    out.index_add_(0, tok, y.to(acc) * weights.reshape(-1)[order].unsqueeze(-1).to(acc))
    return out.to(x.dtype)
