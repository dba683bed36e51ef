"""E2M1 (MXFP4) codes -> bf16 on the integer units, as inline PTX shared by the expert kernels.

A nibble's magnitude bits (e1 e0 m) placed at bf16 bits 8..6 and its sign at bit 15 read as the E2M1 value
times 2**-126 (codes 0/1 land on bf16 subnormals). One multiply of the masked nibble by 2**6 + 2**12 (low
nibble) or 2**2 + 2**8 (high nibble) lands both at once (the two copies do not overlap); a bf16x2 multiply by
f = 2**(scale - 1) then applies 2**126 and the E8M0 scale 2**(scale - 127) exactly (at most two significant
bits times a power of two). f is a bf16 normal for scale <= 128 (|w| <= 12); larger scales multiply by
f = 2**(min(scale, 128) - 1) and then by g = 2**(max(scale, 128) - 128).
"""

from __future__ import annotations


def e2m1_asm(word: str, f01: str, f23: str, g01: str | None = None, g23: str | None = None) -> str:
    """PTX expanding the four packed bytes b0..b3 of operand ``word`` (eight elements): outputs $0, $1 = the low
    nibbles (elements 2i) of bytes (0, 1), (2, 3); $2, $3 = the high nibbles (elements 2i + 1); each times its
    bf16x2 factors ``f01`` (bytes 0, 1) and ``f23`` (bytes 2, 3), then ``g01`` / ``g23`` when given (scales
    above 128). Each value depends only on its own byte and factor, so the result does not depend on which
    elements the compiler hands to one instance."""
    asm = f"""{{
    .reg .b32 t0, t1, a, nz;
    mov.b32 nz, 0x80008000;
    prmt.b32 t0, {word}, {word}, 0x1100;
    prmt.b32 t1, {word}, {word}, 0x3322;
    and.b32 a, t0, 0x000F000F;  mul.lo.u32 a, a, 0x1040;  and.b32 a, a, 0x81C081C0;  fma.rn.bf16x2 $0, a, {f01}, nz;
    and.b32 a, t1, 0x000F000F;  mul.lo.u32 a, a, 0x1040;  and.b32 a, a, 0x81C081C0;  fma.rn.bf16x2 $1, a, {f23}, nz;
    and.b32 a, t0, 0x00F000F0;  mul.lo.u32 a, a, 0x0104;  and.b32 a, a, 0x81C081C0;  fma.rn.bf16x2 $2, a, {f01}, nz;
    and.b32 a, t1, 0x00F000F0;  mul.lo.u32 a, a, 0x0104;  and.b32 a, a, 0x81C081C0;  fma.rn.bf16x2 $3, a, {f23}, nz;
"""
    if g01 is not None:
        asm += f"""    fma.rn.bf16x2 $0, $0, {g01}, nz;  fma.rn.bf16x2 $1, $1, {g23}, nz;
    fma.rn.bf16x2 $2, $2, {g01}, nz;  fma.rn.bf16x2 $3, $3, {g23}, nz;
"""
    return asm + "}"
