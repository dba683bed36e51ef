"""FP8 pieces of the routed-expert kernels (``kimik3.ops.triton.moe``): activation tiles quantised on the fly,
FP8 weight tiles, MXFP4 weight tiles expanded to E4M3.

Activations (``act_tile``, ACT_Q): a kernel's K step of BK columns is one quantisation group: each row's
amax over the step gives the power-of-two scale 2**s of ``kimik3.ops.fp8.pow2_scale_exponent`` (from amax's
bits alone: s = e - 8, or e - 7 when amax's significand exceeds 1.75), the row is multiplied by 2**-s
(exact) and rounded to nearest even E4M3. On CUDA the conversion is the hardware's (``cvt.rn.satfinite``,
round to nearest even; |x| 2**-s <= 448 by the choice of s, so it never saturates) and both operands go to
the FP8 tensor cores; each step's fp32 product is then multiplied by the row's 2**s (and, MXFP4 weights, by
the weight rows' E8M0 group scale) before it joins the sum. BK = 32 is MXFP8 (W4A8 on K3's MXFP4 experts),
BK = 128 the FP8 experts' prefill.

Triton's CPU interpreter converts float32 -> E4M3 wrongly (it truncates, and a rounding carry does not reach
the exponent: seen with triton 3.9, 1.96 -> 1.0, -125.5 -> -64), so under it (EMULATE) the rounding is done
in float32 (``round_e4m3``: the value's E4M3 ulp from its exponent, then round-half-even by the 1.5 * 2**23
trick) and the tiles stay float32 values on the E4M3 grid; the dots upcast as everywhere in the interpreter.

MXFP4 weights for the FP8 tensor cores (``e2m1_e4m3_tile``): every E2M1 value (0, 0.5 .. 6) is an E4M3
value, so a nibble becomes an E4M3 byte by integer arithmetic (magnitude code m >= 2: (m << 2) + 48; m = 1
(0.5): 0x30; sign to bit 7); the group's E8M0 scale is applied to the product, not to the weights.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pow2_exponent(amax):
    """int32 s = ceil(log2(amax / 448)) of fp32 amax >= 0, at least -126 (``fp8.pow2_scale_exponent``)."""
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    s = e - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return tl.maximum(s, -126)


@triton.jit
def pow2(s):
    """2**s as fp32 for int32 s in [-126, 127] (built from its bits: exact)."""
    return ((s + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_e4m3(v):
    """fp32 v (|v| <= 448) rounded to the nearest E4M3 value (ties to even), as fp32: the interpreter's
    stand-in for the hardware conversion."""
    a = tl.abs(v)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)      # below 2**-6: subnormal steps
    ulp = pow2(e - 3)
    big = 12582912.0                                                               # 1.5 * 2**23
    r = ((a * pow2(3 - e) + big) - big) * ulp
    return tl.where(v < 0, -r, r)


@triton.jit
def act_tile(ptrs, mask, ACT_Q: tl.constexpr, EMULATE: tl.constexpr):
    """Activation tile [BM, BK] at ``ptrs`` and each row's factor [BM] fp32. ACT_Q: the tile quantised to E4M3
    with one power-of-two scale a row (float32 grid values when EMULATE), the factor that scale; else the
    tile as stored and a factor of 1 (unused)."""
    a = tl.load(ptrs, mask=mask, other=0.0)
    if ACT_Q:
        af = a.to(tl.float32)
        s = pow2_exponent(tl.max(tl.abs(af), 1))
        v = af * pow2(-s)[:, None]
        if EMULATE:
            q = round_e4m3(v)
        else:
            q = v.to(tl.float8e4nv)
        factor = pow2(s)
    else:
        q = a
        factor = tl.full([a.shape[0]], 1.0, tl.float32)
    return q, factor


@triton.jit
def fp8_weight_tile(row_ptrs, k0, K, mn, BK: tl.constexpr, ACT_Q: tl.constexpr, EMULATE: tl.constexpr,
                    dtype: tl.constexpr):
    """E4M3 weight codes of K positions k0..k0 + BK of BN rows (``row_ptrs`` [BN, 1]): as E4M3 for the FP8
    tensor cores (ACT_Q; float32 when EMULATE), else widened to ``dtype`` (exact)."""
    kk = k0 + tl.arange(0, BK)
    w = tl.load(row_ptrs + kk[None, :], mask=mn[:, None] & (kk < K)[None, :], other=0.0)
    if ACT_Q:
        if EMULATE:
            w = w.to(tl.float32)
    else:
        w = w.to(dtype)
    return w


@triton.jit
def e2m1_e4m3_tile(packed_ptr, kh, KH, mn, BN: tl.constexpr, BKH: tl.constexpr, EMULATE: tl.constexpr):
    """Packed MXFP4 bytes kh..kh + BKH of BN rows (``packed_ptr`` [BN, 1]) -> their E2M1 values unscaled,
    [BN, 2 BKH] in element order: E4M3 (float32 when EMULATE)."""
    kk = kh + tl.arange(0, BKH)
    b = tl.load(packed_ptr + kk[None, :], mask=mn[:, None] & (kk < KH)[None, :], other=0).to(tl.int32)
    lo, hi = b & 0xF, b >> 4
    if EMULATE:     # fp16 placement (``moe._dequant_tile``): magnitude bits at 11..9 read as value * 2**-14
        lo = (((lo & 0x7) << 9) | ((lo & 0x8) << 12)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (((hi & 0x7) << 9) | ((hi & 0x8) << 12)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        w = tl.reshape(tl.join(lo * 16384.0, hi * 16384.0), (BN, 2 * BKH))
    else:
        w = tl.reshape(tl.join(_e4m3_bits(lo), _e4m3_bits(hi)), (BN, 2 * BKH)).to(tl.float8e4nv, bitcast=True)
    return w


@triton.jit
def _e4m3_bits(n):
    """E2M1 nibble (int32) -> the E4M3 byte of the same value (uint8)."""
    m = n & 0x7
    mag = tl.where(m < 2, m * 48, (m << 2) + 48)
    return (mag | ((n & 0x8) << 4)).to(tl.uint8)


@triton.jit
def e8m0_factor(code):
    """2**(code - 127) as fp32 for E8M0 codes 0..254 (code 0, 2**-127, is subnormal: its bits 1 << 22)."""
    return tl.where(code == 0, 4194304, code << 23).to(tl.float32, bitcast=True)
