"""Mixture of experts (spec text-backbone §3): fp32 router with bias-corrected grouped top-k,
routed experts (on a latent width for K3), shared experts on the original input."""

from __future__ import annotations

import torch
from torch import nn

from kimik3.config import TextConfig
from kimik3.model.layers import MLP, GLUActivation, RMSNorm, linear
from kimik3.ops import mxfp4
from kimik3.ops.moe import fused_moe, fused_moe_mxfp4
from kimik3.ops.norm import acc_dtype
from kimik3.ops.router import route


class Router(nn.Module):
    """``gate.weight`` [E, D] and ``gate.e_score_correction_bias`` [E] (fp32 by default, D4)."""

    def __init__(self, hidden_size: int, num_experts: int, with_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        if with_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        acc = acc_dtype(x.dtype)   # both operands upcast: logits in fp32 (spec §3.1)
        return x.to(acc) @ self.weight.to(acc).t()


class Experts(nn.Module):
    """Routed experts stacked per projection: w1 (gate) and w3 (up) [E, I, L], w2 (down) [E, L, I].
    The checkpoint stores them one by one (``experts.{e}.w{1,2,3}``); ``load_expert`` places them.

    MXFP4 storage (``use_mxfp4_storage``, chosen by the loader on CUDA): w1/w2/w3 hold the packed
    uint8 codes [E, N, K/2] and ``w{1,2,3}_scale`` the E8M0 scales [E, N, K/32]; the kernels
    dequantize on the fly (a quarter of the bytes of bf16)."""

    def __init__(self, num_experts: int, width: int, intermediate: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(num_experts, intermediate, width))
        self.w2 = nn.Parameter(torch.zeros(num_experts, width, intermediate))
        self.w3 = nn.Parameter(torch.zeros(num_experts, intermediate, width))
        self.mxfp4 = False

    def use_mxfp4_storage(self) -> None:
        """Switch to packed storage (before the weights are loaded)."""
        E, I, L = self.w1.shape
        for which, (n, k) in {"w1": (I, L), "w2": (L, I), "w3": (I, L)}.items():
            dev = getattr(self, which).device
            setattr(self, which, nn.Parameter(torch.zeros(E, n, k // 2, dtype=torch.uint8, device=dev),
                                              requires_grad=False))
            self.register_buffer(f"{which}_scale", torch.zeros(E, n, k // mxfp4.GROUP, dtype=torch.uint8, device=dev),
                                 persistent=False)
        self.mxfp4 = True

    def packed(self, which: str) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, which), getattr(self, f"{which}_scale")

    def _check(self, expert: int, which: str, shape: tuple, name: str) -> None:
        E = self.w1.shape[0]
        if not 0 <= expert < E:
            raise ValueError(f"{name}: expert {expert} out of range (model has {E} experts)")
        E, a, b = self.w1.shape if which != "w2" else self.w2.shape
        want = (a, b * 2) if self.mxfp4 else (a, b)
        if tuple(shape) != want:
            raise ValueError(f"{name}: shape {tuple(shape)}, expected {want}")

    def load_expert(self, expert: int, which: str, tensor: torch.Tensor, name: str) -> None:
        """Place a dense expert weight (quantized to MXFP4 when the storage is packed)."""
        self._check(expert, which, tensor.shape, name)
        if self.mxfp4:
            packed, scale = mxfp4.quantize(tensor.float().cpu())
            return self.load_expert_mxfp4(expert, which, packed, scale, name)
        getattr(self, which).data[expert].copy_(tensor)

    def load_expert_mxfp4(self, expert: int, which: str, packed: torch.Tensor, scale: torch.Tensor,
                          name: str) -> None:
        """Place a checkpoint's MXFP4 pair as is (packed storage), or dequantized (dense storage)."""
        if not self.mxfp4:
            return self.load_expert(expert, which, mxfp4.dequantize(packed, scale, torch.float32, name=name), name)
        n, half = packed.shape
        self._check(expert, which, (n, 2 * half), name)
        if packed.dtype != torch.uint8 or scale.dtype != torch.uint8 or tuple(scale.shape) != (n, 2 * half // mxfp4.GROUP):
            raise ValueError(f"{name}: MXFP4 pair {packed.dtype} {tuple(packed.shape)} / {scale.dtype} "
                             f"{tuple(scale.shape)} does not match [N, K/2] uint8 / [N, K/32] uint8")
        if bool((scale == 255).any()):
            raise ValueError(f"{name}: weight_scale holds 255, the E8M0 NaN encoding")
        getattr(self, which).data[expert].copy_(packed)
        getattr(self, f"{which}_scale")[expert].copy_(scale)


class MoE(nn.Module):
    def __init__(self, cfg: TextConfig, act: GLUActivation):
        super().__init__()
        D = cfg.hidden_size
        width = cfg.routed_expert_hidden_size or D
        self.cfg = cfg
        self.act = act
        self.gate = Router(D, cfg.num_experts, with_bias=True)
        self.experts = Experts(cfg.num_experts, width, cfg.moe_intermediate_size)
        if cfg.routed_expert_hidden_size is not None:
            self.routed_expert_down_proj = linear(D, width)
            self.routed_expert_up_proj = linear(width, D)
        if cfg.latent_moe_use_norm:
            self.routed_expert_norm = RMSNorm(width, cfg.rms_norm_eps)
        if cfg.num_shared_experts:
            self.shared_experts = MLP(D, cfg.moe_intermediate_size * cfg.num_shared_experts, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        weights, ids = route(self.gate.logits(x), self.gate.e_score_correction_bias, cfg.num_experts_per_token,
                             cfg.moe_router_activation_func, cfg.num_expert_group, cfg.topk_group,
                             cfg.moe_renormalize, cfg.routed_scaling_factor, cfg.numerics.router_renorm_eps)
        z = self.routed_expert_down_proj(x) if hasattr(self, "routed_expert_down_proj") else x
        if self.experts.mxfp4:
            e = self.experts
            u = fused_moe_mxfp4(z, e.packed("w1"), e.packed("w2"), e.packed("w3"), weights, ids, self.act.hidden_act,
                                self.act.beta, self.act.linear_beta, cfg.numerics.moe_combine_fp32)
        else:
            u = fused_moe(z, self.experts.w1, self.experts.w2, self.experts.w3, weights, ids, self.act,
                          cfg.numerics.moe_combine_fp32)
        if hasattr(self, "routed_expert_norm"):
            u = self.routed_expert_norm(u)
        y = self.routed_expert_up_proj(u) if hasattr(self, "routed_expert_up_proj") else u
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(x)
        return y
