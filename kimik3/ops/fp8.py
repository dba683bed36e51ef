"""FP8 (OCP E4M3, ``torch.float8_e4m3fn``) numbers with float32 scales: value = code * scale.

One format, two granularities:
  * rows (the MLA latent cache): one scale per row of the last axis, ``amax(|row|) / 448`` (a zero
    row gets scale 1), so every row uses the whole E4M3 range;
  * weights: per output channel (one scale per row of W [N, K]) or per 128 x 128 block (DeepSeek's /
    Kimi's ``weight_scale_inv`` [ceil(N / 128), ceil(K / 128)] layout, the checkpoints' own).

E4M3 keeps 3 mantissa bits: a value in the normal range rounds (to nearest even) within 2**-4 of
itself, relative; below 2**-6 (the smallest normal, relative to the scale) the error is at most half
the subnormal step, 2**-10 times the scale. With the scale at amax / 448, a value x of a row errs by
at most ``max(2**-4 |x|, 2**-10 scale)`` = ``max(2**-4 |x|, 2**-10 amax / 448)`` (``ROUNDING_BOUND``).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                   # largest finite E4M3 value
WEIGHT_BLOCK = 128                # the block-FP8 checkpoints' weight_block_size
ROUNDING_BOUND = 2.0 ** -4        # relative rounding error of a normal E4M3 value (half its 3-bit ulp)
SUBNORMAL_STEP = 2.0 ** -9        # the E4M3 subnormal spacing, in units of the scale


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """float32 scale amax / 448; 1 where amax is 0 (an all-zero row or block quantises to zeros)."""
    amax = amax.float()
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D] float8_e4m3fn, scale [...] float32): one scale per row."""
    scale = _scale_of(x.abs().amax(dim=-1))
    return (x.float() / scale.unsqueeze(-1)).to(FP8), scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., D] * scale [...] in ``dtype`` (float32 arithmetic, or float64 for a float64 dtype)."""
    acc = torch.promote_types(dtype, torch.float32)
    return (codes.to(acc) * scale.to(acc).unsqueeze(-1)).to(dtype)


def quantize_weight(w: torch.Tensor, block: int | None = WEIGHT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (codes [N, K] float8_e4m3fn, scale float32): ``block`` x ``block`` tiles, scale
    [ceil(N / block), ceil(K / block)] (the checkpoints' ``weight_scale_inv``), or per output channel
    (``block`` None), scale [N, 1]."""
    N, K = w.shape
    if block is None:
        scale = _scale_of(w.abs().amax(dim=1, keepdim=True))
        return (w.float() / scale).to(FP8), scale
    nb, kb = -(-N // block), -(-K // block)
    padded = w.new_zeros(nb * block, kb * block)
    padded[:N, :K] = w
    tiles = padded.view(nb, block, kb, block)
    scale = _scale_of(tiles.abs().amax(dim=(1, 3)))
    codes = (tiles.float() / scale[:, None, :, None]).to(FP8).view(nb * block, kb * block)[:N, :K]
    return codes.contiguous(), scale


def expand_weight_scale(scale: torch.Tensor, N: int, K: int, block: int = WEIGHT_BLOCK) -> torch.Tensor:
    """A weight scale as one value per element [N, K]: per channel [N, 1], or ``block`` x ``block``
    tiles [ceil(N / block), ceil(K / block)] (the two agree where both shapes fit: N <= block, K <= block)."""
    if scale.shape == (N, 1):
        return scale.expand(N, K)
    if scale.shape != (-(-N // block), -(-K // block)):
        raise ValueError(f"an FP8 weight [{N}, {K}] takes a scale [{N}, 1] (per channel) or "
                         f"[{-(-N // block)}, {-(-K // block)}] ({block} x {block} blocks), got {tuple(scale.shape)}")
    return scale.repeat_interleave(block, 0)[:N].repeat_interleave(block, 1)[:, :K]


def dequantize_weight(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                      block: int = WEIGHT_BLOCK) -> torch.Tensor:
    """codes [N, K] times their scale (``quantize_weight``'s layouts) in ``dtype``."""
    acc = torch.promote_types(dtype, torch.float32)
    return (codes.to(acc) * expand_weight_scale(scale, *codes.shape, block).to(acc)).to(dtype)


def quantize_activations(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes [M, K], scale float32): per token [M, 1] (``group`` None), or per token and
    ``group`` consecutive columns [M, ceil(K / group)] (the block-FP8 GEMM's activations)."""
    M, K = x.shape
    if group is None:
        scale = _scale_of(x.abs().amax(dim=1, keepdim=True))
        return (x.float() / scale).to(FP8), scale
    kb = -(-K // group)
    padded = x.new_zeros(M, kb * group)
    padded[:, :K] = x
    tiles = padded.view(M, kb, group)
    scale = _scale_of(tiles.abs().amax(dim=2))
    return (tiles.float() / scale.unsqueeze(-1)).to(FP8).view(M, kb * group)[:, :K].contiguous(), scale


def dequantize_activations(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                           group: int = WEIGHT_BLOCK) -> torch.Tensor:
    """``quantize_activations``' codes times their scales (per token [M, 1], or per ``group`` columns), in ``dtype``."""
    acc = torch.promote_types(dtype, torch.float32)
    K = codes.shape[1]
    per_col = scale if scale.shape[1] == 1 else scale.repeat_interleave(group, 1)[:, :K]
    return (codes.to(acc) * per_col.to(acc)).to(dtype)


# ---- power-of-two group scales (the expert kernels' activations) ----------------------------------------
# The routed-expert kernels quantise their activations on the fly, per row and ``group`` consecutive columns,
# with a power-of-two scale 2**s (an E8M0 code s + 127): s is the smallest exponent with amax / 2**s <= 448,
# found from amax's bits alone (amax = m 2**e, 1 <= m < 2: s = e - 8, or e - 7 when m > 1.75 = 448 / 2**8), so
# the kernels and this reference agree bit for bit (no division, and x / 2**s is exact). Group 32 is OCP's
# MXFP8 (E4M3 codes, one E8M0 scale per 32 values; the W4A8 experts of K3); the FP8 experts of
# ``--quantization fp8`` take group 128. Each code is x / 2**s rounded to nearest even E4M3, so a value errs by
# at most max(2**-4 |x|, 2**-10 2**s) with 2**s < amax / 224: ``group_rounding_bound``.
MX_GROUP = 32                     # OCP MX block size: MXFP8 activations
SCALE_EXP_MIN = -126              # the exponents kept normal float32 factors (2**-127, E8M0 code 0, is not taken)


def pow2_scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """int32 s = ceil(log2(amax / 448)) exactly, at least -126 (an all-zero group gets -126)."""
    bits = amax.float().view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127
    s = e - 8 + ((bits & 0x7FFFFF) > 0x600000).int()
    return s.clamp_min(SCALE_EXP_MIN).int()


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes [M, K] float8_e4m3fn, exponents int32 [M, ceil(K / group)]): value = code * 2**exponent."""
    M, K = x.shape
    kb = -(-K // group)
    padded = x.new_zeros(M, kb * group)
    padded[:, :K] = x
    tiles = padded.float().view(M, kb, group)
    s = pow2_scale_exponent(tiles.abs().amax(dim=2))
    codes = torch.ldexp(tiles, (-s).unsqueeze(-1).float()).to(FP8)
    return codes.view(M, kb * group)[:, :K].contiguous(), s


def dequantize_groups(codes: torch.Tensor, exponents: torch.Tensor, dtype: torch.dtype, group: int) -> torch.Tensor:
    """``quantize_groups``' codes times 2**exponents, in ``dtype`` (exact in float32 / float64)."""
    acc = torch.promote_types(dtype, torch.float32)
    K = codes.shape[1]
    per_col = exponents.repeat_interleave(group, 1)[:, :K]
    return torch.ldexp(codes.to(acc), per_col.to(acc)).to(dtype)


def round_trip_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., K] as the expert kernels read it: quantised per row and ``group`` columns and back, in x's dtype."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    return dequantize_groups(*quantize_groups(x2, group), x.dtype, group).view(x.shape)


def group_rounding_bound(x: torch.Tensor, group: int) -> torch.Tensor:
    """The largest error ``round_trip_groups`` may make on each element of x [M, K] (float64)."""
    M, K = x.shape
    kb = -(-K // group)
    padded = x.new_zeros(M, kb * group, dtype=torch.float64)
    padded[:, :K] = x.double()
    s = pow2_scale_exponent(padded.view(M, kb, group).abs().amax(dim=2).float())
    step = torch.exp2(s.double() - 10).repeat_interleave(group, 1)[:, :K]
    return torch.maximum(ROUNDING_BOUND * x.double().abs(), step)
