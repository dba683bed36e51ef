"""``--quantization fp8``: the dense projections quantised to FP8 (E4M3) at load, one float32 scale per output
channel (``kimik3.ops.fp8.quantize_weight``), read by ``kimik3.ops.linear.fp8_linear``.

Quantised: every projection of the decoder layers the model reads through its module (``Linear`` /
``MergedLinear`` forward, the MLP's gate/up): the attention blocks' merged input projections, MLA's q_b
and both blocks' o_proj, the dense and shared-expert MLPs, the latent MoE's down projection. Kept in the
model dtype: those the model reads as matrices in other products (MLA's kv_b, absorbed into the attention;
KDA's low-rank gate up-projections; the latent MoE's up projection, fused with the expert combine), the
attention-residual and router vectors, the embedding and the LM head (as vLLM keeps them). Routed experts the
checkpoint stores in bf16 (Kimi-Linear's) are quantised too, per output channel, as they load
(``Experts.use_fp8_storage``, chosen by ``loader/load.py``), and run through ``kimik3.ops.moe.fused_moe_fp8``;
K3's MXFP4 experts stay MXFP4 (their FP8 path is W4A8: ``KernelOptions.w4a8_moe``).

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
from kimik3.ops.fp8 import dequantize_weight, quantize_weight

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
def quantize_fp8(model: nn.Module, experts: bool = False) -> int:
    """Quantise the model's dense projections (``FP8_PROJECTIONS``) in place; returns how many. ``experts``: its
    dense routed experts too (``Experts.to_fp8``; the loader quantises them as they load instead)."""
    if experts:
        from kimik3.model.moe import Experts
        moved = [m for m in model.modules() if isinstance(m, Experts) and not (m.mxfp4 or m.fp8)]
        for m in moved:
            m.to_fp8()
        logger.info("FP8 weights: %d routed-expert modules quantised per output channel", len(moved))
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


class BlockFp8Checkpoint:
    """Reading a block-FP8 checkpoint (DeepSeek's / Kimi's ``quantization_config: {quant_method: fp8,
    weight_block_size: [128, 128]}``): each E4M3 ``X.weight`` is paired with its float32 ``X.weight_scale_inv``
    [ceil(N / 128), ceil(K / 128)] (the factor that multiplies the codes back). Every pair is dequantised (in
    float64, exactly) for the parameter it fills; the dense projections' codes and scales are kept and, once
    the load is done, installed as stored (``install``): a module whose checkpoint tensors all came FP8 and
    whose merged parts start on 128-row boundaries (so their block scales stack) keeps the checkpoint's bytes;
    any other stays in the model dtype (logged)."""

    def __init__(self):
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.stored: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def holds(name: str, tensor: torch.Tensor) -> bool:
        return name.endswith(".weight_scale_inv") or tensor.dtype == torch.float8_e4m3fn

    def take(self, name: str, tensor: torch.Tensor, where: str) -> tuple[str, torch.Tensor] | None:
        """One half of a pair; when both are in, (the weight's name, its dequantised float64 values)."""
        from kimik3.loader.safetensors_files import CheckpointError
        scale = name.endswith(".weight_scale_inv")
        base = name.removesuffix("_scale_inv")
        if not scale and not name.endswith(".weight"):
            raise CheckpointError(f"{where}: an E4M3 tensor that is not a weight ('{name}')")
        halves = self.pending.setdefault(base, {})
        halves["scale" if scale else "codes"] = tensor
        if len(halves) < 2:
            return None
        del self.pending[base]
        codes, inv = halves["codes"], halves["scale"].float()
        N, K = codes.shape[-2:] if codes.dim() >= 2 else (0, 0)
        if codes.dim() != 2 or codes.dtype != torch.float8_e4m3fn or inv.shape != (-(-N // 128), -(-K // 128)):
            raise CheckpointError(f"{where}: '{base}' ({codes.dtype} {tuple(codes.shape)}) and its weight_scale_inv "
                                  f"{tuple(inv.shape)} are not an E4M3 matrix with 128 x 128 block scales")
        if ".experts." not in base:        # routed experts are dequantised (and re-quantised per channel under
            # --quantization fp8: the expert kernels take channel scales, not 128 x 128 blocks)
            self.stored[base] = (codes, inv)
        return base, dequantize_weight(codes, inv, torch.float64)

    def check_complete(self) -> None:
        from kimik3.loader.safetensors_files import CheckpointError
        if self.pending:
            base, halves = next(iter(self.pending.items()))
            have = "weight_scale_inv" if "scale" in halves else "weight"
            raise CheckpointError(f"block-FP8 checkpoint: '{base}' has its {have} but not its "
                                  f"{'weight' if have != 'weight' else 'weight_scale_inv'}")

    @torch.no_grad()
    def install(self, model: nn.Module) -> int:
        """Put the stored codes and block scales into the dense projections they fit; returns how many."""
        count = 0
        for name, module in model.named_modules():
            if not (isinstance(module, (Linear, MergedLinear)) and FP8_PROJECTIONS.match(name)):
                continue
            parent = name.rsplit(".", 1)[0]
            parts = [(f"{parent}.{p}.weight", rows) for p, rows in module.parts.items()] \
                if isinstance(module, MergedLinear) else [(f"{name}.weight", module.weight.shape[0])]
            stacked = all(rows % 128 == 0 for _, rows in parts[:-1])
            if not all(p in self.stored for p, _ in parts) or not stacked:
                logger.info("block-FP8 checkpoint: %s stays in the model dtype (%s)", name,
                            "its parts do not start on 128-row boundaries" if stacked is False else "not all FP8")
                continue
            device = module.weight.device
            module.weight = nn.Parameter(torch.cat([self.stored[p][0] for p, _ in parts]).to(device), requires_grad=False)
            module.weight_scale = torch.cat([self.stored[p][1] for p, _ in parts]).to(device)
            count += 1
        self.stored.clear()
        logger.info("block-FP8 checkpoint: %d dense projections kept as stored (E4M3, 128 x 128 scales)", count)
        return count
