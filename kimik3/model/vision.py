"""MoonViT vision tower, ``sd2_tpool`` merge and ``patchmergerv2`` projector (spec vision-multimodal §3).

Input: ``pixel_values`` [P, 3, p, p] and ``grid_thws`` [B, 3] int rows (t, h, w) in patches,
P = sum_b t_b*h_b*w_b, items concatenated in prompt order (kimik3/vision/preprocess.py).
Output of ``KimiVisionModel.encode_images``: [sum_b (h_b/2)*(w_b/2), text_hidden], one row per
``<|media_pad|>`` token, items in order.

Module and parameter names equal the checkpoint's tensor names once the ``vision_tower.`` /
``mm_projector.`` prefixes are stripped (spec §6), so a generic loader fills them. Attention is
block-diagonal varlen attention (``ops/attention.py``: a per-item loop on the CPU, one flash kernel
launch on CUDA). Compute precision: RMSNorm statistics, RoPE and softmax run in float32 for bf16/fp32
weights and in float64 for a float64 tower.

The tower runs in two parts: ``MoonViT.prepare`` turns the items' grids into tensors (position
embeddings, RoPE tables, item bounds), ``MoonViT.run`` is the fixed-shape rest, which
``model/encoder_graphs.py`` captures as CUDA graphs over a ladder of patch budgets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kimik3.config import VisionConfig
from kimik3.ops.attention import varlen_attention
from kimik3.ops.norm import rms_norm_fp32_weight
from kimik3.ops.rope import rotate_pairs

ROPE_THETA = 10000.0
ROPE_MAX_GRID = 512     # the official tower precomputes a 512x512 RoPE table and asserts h, w <= 512
TIME_THETA = 10000.0


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types and float32, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


class VisionRMSNorm(nn.Module):
    """``torch.nn.RMSNorm`` semantics: statistics and the weight product in float32 (float64 for a
    float64 input), one rounding back to the input dtype (D9). ``eps`` is a model constant (D24).
    ``ops.norm.rms_norm_fp32_weight``: one kernel on CUDA."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_fp32_weight(x, self.weight, self.eps, x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def sincos_time_table(num_frames: int, dim: int) -> torch.Tensor:
    """[num_frames, dim]: T[tau, j] = sin(tau*w_j), T[tau, dim/2 + j] = cos(tau*w_j),
    w_j = 10000^(-j/(dim/2)); every step rounded to float32 as the official table is (§3.2)."""
    if dim % 2:
        raise ValueError(f"time embedding needs an even width, got {dim}")
    half = dim // 2
    omega = np.arange(half, dtype=np.float32) / np.float32(half)
    omega = np.float32(1.0) / np.power(np.float32(TIME_THETA), omega)
    angles = np.arange(num_frames, dtype=np.float32)[:, None] * omega[None, :]
    return torch.from_numpy(np.concatenate([np.sin(angles), np.cos(angles)], axis=1))


class PosEmbDividedFixed(nn.Module):
    """Learnable [Rh, Rw, D] table resampled to each item's (h, w), plus a fixed sin/cos time
    row per frame when t > 1 (``pos_emb_type = divided_fixed``)."""

    def __init__(self, height: int, width: int, num_frames: int, dim: int, interpolation_mode: str = "bilinear",
                 *, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        if interpolation_mode not in ("bilinear", "bicubic"):
            raise ValueError(f"pos_emb_interpolation_mode must be 'bilinear' or 'bicubic', got {interpolation_mode!r}")
        self.num_frames = num_frames
        self.interpolation_mode = interpolation_mode
        self.weight = nn.Parameter(torch.empty(height, width, dim, dtype=dtype, device=device))
        # Fixed, never in checkpoints; a plain CPU tensor (float32 numbers), not a buffer, so that
        # building the model on the meta device and materialising it with to_empty keeps its values.
        self.time_weight = sincos_time_table(num_frames, dim)

    def table_for(self, h: int, w: int) -> torch.Tensor:
        """[h*w, D] row-major; the stored table itself iff (h, w) equals its size."""
        rh, rw, d = self.weight.shape
        if (h, w) == (rh, rw):
            return self.weight.reshape(rh * rw, d)
        # Resampled in the parameter's dtype (bf16 in serving), as the official tower does.
        img = self.weight.permute(2, 0, 1).unsqueeze(0)                         # [1, D, Rh, Rw]
        out = F.interpolate(img, size=(h, w), mode=self.interpolation_mode, align_corners=False)
        return out.squeeze(0).permute(1, 2, 0).reshape(h * w, d)

    def forward(self, shapes: list[tuple[int, int, int]]) -> torch.Tensor:
        parts = []
        for t, h, w in shapes:
            pe = self.table_for(h, w)
            if t > 1:   # nothing is added for t == 1, not even T[0]
                time = self.time_weight[:t].to(device=pe.device, dtype=pe.dtype)
                pe = (pe.unsqueeze(0) + time.unsqueeze(1)).reshape(t * h * w, -1)
            parts.append(pe)
        return torch.cat(parts)


class PatchEmbed(nn.Module):
    def __init__(self, patch_size: int, dim: int, pos_emb_height: int, pos_emb_width: int, pos_emb_time: int,
                 interpolation_mode: str, *, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size, bias=False,
                              dtype=dtype, device=device)
        self.pos_emb = PosEmbDividedFixed(pos_emb_height, pos_emb_width, pos_emb_time, dim, interpolation_mode,
                                          dtype=dtype, device=device)

    def forward(self, pixel_values: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """[P, 3, p, p] and the items' position embeddings ``pos_emb(shapes)`` [P, D] -> [P, D]."""
        x = self.proj(pixel_values).reshape(pixel_values.shape[0], -1)          # [P, D]
        return x + pos


def rope_2d(h: int, w: int, head_dim: int, dtype: torch.dtype, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [h*w, head_dim/2] for patches in row-major order. Pair 2j rotates by x*f_j
    (column), pair 2j+1 by y*f_j (row), f_j = 10000^(-4j/head_dim), j < head_dim/4 (§3.3)."""
    if head_dim % 4:
        raise ValueError(f"2D RoPE needs a head dim divisible by 4, got {head_dim}")
    freqs = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 4, device=device).to(dtype) / head_dim))
    ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    ax = xs.reshape(-1, 1).to(dtype) * freqs                                     # [h*w, dh/4]
    ay = ys.reshape(-1, 1).to(dtype) * freqs
    angles = torch.stack([ax, ay], dim=-1).reshape(h * w, head_dim // 2)
    return angles.cos(), angles.sin()


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, *, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden, bias=False, dtype=dtype, device=device)
        self.fc1 = nn.Linear(hidden, dim, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


@dataclass
class TowerInputs:
    """What the tower's fixed-shape part needs of its items' grids (``MoonViT.prepare``), P rows."""
    pos: torch.Tensor           # [P, D] position embeddings (time rows added for video), tower dtype
    cos: torch.Tensor           # [P, dh/2] 2D RoPE tables, the compute dtype (float32; float64 for float64)
    sin: torch.Tensor
    cu_seqlens: torch.Tensor    # [n + 1] int32: item i owns rows [cu[i], cu[i+1])
    max_len: int                # bound on every item's length


class EncoderBlock(nn.Module):
    """Pre-norm block: x += Wo(attn(rope(Q), rope(K), V)); x += fc1(gelu_tanh(fc0(norm1(x))))."""

    def __init__(self, dim: int, num_heads: int, qkv_dim: int, mlp_dim: int, norm_eps: float,
                 *, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        if qkv_dim % num_heads:
            raise ValueError(f"qkv_hidden_size {qkv_dim} is not divisible by {num_heads} heads")
        self.num_heads = num_heads
        self.head_dim = qkv_dim // num_heads
        self.norm0 = VisionRMSNorm(dim, norm_eps, dtype=dtype, device=device)
        self.wqkv = nn.Linear(dim, 3 * qkv_dim, bias=False, dtype=dtype, device=device)
        self.wo = nn.Linear(qkv_dim, dim, bias=False, dtype=dtype, device=device)
        self.norm1 = VisionRMSNorm(dim, norm_eps, dtype=dtype, device=device)
        self.mlp = VisionMLP(dim, mlp_dim, dtype=dtype, device=device)

    def attention(self, x: torch.Tensor, items: TowerInputs) -> torch.Tensor:
        n = x.shape[0]
        H = self.num_heads
        qkv = self.wqkv(x).view(n, 3 * H, self.head_dim)                       # slot-major: Q, K, V heads
        qk = rotate_pairs(qkv[:, :2 * H], items.cos, items.sin)                  # Q and K as 2H heads
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, 2 * H:]                           # [P, H, dh]
        # block-diagonal: each item attends only to itself (all its frames)
        out = varlen_attention(q, k, v, items.cu_seqlens, items.max_len, self.head_dim ** -0.5)
        return self.wo(out.reshape(n, -1))

    def forward(self, x: torch.Tensor, items: TowerInputs) -> torch.Tensor:
        x = x + self.attention(self.norm0(x), items)
        return x + self.mlp(self.norm1(x))


class VisionEncoder(nn.Module):
    def __init__(self, dim: int, num_layers: int, num_heads: int, qkv_dim: int, mlp_dim: int, norm_eps: float,
                 *, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.head_dim = qkv_dim // num_heads
        self.blocks = nn.ModuleList(EncoderBlock(dim, num_heads, qkv_dim, mlp_dim, norm_eps, dtype=dtype,
                                                 device=device) for _ in range(num_layers))
        self.final_layernorm = VisionRMSNorm(dim, norm_eps, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, items: TowerInputs) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, items)
        return self.final_layernorm(x)


def tpool_merge(x: torch.Tensor, shapes: list[tuple[int, int, int]], kernel: tuple[int, int]) -> torch.Tensor:
    """``sd2_tpool``: [P, D] -> [sum (h/kh)*(w/kw), kh*kw*D]; each row concatenates the kernel's
    patches row-major (TL, TR, BL, BR for 2x2), each averaged over the item's t frames."""
    kh, kw = kernel
    d = x.shape[-1]
    out, start = [], 0
    for t, h, w in shapes:
        seq = x[start:start + t * h * w].reshape(t, h // kh, kh, w // kw, kw, d)
        merged = seq.permute(0, 1, 3, 2, 4, 5).mean(dim=0)                      # [h/kh, w/kw, kh, kw, D]
        out.append(merged.reshape((h // kh) * (w // kw), kh * kw * d))
        start += t * h * w
    return torch.cat(out)


class MoonViT(nn.Module):
    """The vision tower (checkpoint prefix ``vision_tower.``); forward returns merged rows."""

    def __init__(self, *, patch_size: int, hidden_size: int, num_layers: int, num_heads: int,
                 qkv_hidden_size: int, intermediate_size: int, pos_emb_height: int, pos_emb_width: int,
                 pos_emb_time: int, merge_kernel_size: tuple[int, int] = (2, 2),
                 interpolation_mode: str = "bilinear", norm_eps: float = 1.1920929e-07,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.patch_size = patch_size
        self.merge_kernel_size = tuple(merge_kernel_size)
        self.max_frames = pos_emb_time
        self.patch_embed = PatchEmbed(patch_size, hidden_size, pos_emb_height, pos_emb_width, pos_emb_time,
                                      interpolation_mode, dtype=dtype, device=device)
        self.encoder = VisionEncoder(hidden_size, num_layers, num_heads, qkv_hidden_size, intermediate_size,
                                     norm_eps, dtype=dtype, device=device)

    @classmethod
    def from_config(cls, cfg: VisionConfig, *, dtype: torch.dtype | None = None, device=None) -> MoonViT:
        return cls(patch_size=cfg.patch_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
                   num_heads=cfg.num_attention_heads, qkv_hidden_size=cfg.qkv_hidden_size,
                   intermediate_size=cfg.intermediate_size, pos_emb_height=cfg.init_pos_emb_height,
                   pos_emb_width=cfg.init_pos_emb_width, pos_emb_time=cfg.init_pos_emb_time,
                   merge_kernel_size=cfg.merge_kernel_size, interpolation_mode=cfg.pos_emb_interpolation_mode,
                   norm_eps=cfg.vit_norm_eps, dtype=dtype, device=device)

    def check_inputs(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> list[tuple[int, int, int]]:
        """Validate the pair and return the grid rows as Python tuples."""
        p = self.patch_size
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (3, p, p):
            raise ValueError(f"pixel_values must be [P, 3, {p}, {p}], got {list(pixel_values.shape)}")
        if grid_thws.ndim != 2 or grid_thws.shape[1] != 3 or grid_thws.is_floating_point():
            raise ValueError(f"grid_thws must be an integer [n_items, 3] tensor of (t, h, w), "
                             f"got {grid_thws.dtype} {list(grid_thws.shape)}")
        if grid_thws.shape[0] == 0:
            raise ValueError("grid_thws holds no items")
        shapes = [tuple(int(v) for v in row) for row in grid_thws.tolist()]
        kh, kw = self.merge_kernel_size
        for i, (t, h, w) in enumerate(shapes):
            if not 1 <= t <= self.max_frames:
                raise ValueError(f"item {i}: t={t} frames, the tower takes 1..{self.max_frames} (init_pos_emb_time)")
            if h < 1 or w < 1 or h % kh or w % kw:
                raise ValueError(f"item {i}: grid {h}x{w} must be positive multiples of the merge kernel {kh}x{kw}")
            if h > ROPE_MAX_GRID or w > ROPE_MAX_GRID:
                raise ValueError(f"item {i}: grid {h}x{w} exceeds the {ROPE_MAX_GRID}x{ROPE_MAX_GRID} RoPE range")
        total = sum(t * h * w for t, h, w in shapes)
        if total != pixel_values.shape[0]:
            raise ValueError(f"grid_thws describes {total} patches but pixel_values has {pixel_values.shape[0]} rows")
        return shapes

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def prepare(self, shapes: list[tuple[int, int, int]]) -> TowerInputs:
        """The items' grid-dependent inputs of ``run``, on the tower's device."""
        device = self.patch_embed.proj.weight.device
        ct = _compute_dtype(self.dtype)
        tables = [rope_2d(h, w, self.encoder.head_dim, ct, device) for _, h, w in shapes]
        # the same spatial angles for every frame: no temporal rotation
        cos = torch.cat([c.repeat(t, 1) for (t, _, _), (c, _) in zip(shapes, tables)])
        sin = torch.cat([s.repeat(t, 1) for (t, _, _), (_, s) in zip(shapes, tables)])
        lengths = [t * h * w for t, h, w in shapes]
        cu = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32).to(device)
        return TowerInputs(self.patch_embed.pos_emb(shapes), cos, sin, cu, max(lengths))

    def run(self, pixel_values: torch.Tensor, items: TowerInputs) -> torch.Tensor:
        """Per-patch hidden states after the final norm [P, D], from pixels [P, 3, p, p] in the
        tower's dtype: fixed shapes, no host synchronisation on the CUDA path."""
        return self.encoder(self.patch_embed(pixel_values, items.pos), items)

    def encode(self, pixel_values: torch.Tensor, shapes: list[tuple[int, int, int]]) -> torch.Tensor:
        """Per-patch hidden states after the final norm: [P, D]."""
        return self.run(pixel_values, self.prepare(shapes))

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor, encode=None) -> torch.Tensor:
        """[P, 3, p, p], [B, 3] -> merged rows [sum N_b, kh*kw*D]. ``encode``: what computes the
        per-patch states, ``self.encode`` by default (``EncoderGraphs.encode``: the same from graphs)."""
        shapes = self.check_inputs(pixel_values, grid_thws)
        x = (encode or self.encode)(pixel_values.to(self.dtype), shapes)
        return tpool_merge(x, shapes, self.merge_kernel_size)


class PatchMergerV2(nn.Module):
    """``patchmergerv2`` projector (checkpoint prefix ``mm_projector.``):
    RMSNorm_eps(W2 gelu_erf(W1 z)), no biases; ``proj.1`` is the parameter-free GELU."""

    def __init__(self, in_dim: int, out_dim: int, eps: float, *, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(in_dim, in_dim, bias=False, dtype=dtype, device=device),
                                  nn.GELU(),
                                  nn.Linear(in_dim, out_dim, bias=False, dtype=dtype, device=device))
        self.post_norm = VisionRMSNorm(out_dim, eps, dtype=dtype, device=device)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(z))


def tokens_per_item(grid_thws: torch.Tensor, merge_kernel_size: tuple[int, int] = (2, 2)) -> list[int]:
    """Encoder output rows per item: (h/kh)*(w/kw), independent of t."""
    kh, kw = merge_kernel_size
    return [(h // kh) * (w // kw) for _, h, w in grid_thws.tolist()]


class KimiVisionModel(nn.Module):
    """Tower + projector under the checkpoint's attribute names ``vision_tower`` / ``mm_projector``."""

    def __init__(self, cfg: VisionConfig, *, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        kh, kw = cfg.merge_kernel_size
        self.vision_tower = MoonViT.from_config(cfg, dtype=dtype, device=device)
        # official: mm_hidden_size * kh * kw; mm_hidden_size equals the tower width in K3
        self.mm_projector = PatchMergerV2(cfg.hidden_size * kh * kw, cfg.text_hidden_size, cfg.projector_ln_eps,
                                          dtype=dtype, device=device)

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor, encode=None) -> torch.Tensor:
        """Image/video-chunk embeddings for the text model.

        pixel_values: [P, 3, p, p] (any float dtype; cast to the tower's), P = sum t*h*w
        grid_thws:    [B, 3] int64 rows (t, h, w) in patches
        encode:       the tower's per-patch part (``MoonViT.forward``), None for its own
        returns:      [sum_b (h_b/2)*(w_b/2), text_hidden] in the projector's dtype, items in order
        """
        merged = self.vision_tower(pixel_values.to(self.vision_tower.patch_embed.proj.weight.device), grid_thws,
                                   encode)
        return self.mm_projector(merged.to(self.mm_projector.post_norm.weight.dtype))

    forward = encode_images
