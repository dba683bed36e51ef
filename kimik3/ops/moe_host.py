"""Routed experts with some experts computed on the host (expert offload's ``host`` strategy,
``kimik3.model.offload_policy``): the same function as ``fused_moe`` / ``fused_moe_mxfp4`` / ``fused_moe_fp8`` with
``slots``, except that the experts ``missed[e]`` take their weights from host tensors (expert e at index e) and
the host computes their rows.

Reference (the CPU path, where "device" and host are both CPU memory): what ``fused_moe`` runs there
(``ops.moe._grouped_experts``; FP8: ``_quantized_expert_loop`` with its roundings), each expert's weights read where
they are, so the result is the resident experts', bit for bit. CUDA: the routing comes to the host (a
synchronisation: eager steps only); the GPU kernels run the cached experts' pairs (a missed pair is given weight 0
and a cached expert, so the kernels' shapes are unchanged); the host computes the missed pairs' rows (MXFP4
decoded through a byte table, FP8 codes times their scales) and their weighted sum in float32, which is added to
the kernels' (rounded) sum on the GPU. Two roundings and the host's product order: within a unit of the last
place of the kernels' result, not bit-exact.
"""

from __future__ import annotations

import functools

import torch

from kimik3.ops import mxfp4
from kimik3.ops.activation import glu_activation
from kimik3.ops.backend import use_fast_path
from kimik3.ops.fp8 import dequantize_weight
from kimik3.ops.moe import _grouped_experts, _quantized_expert_loop, _rows, fp8_act_group, fused_moe, fused_moe_fp8, \
    fused_moe_mxfp4


@functools.cache
def _byte_table(device: str) -> torch.Tensor:
    """[256, 2] float32: the two E2M1 values of a packed byte (low nibble first)."""
    values = torch.tensor(mxfp4.E2M1_VALUES, dtype=torch.float32, device=device)
    codes = torch.arange(256, device=device)
    return torch.stack((values[codes & 0x0F], values[codes >> 4]), dim=-1)


def decode(w, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert row e of a weight in ``fused_moe``'s formats (a dense [E, N, K] tensor, an MXFP4 pair or an FP8 pair)
    in ``dtype``. MXFP4: the same values as ``mxfp4.dequantize`` (E2M1 x 2^(s - 127) in float32, then ``dtype``);
    FP8: as ``ops.fp8.dequantize_weight`` (codes x the channel's scale)."""
    if not isinstance(w, tuple):
        return w[e].to(dtype)
    if w[0].dtype == torch.float8_e4m3fn:
        return dequantize_weight(w[0][e], w[1][e].unsqueeze(-1), dtype)
    packed, scale = w[0][e], w[1][e]
    n, half = packed.shape
    values = _byte_table(str(packed.device))[packed.long()].view(n, half * 2 // mxfp4.GROUP, mxfp4.GROUP)
    factor = torch.exp2(scale.to(torch.float32) - 127.0).unsqueeze(-1)
    return (values * factor).view(n, 2 * half).to(dtype)


def expert_rows(x: torch.Tensor, w1, w2, w3, e: int, act) -> torch.Tensor:
    """Expert e on rows x [n, L] -> [n, L] in x's dtype: act(x W1^T, x W3^T) W2^T."""
    return act(x @ decode(w1, e, x.dtype).t(), x @ decode(w3, e, x.dtype).t()) @ decode(w2, e, x.dtype).t()


def fused_moe_host_misses(x: torch.Tensor, pool: tuple, host: tuple, weights: torch.Tensor, ids: torch.Tensor,
                          missed: torch.Tensor, hidden_act: str, beta: float, linear_beta: float | None,
                          combine_fp32: bool, slots: torch.Tensor, scale_max: int | None = None,
                          fp8: bool = False) -> torch.Tensor:
    """x [T, L]; ``pool`` (w1, w2, w3) as ``fused_moe`` / ``fused_moe_mxfp4`` / ``fused_moe_fp8`` (``fp8``) take
    them with ``slots`` [E]; ``host`` (w1, w2, w3) the same format with expert e at index e, in host memory;
    ``missed`` [E] bool on the host: the experts the host computes. -> [T, L] in x's dtype."""
    act = glu_activation(hidden_act, beta, linear_beta)
    table = missed.tolist()
    if not use_fast_path(x):
        row = _rows(slots)
        if fp8:                      # the FP8 reference: its roundings and activation groups (``fused_moe_fp8``)
            def weight_fp8(e, which, dtype):
                return decode(host[which - 1], e, dtype) if table[e] else decode(pool[which - 1], row(e), dtype)
            return _quantized_expert_loop(x, weight_fp8, weights, ids, act, combine_fp32,
                                          fp8_act_group(ids, slots.shape[0]))

        def weight(e, which):
            return decode(host[which - 1], e, x.dtype) if table[e] else decode(pool[which - 1], row(e), x.dtype)

        return _grouped_experts(x, weight, weights, ids, act, combine_fp32)
    ids_host = ids.cpu()                                           # waits for the routing
    pairs = missed[ids_host]
    kernel = fused_moe_fp8 if fp8 else fused_moe_mxfp4 if isinstance(pool[0], tuple) else fused_moe
    extra = {"scale_max": scale_max} if kernel is fused_moe_mxfp4 else {}
    if not bool(pairs.any()):
        return kernel(x, *pool, weights, ids, hidden_act, beta, linear_beta, combine_fp32, slots=slots, **extra)
    out = torch.zeros(x.shape, dtype=torch.float32)
    tok, slot = pairs.nonzero(as_tuple=True)
    w_host = weights[pairs.to(weights.device)].cpu()
    x_host = x.cpu()
    picked = ids_host[tok, slot]
    for e in torch.unique(picked).tolist():
        sel = (picked == e).nonzero().view(-1)
        y = expert_rows(x_host[tok[sel]], *host, e, act)
        out.index_add_(0, tok[sel], y.float() * w_host[sel].unsqueeze(-1))
    if all(table):
        return out.to(x.device).to(x.dtype)
    keep = table.index(False)                                      # a cached expert stands in for missed pairs
    mask = pairs.to(ids.device)
    gpu = kernel(x, *pool, weights.masked_fill(mask, 0.0), ids.masked_fill(mask, keep), hidden_act, beta,
                 linear_beta, combine_fp32, slots=slots, **extra)
    return (gpu.float() + out.to(x.device, non_blocking=True)).to(x.dtype)
