"""``--quantization fp8``: the dense projections quantised to FP8 (E4M3) at load, one float32 scale per output
channel (``kimik3.ops.fp8.quantize_weight``), read by ``kimik3.ops.linear.fp8_linear``.

Quantised: every projection of the decoder layers the model reads through its module (``Linear`` /
``MergedLinear`` forward, the MLP's gate/up): the attention blocks' merged input projections, MLA's q_b
and both blocks' o_proj, the dense and shared-expert MLPs, the latent MoE's down projection. Kept in the
model dtype: those the model reads as matrices in other products (MLA's kv_b, absorbed into the attention;
KDA's low-rank gate up-projections; the latent MoE's up projection, fused with the expert combine), the
attention-residual and router vectors, the embedding and the LM head (as vLLM keeps them), and the routed
experts (MXFP4 in K3; bf16 experts stay bf16: the expert kernels do not read FP8).

Per output channel, not 128 x 128 blocks: the scale then commutes with the merged projections' row
stacking (quantising [q | kv | g] at once equals quantising each), and the prefill GEMM is cuBLAS's FP8
GEMM with row-wise scales (``torch._scaled_mm``).
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from kimik3.model.layers import Linear, MergedLinear
from kimik3.ops.fp8 import quantize_weight

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("fp8",)
FP8_PROJECTIONS = re.compile(r"^model\.layers\.\d+\.(.+\.)?(in_proj|q_b_proj|o_proj|gate_up_proj|down_proj|"
                             r"routed_expert_down_proj)$")


def check_quantization(quantization: str | None) -> str | None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported; kimik3 takes {list(QUANTIZATIONS)} "
                         f"(or none: the checkpoint's own formats)")
    return quantization


@torch.no_grad()
def quantize_fp8(model: nn.Module) -> int:
    """Quantise the model's dense projections (``FP8_PROJECTIONS``) in place; returns how many."""
    count = before = after = 0
    for name, module in model.named_modules():
        if not (isinstance(module, (Linear, MergedLinear)) and FP8_PROJECTIONS.match(name)):
            continue
        w = module.weight.data
        if w.dtype == torch.float8_e4m3fn:
            continue
        codes, scale = quantize_weight(w, block=None)
        before += w.numel() * w.element_size()
        module.weight = nn.Parameter(codes, requires_grad=False)
        module.weight_scale = scale.view(-1)
        after += codes.numel() + scale.numel() * 4
        count += 1
    logger.info("FP8 weights: %d dense projections quantised per output channel (%.1f -> %.1f MiB)", count,
                before / 2 ** 20, after / 2 ** 20)
    return count
