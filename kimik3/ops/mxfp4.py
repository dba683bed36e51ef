"""MXFP4 (compressed-tensors "mxfp4-pack-quantized"): E2M1 nibbles + E8M0 scales per 32.

weight_packed uint8 [N, K/2]: byte j of a row holds element 2j in the low nibble and 2j+1 in
the high nibble. weight_scale uint8 [N, K/32]: W[n, k] = E2M1(code) * 2**(scale[n, k//32] - 127).
"""

from __future__ import annotations

import torch

GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 codes [N, K] (low nibble first)."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (K even, values 0..15) -> packed uint8 [N, K/2]."""
    if codes.shape[-1] % 2:
        raise ValueError(f"MXFP4 rows need an even number of elements, got {codes.shape[-1]}")
    pairs = codes.view(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
               name: str = "weight") -> torch.Tensor:
    """Dequantize an MXFP4 weight to ``dtype`` [N, K]; validates shapes and the NaN scale."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 tensors must be uint8, got {packed.dtype} and {scale.dtype}")
    n, half = packed.shape
    k = 2 * half
    if k % GROUP:
        raise ValueError(f"{name}: {k} input elements per row is not a multiple of the MXFP4 group ({GROUP})")
    if tuple(scale.shape) != (n, k // GROUP):
        raise ValueError(f"{name}: weight_scale shape {tuple(scale.shape)} does not match "
                         f"weight_packed {tuple(packed.shape)} (expected {(n, k // GROUP)})")
    if bool((scale == 255).any()):
        raise ValueError(f"{name}: weight_scale holds 255, the E8M0 NaN encoding")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = table[unpack_codes(packed).long()]                       # [N, K]
    factor = torch.exp2(scale.to(torch.float32) - 127.0)              # [N, K/32]
    return (values.view(n, k // GROUP, GROUP) * factor.unsqueeze(-1)).view(n, k).to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [N, K] to MXFP4 (scale = smallest power of two with max|w| / scale <= 6, then
    round each element to the nearest E2M1 value). Exact for weights already on the grid."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of {GROUP}, got {k}")
    w = weight.to(torch.float32).view(n, k // GROUP, GROUP)
    amax = w.abs().amax(-1).clamp_min(2.0 ** -127)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scale = (exp + 127).to(torch.uint8)
    scaled = w / torch.exp2(exp).unsqueeze(-1)
    mags = torch.tensor(E2M1_VALUES[:8], device=w.device)
    idx = (scaled.abs().unsqueeze(-1) - mags).abs().argmin(-1)        # nearest magnitude
    codes = (idx + 8 * (scaled < 0)).to(torch.uint8).view(n, k)
    return pack_codes(codes), scale
