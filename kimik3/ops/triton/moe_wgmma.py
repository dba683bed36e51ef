"""MXFP4 routed experts at decode sizes on Hopper: weights as wgmma's register operand (Gluon).

``kimik3.ops.triton.moe``'s block kernels put the tokens on the left of the product: each dequantized bf16
weight tile is written to shared memory and read back by the tensor cores, and an expert's 8-40 rows are
padded to a 16- or 64-row tile. Here the product is transposed, out^T = W_e x^T: a program owns 16 x warps
weight rows of one expert (wgmma's M: 64 a warpgroup; gate/up: F = 8 x warps features, W1's rows then W3's,
so each thread holds one accumulator) and BT of its sorted rows (wgmma's N: 8-64, no padding beyond it).
Each thread expands the packed bytes of exactly the weights its A fragment holds (16 contiguous bytes of a
row per 128 K positions) in registers, with the integer placement of ``e2m1``, straight into the
fragment: the weights never pass through shared memory as bf16. The packed words reach shared memory by
cp.async and each thread reads back the words it copied; the activations, wgmma's B operand, reach shared
memory by cp.async too.

The fragment and the bytes do not agree on K order. A thread of lane quad q holds, for 128 K positions,
fragment slots s = j0 + 2q + 8 n + 16 j1 + 32 j2 + 64 j3 (the register pair j0, the quad, then registers),
and expands its bytes 16q + j (j = j0 + 2 j1 + 4 j2 + 8 j3), low nibble n = 0, high n = 1, i.e. natural K
position k = 32 q + 2 j + n. The product sums over K, so it is the same for any order applied to both
operands: ``_slot_order`` relabels the expanded weights (checked at compile time to be wgmma's operand
layout with no data movement), and the activations come in slot order (``slot_ordered``: the host permutes x
for gate/up, and gate/up writes h so for down), so they are copied as they lie.

The K loop runs in macro steps of 256 positions: one barrier each, after which the next macro step's copies
start while this one expands and multiplies; each product is asynchronous, so the tensor cores work while the
next fragment expands. Slots and buffers alternate
between two allocations (the loop is unrolled by two), because Triton's barrier insertion cannot tell the
slots of one dynamically indexed ring apart (such a ring cost three barriers a step).

Gluon's API moves between Triton releases; these kernels are written against 3.6 (``GLUON_API``).
Reference: ``kimik3.ops.moe.fused_moe_mxfp4``; the launches are ``expert_products``, the sort and the combine
around them ``moe._wgmma_experts``.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as ttgl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, warpgroup_mma, \
    warpgroup_mma_wait

from kimik3.ops.triton.common import glu, pdl, pdl_entry
from kimik3.ops.triton.e2m1 import e2m1_asm

# the expansion's operands here: four copies of one word ($4-$7; $4 read), then the bf16x2 factors f ($8, $9)
# and g ($10, $11)
ASM_LOW_WORDS = ttgl.constexpr(e2m1_asm("$4", "$8", "$9"))
ASM_HIGH_WORDS = ttgl.constexpr(e2m1_asm("$4", "$8", "$9", "$10", "$11"))

BK = ttgl.constexpr(128)      # K positions per step: 64 packed bytes of a row, 16 a thread
_glu = gluon.jit(glu.fn)
# Gluon is experimental and its API moves between Triton releases: these kernels are written against Triton
# 3.6's (the GPU machines' version); where it is missing (e.g. 3.9 renamed the barrier and the async copy)
# ``wgmma_fits`` says no and the block kernels of ``moe`` run instead.
GLUON_API = hasattr(ttgl, "thread_barrier") and hasattr(async_copy, "async_copy_global_to_shared")
_pdl_entry = gluon.jit(pdl_entry.fn)


@gluon.constexpr_function
def _warp_rows(warps, rank):
    return [[16 << i] + [0] * (rank - 1) for i in range(warps.bit_length() - 1)]


@gluon.constexpr_function
def byte_layout(warps):
    """Packed bytes [BN, 4, 4, 4] (row, quad q, word w, byte b) of 128 K positions: the thread of lane
    (r = lane / 4, q = lane % 4) of warp w' holds bytes 16 q .. 16 q + 15 of rows 16 w' + r and 16 w' + r + 8
    (registers: b, w, then the row's +8). Its slice over b is the layout of the words the threads load."""
    return ttgl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 1, 0], [0, 0, 2, 0], [8, 0, 0, 0]],
        lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=_warp_rows(warps, 4), block_bases=[], shape=[16 * warps, 4, 4, 4])


@gluon.constexpr_function
def mma_layout(warps, BT):
    return ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, BT, 16])


@gluon.jit
def _fragment(words, sc, A: ttgl.constexpr, HIGH_SCALES: ttgl.constexpr):
    """Packed words [BN, 4, 4] (four bytes each; the slice of ``byte_layout``), scale codes sc [BN, 4] (int32)
    -> the A fragment [BN, BK] bf16 in slot order (module docstring), exact (``e2m1``). Each asm
    instance takes four elements of the byte view, all the same word (a broadcast: no instructions), and
    expands its four bytes; the words, not bytes, cross the loop (bytes would be unpacked and repacked)."""
    BN: ttgl.constexpr = words.shape[0]
    b = ttgl.expand_dims(words, 3)
    b = ttgl.broadcast(b, ttgl.full([BN, 4, 4, 4], 0, ttgl.int32, b.type.layout))[0]
    sc = ttgl.expand_dims(ttgl.expand_dims(sc, 2), 3)
    if HIGH_SCALES:
        f = ttgl.broadcast(((ttgl.minimum(sc, 128) + 126) << 7).to(ttgl.int16).to(ttgl.bfloat16, bitcast=True), b)[0]
        g = ttgl.broadcast(((ttgl.maximum(sc, 128) - 1) << 7).to(ttgl.int16).to(ttgl.bfloat16, bitcast=True), b)[0]
        lo, hi = ttgl.inline_asm_elementwise(ASM_HIGH_WORDS, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [b, f, g],
                                             dtype=(ttgl.bfloat16, ttgl.bfloat16), is_pure=True, pack=4)
    else:
        f = ttgl.broadcast(((sc + 126) << 7).to(ttgl.int16).to(ttgl.bfloat16, bitcast=True), b)[0]
        lo, hi = ttgl.inline_asm_elementwise(ASM_LOW_WORDS, "=r,=r,=r,=r,r,r,r,r,r,r", [b, f],
                                             dtype=(ttgl.bfloat16, ttgl.bfloat16), is_pure=True, pack=4)
    w = ttgl.reshape(ttgl.join(lo, hi), [BN, BK])                       # K order: 2 x byte + nibble
    return ttgl.convert_layout(_slot_order(w), A, assert_trivial=True)


@gluon.jit
def _slot_order(t):
    """[R, BK] in K order -> [R, BK] in slot order (slot s holds position k(s), module docstring): a relabelling
    of the elements, the same for the weights and the activations."""
    R: ttgl.constexpr = t.shape[0]
    t = ttgl.reshape(t, [R, 4, 2, 2, 2, 2, 2])                          # (r, q, j3, j2, j1, j0, n)
    t = ttgl.permute(t, [0, 2, 3, 4, 6, 1, 5])                          # (r, j3, j2, j1, n, q, j0)
    return ttgl.reshape(t, [R, BK])


@gluon.jit
def _slot_position(k):
    """Where K position k sits in slot order (``_slot_order`` moves the element at k there)."""
    kb = k % BK
    j = (kb >> 1) & 15
    return k - kb + (j & 1) + 2 * (kb >> 5) + 8 * (kb & 1) + 16 * (j >> 1)


def slot_ordered(x: torch.Tensor) -> torch.Tensor:
    """x [T, L] (L a multiple of BK) with each row's K positions in slot order, as the kernels read activations."""
    T, L = x.shape
    return x.view(T, L // BK, 4, 2, 2, 2, 2, 2).permute(0, 1, 3, 4, 5, 7, 2, 6).reshape(T, L)


@gluon.jit
def _weights(wa, sa, wb, sb, e, n0, stride_wp_e, stride_wp_n, stride_ws_e, stride_ws_n, BN: ttgl.constexpr,
             SPLIT: ttgl.constexpr, WORDS: ttgl.constexpr, SWORDS: ttgl.constexpr):
    """Pointers of a program's BN weight rows at the first step: tile row r < SPLIT is row n0 + r of expert e in
    (wa, sa), a row past it row n0 + r - SPLIT in (wb, sb) (same strides). Packed words [BN, 4, 4] (int32,
    quad q's four at 4 q ..), and scale words [BN] (int32: the four groups of a step in one word)."""
    r = ttgl.arange(0, BN, layout=ttgl.SliceLayout(1, ttgl.SliceLayout(2, WORDS)))
    q = ttgl.arange(0, 4, layout=ttgl.SliceLayout(0, ttgl.SliceLayout(2, WORDS)))
    w = ttgl.arange(0, 4, layout=ttgl.SliceLayout(0, ttgl.SliceLayout(1, WORDS)))
    word = ttgl.expand_dims(ttgl.expand_dims(q * 4, 0), 2) + ttgl.expand_dims(ttgl.expand_dims(w, 0), 1)
    off = ttgl.expand_dims(ttgl.expand_dims((n0 + r % SPLIT).to(ttgl.int64) * stride_wp_n + e * stride_wp_e, 1), 2)
    first = ttgl.expand_dims(ttgl.expand_dims(r < SPLIT, 1), 2)
    pw = ttgl.where(first, wa, wb) + off + word
    rs = ttgl.arange(0, BN, layout=SWORDS)
    ps = ttgl.where(rs < SPLIT, sa, sb) + (n0 + rs % SPLIT).to(ttgl.int64) * stride_ws_n + e * stride_ws_e
    return pw, ps


@gluon.jit
def _fetch(slot, sslot, pw, ps, j, more):
    """Start copying macro step j's packed words ([BN, 4, 4] a step) and scale words ([BN] a step) into a slot (a
    pair of buffers, one for each of its two steps; nothing past the last macro step)."""
    for u in ttgl.static_range(2):
        async_copy.async_copy_global_to_shared(slot[u], pw + (2 * j + u) * (BK // 8), mask=more)
        async_copy.async_copy_global_to_shared(sslot[u], ps + 2 * j + u, mask=more)


@gluon.jit
def _slot_fragment(slot, sslot, u: ttgl.constexpr, WORDS: ttgl.constexpr, A: ttgl.constexpr,
                   HIGH_SCALES: ttgl.constexpr):
    """The A fragment of step u of the macro step in a slot (its copies complete and visible)."""
    SCALES: ttgl.constexpr = ttgl.SliceLayout(2, WORDS)
    words = slot[u].load(WORDS)
    sw = sslot[u].load(ttgl.SliceLayout(1, SCALES))
    q = ttgl.arange(0, 4, layout=ttgl.SliceLayout(0, SCALES))
    sc = (ttgl.expand_dims(sw, 1) >> ttgl.expand_dims(q * 8, 0)) & 0xFF
    return _fragment(words, sc, A, HIGH_SCALES)


@gluon.jit
def _fetch_x(buf, px, mx, j, more):
    """Start copying macro step j's activations ([BT, BK] a step, in slot order) into the pair ``buf``, for the
    tensor cores (padding rows and past the last macro step: zeros)."""
    for u in ttgl.static_range(2):
        async_copy.async_copy_global_to_shared(buf[u], px + (2 * j + u) * BK, mask=mx & more)


@gluon.jit
def _macro_step(j, NM, cur, scur, nxt, snxt, cur2, scur2, nxt2, snxt2, xcur, xnxt, pw, ps, pw2, ps2, px, mx,
                acc, acc2, WORDS: ttgl.constexpr, A: ttgl.constexpr, HIGH_SCALES: ttgl.constexpr, TWO: ttgl.constexpr):
    """Macro step j (2 BK positions) of one or two tiles. On entry its weights and activations are in flight into
    (cur, scur) (and the second tile's) and ``xcur``. One barrier: after it they have landed and the slots and
    buffers of macro step j - 1 are free, so the next macro step's copies start into (nxt, snxt) and ``xnxt``
    while this one expands and multiplies. The slots and buffers alternate between two allocations (the caller
    unrolls by two), so no other barrier is needed (Triton adds one after the wait: two a macro step in all)."""
    more = j + 1 < NM
    async_copy.wait_group(0)                 # macro step j's copies have landed (this thread's) ...
    fence_async_shared()                     # ... where the tensor cores read them ...
    ttgl.thread_barrier()                    # ... everyone's; everyone is done with macro step j - 1
    _fetch(nxt, snxt, pw, ps, j + 1, more)
    if TWO:
        _fetch(nxt2, snxt2, pw2, ps2, j + 1, more)
    _fetch_x(xnxt, px, mx, j + 1, more)
    async_copy.commit_group()
    a0 = _slot_fragment(cur, scur, 0, WORDS, A, HIGH_SCALES)
    t = warpgroup_mma(a0, xcur[0].permute((1, 0)), acc, is_async=True)
    a1 = _slot_fragment(cur, scur, 1, WORDS, A, HIGH_SCALES)
    t = warpgroup_mma(a1, xcur[1].permute((1, 0)), t, is_async=True)
    if TWO:
        t = warpgroup_mma_wait(1, deps=[t])
        b0 = _slot_fragment(cur2, scur2, 0, WORDS, A, HIGH_SCALES)
        t2 = warpgroup_mma(b0, xcur[0].permute((1, 0)), acc2, is_async=True)
        t, t2 = warpgroup_mma_wait(1, deps=[t, t2])
        b1 = _slot_fragment(cur2, scur2, 1, WORDS, A, HIGH_SCALES)
        t2 = warpgroup_mma(b1, xcur[1].permute((1, 0)), t2, is_async=True)
        acc, acc2 = warpgroup_mma_wait(0, deps=[t, t2])
    else:
        acc = warpgroup_mma_wait(0, deps=[t])
    return acc, acc2


@gluon.jit
def _pair(dtype: ttgl.constexpr, shape: ttgl.constexpr, layout: ttgl.constexpr):
    """Two buffers of one slot (the two steps of a macro step), separate allocations: Triton's barrier insertion
    puts a barrier between two copies into one allocation whatever parts they write."""
    return (ttgl.allocate_shared_memory(dtype, shape, layout), ttgl.allocate_shared_memory(dtype, shape, layout))


@gluon.jit
def _main_loop(pw, ps, pw2, ps2, px, mx, K, BN: ttgl.constexpr, BT: ttgl.constexpr, WORDS: ttgl.constexpr,
               MMA: ttgl.constexpr, HIGH_SCALES: ttgl.constexpr, TWO: ttgl.constexpr):
    """acc [BN, BT] (and acc2 for the second tile) = W x^T over K: macro steps of 2 BK positions, the weights of
    the next one and its activations in flight (cp.async) while this one expands and multiplies."""
    A: ttgl.constexpr = ttgl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    SMEM: ttgl.constexpr = ttgl.NVMMASharedLayout.get_default_for([BT, BK], ttgl.bfloat16)
    ra = _pair(ttgl.int32, [BN, 4, 4], RING)
    rb = _pair(ttgl.int32, [BN, 4, 4], RING)
    sa = _pair(ttgl.int32, [BN], SRING)
    sb = _pair(ttgl.int32, [BN], SRING)
    ra2 = ra
    rb2 = rb
    sa2 = sa
    sb2 = sb
    if TWO:
        ra2 = _pair(ttgl.int32, [BN, 4, 4], RING)
        rb2 = _pair(ttgl.int32, [BN, 4, 4], RING)
        sa2 = _pair(ttgl.int32, [BN], SRING)
        sb2 = _pair(ttgl.int32, [BN], SRING)
    xa = _pair(ttgl.bfloat16, [BT, BK], SMEM)
    xb = _pair(ttgl.bfloat16, [BT, BK], SMEM)
    NM = K // (2 * BK)
    _fetch(ra, sa, pw, ps, 0, NM > 0)
    if TWO:
        _fetch(ra2, sa2, pw2, ps2, 0, NM > 0)
    _fetch_x(xa, px, mx, 0, NM > 0)
    async_copy.commit_group()
    acc = ttgl.zeros([BN, BT], ttgl.float32, MMA)
    acc2 = ttgl.zeros([BN, BT], ttgl.float32, MMA)
    for j in range(0, NM, 2):
        acc, acc2 = _macro_step(j, NM, ra, sa, rb, sb, ra2, sa2, rb2, sb2, xa, xb, pw, ps, pw2, ps2, px, mx,
                                acc, acc2, WORDS, A, HIGH_SCALES, TWO)
        if j + 1 < NM:
            acc, acc2 = _macro_step(j + 1, NM, rb, sb, ra, sa, rb2, sb2, ra2, sa2, xb, xa, pw, ps, pw2, ps2, px, mx,
                                    acc, acc2, WORDS, A, HIGH_SCALES, TWO)
    async_copy.wait_group(0)
    return acc, acc2


# the rings in shared memory: plain row-major (a warp reads 512 contiguous bytes of packed words, no bank
# conflicts); scale words are copied one per thread
RING = ttgl.constexpr(ttgl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0]))
SRING = ttgl.constexpr(ttgl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
SRING2 = ttgl.constexpr(ttgl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0, 1]))


@gluon.jit
def _gate_up_out(gu, acc, h, n0, pid_m, stride_h, beta, linear_beta, ACT_SITU: ttgl.constexpr, CLIP_UP: ttgl.constexpr,
                 BT: ttgl.constexpr, F: ttgl.constexpr, EPI: ttgl.constexpr):
    """h[block rows, n0 .. n0 + F] = act(gate, up) from the accumulator [2F, BT] (gate rows, then up rows),
    both rounded to bf16 first, through shared memory ``gu``."""
    gu.store(acc.to(ttgl.bfloat16))
    ttgl.thread_barrier()
    g = gu.slice(0, F).load(EPI).to(ttgl.float32)
    u = gu.slice(F, F).load(EPI).to(ttgl.float32)
    out = _glu(g, u, beta, linear_beta, ACT_SITU, CLIP_UP).to(ttgl.bfloat16)
    no = _slot_position(n0 + ttgl.arange(0, F, layout=ttgl.SliceLayout(1, EPI)))    # h in slot order, for down
    mo = pid_m * BT + ttgl.arange(0, BT, layout=ttgl.SliceLayout(0, EPI))
    ttgl.store(h + ttgl.expand_dims(mo.to(ttgl.int64) * stride_h, 0) + ttgl.expand_dims(no, 1), out)


@gluon.jit(do_not_specialize=["num_rows"])
def _gate_up_wgmma_kernel(x, w1p, w1s, w3p, w3s, h, sorted_rows, block_expert, num_rows, K,
                          stride_x, stride_wp_e, stride_wp_n, stride_ws_e, stride_ws_n, stride_h,
                          beta, linear_beta, TOP_K: ttgl.constexpr, ACT_SITU: ttgl.constexpr,
                          CLIP_UP: ttgl.constexpr, BT: ttgl.constexpr, HIGH_SCALES: ttgl.constexpr,
                          WARPS: ttgl.constexpr, TWO: ttgl.constexpr, PDL: ttgl.constexpr):
    """Program (block pid_m of BT sorted rows, all of one expert; features pid_n F .. + F, F = 8 WARPS, or two
    such tiles side by side when TWO, which stage each step's activations once for both):
    h[rows] = act(x W1^T, x W3^T) for the rows' tokens. One product of 2F weight rows, W1's F rows then W3's,
    so each thread holds one accumulator. Packed weights and scales as int32 words (strides in words). The
    weights and activations stream as ``_main_loop`` says; the gate and up halves meet in shared memory for the
    activation."""
    _pdl_entry(PDL)
    BN: ttgl.constexpr = 16 * WARPS
    F: ttgl.constexpr = 8 * WARPS
    MMA: ttgl.constexpr = mma_layout(WARPS, BT)
    WORDS: ttgl.constexpr = ttgl.SliceLayout(3, byte_layout(WARPS))
    SWORDS: ttgl.constexpr = ttgl.BlockedLayout([1], [32], [WARPS], [0])
    XL: ttgl.constexpr = ttgl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    EPI: ttgl.constexpr = ttgl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [0, 1])
    pid_m = ttgl.program_id(0)
    pid_n = ttgl.program_id(1)
    e = ttgl.load(block_expert + pid_m).to(ttgl.int64)
    if e >= 0:
        NT: ttgl.constexpr = 2 if TWO else 1
        n0 = pid_n * (NT * F)
        pw, ps = _weights(w1p, w1s, w3p, w3s, e, n0, stride_wp_e, stride_wp_n, stride_ws_e, stride_ws_n, BN, F,
                          WORDS, SWORDS)
        pw2, ps2 = _weights(w1p, w1s, w3p, w3s, e, n0 + F, stride_wp_e, stride_wp_n, stride_ws_e, stride_ws_n,
                            BN, F, WORDS, SWORDS)
        m = pid_m * BT + ttgl.arange(0, BT, layout=ttgl.SliceLayout(1, XL))
        rows = ttgl.load(sorted_rows + m)
        kx = ttgl.arange(0, BK, layout=ttgl.SliceLayout(0, XL))
        px = x + ttgl.expand_dims((rows // TOP_K).to(ttgl.int64) * stride_x, 1) + ttgl.expand_dims(kx, 0)
        mx = ttgl.expand_dims(rows < num_rows, 1) & ttgl.expand_dims(kx < BK, 0)
        acc, acc2 = _main_loop(pw, ps, pw2, ps2, px, mx, K, BN, BT, WORDS, MMA, HIGH_SCALES, TWO)
        # the reference rounds both projections to the activation dtype before the activation
        gu = ttgl.allocate_shared_memory(ttgl.bfloat16, [BN, BT], SRING2)
        _gate_up_out(gu, acc, h, n0, pid_m, stride_h, beta, linear_beta, ACT_SITU, CLIP_UP, BT, F, EPI)
        if TWO:
            ttgl.thread_barrier()
            _gate_up_out(gu, acc2, h, n0 + F, pid_m, stride_h, beta, linear_beta, ACT_SITU, CLIP_UP, BT, F, EPI)


@gluon.jit
def _down_out(acc, y, rows, num_rows, n0, stride_y, BN: ttgl.constexpr, MMA: ttgl.constexpr):
    """y[rows, n0 .. n0 + BN] = the accumulator [BN, BT] (bf16), padding rows (>= num_rows) left alone."""
    no = n0 + ttgl.arange(0, BN, layout=ttgl.SliceLayout(1, MMA))
    ttgl.store(y + ttgl.expand_dims(rows * stride_y, 0) + ttgl.expand_dims(no, 1), acc.to(ttgl.bfloat16),
               mask=ttgl.expand_dims(rows < num_rows, 0) & ttgl.expand_dims(no >= 0, 1))


@gluon.jit(do_not_specialize=["num_rows"])
def _down_wgmma_kernel(h, w2p, w2s, y, sorted_rows, block_expert, num_rows, K,
                       stride_h, stride_wp_e, stride_wp_n, stride_ws_e, stride_ws_n, stride_y,
                       BT: ttgl.constexpr, HIGH_SCALES: ttgl.constexpr, WARPS: ttgl.constexpr,
                       TWO: ttgl.constexpr, PDL: ttgl.constexpr):
    """Program (block pid_m of BT sorted rows of one expert, features pid_n BN ..): y[assignment] = h W2^T for
    the block's rows of h (sorted order); padding rows are not written. Pipelined as the gate/up kernel."""
    _pdl_entry(PDL)
    BN: ttgl.constexpr = 16 * WARPS
    MMA: ttgl.constexpr = mma_layout(WARPS, BT)
    WORDS: ttgl.constexpr = ttgl.SliceLayout(3, byte_layout(WARPS))
    SWORDS: ttgl.constexpr = ttgl.BlockedLayout([1], [32], [WARPS], [0])
    XL: ttgl.constexpr = ttgl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    pid_m = ttgl.program_id(0)
    pid_n = ttgl.program_id(1)
    e = ttgl.load(block_expert + pid_m).to(ttgl.int64)
    if e >= 0:
        NT: ttgl.constexpr = 2 if TWO else 1
        n0 = pid_n * (NT * BN)
        pw, sw = _weights(w2p, w2s, w2p, w2s, e, n0, stride_wp_e, stride_wp_n, stride_ws_e, stride_ws_n, BN,
                          BN, WORDS, SWORDS)
        pw2, sw2 = _weights(w2p, w2s, w2p, w2s, e, n0 + BN, stride_wp_e, stride_wp_n, stride_ws_e, stride_ws_n, BN,
                            BN, WORDS, SWORDS)
        m = pid_m * BT + ttgl.arange(0, BT, layout=ttgl.SliceLayout(1, XL))
        kx = ttgl.arange(0, BK, layout=ttgl.SliceLayout(0, XL))
        px = h + ttgl.expand_dims(m.to(ttgl.int64) * stride_h, 1) + ttgl.expand_dims(kx, 0)
        mx = ttgl.expand_dims(m >= 0, 1) & ttgl.expand_dims(kx < BK, 0)
        acc, acc2 = _main_loop(pw, sw, pw2, sw2, px, mx, K, BN, BT, WORDS, MMA, HIGH_SCALES, TWO)
        mo = pid_m * BT + ttgl.arange(0, BT, layout=ttgl.SliceLayout(0, MMA))
        rows = ttgl.load(sorted_rows + mo)
        _down_out(acc, y, rows, num_rows, n0, stride_y, BN, MMA)
        if TWO:
            _down_out(acc2, y, rows, num_rows, n0 + BN, stride_y, BN, MMA)


def expert_products(x: torch.Tensor, w1, w2, w3, sorted_rows: torch.Tensor, block_expert: torch.Tensor, top_k: int,
                    act_situ: bool, beta: float, linear_beta: float | None, high_scales: bool, BT: int, warps: int,
                    two: bool) -> torch.Tensor:
    """y [T top_k, L]: each assignment's expert output h W2^T, h = act(x W1^T, x W3^T), for the assignments
    sorted by expert in blocks of BT (``moe._sort_by_expert``); x [T, L] bf16, packed experts as in
    ``moe.fused_moe_triton`` (``wgmma_fits`` holds). x goes to the kernels in slot order, and h comes out so."""
    (w1p, w1s), (w2p, w2s), (w3p, w3s) = w1, w2, w3
    T, L = x.shape
    I = w1p.shape[1]
    R = T * top_k
    BN = 16 * warps
    nb = block_expert.shape[0]
    w1v, w2v, w3v, s1v, s2v, s3v = (t.view(torch.int32) for t in (w1p, w2p, w3p, w1s, w2s, w3s))
    xs = slot_ordered(x)
    h = torch.empty(nb * BT, I, dtype=x.dtype, device=x.device)
    nt = 2 if two else 1
    _gate_up_wgmma_kernel[(nb, I // (nt * BN // 2))](
        xs, w1v, s1v, w3v, s3v, h, sorted_rows, block_expert, R, L,
        xs.stride(0), w1v.stride(0), w1v.stride(1), s1v.stride(0), s1v.stride(1), h.stride(0),
        float(beta), float(linear_beta or 1.0), TOP_K=top_k, ACT_SITU=act_situ, CLIP_UP=linear_beta is not None,
        BT=BT, HIGH_SCALES=high_scales, WARPS=warps, TWO=two, num_warps=warps, **pdl(x))
    y = torch.empty(R, L, dtype=x.dtype, device=x.device)
    _down_wgmma_kernel[(nb, L // (nt * BN))](
        h, w2v, s2v, y, sorted_rows, block_expert, R, I,
        h.stride(0), w2v.stride(0), w2v.stride(1), s2v.stride(0), s2v.stride(1), y.stride(0),
        BT=BT, HIGH_SCALES=high_scales, WARPS=warps, TWO=two, num_warps=warps, **pdl(h))
    return y


def wgmma_fits(x: torch.Tensor, w1, w2, w3, warps: int, two: bool) -> bool:
    """These kernels take the experts with ``warps`` warps (and ``two`` tiles) a program: Triton 3.6's Gluon
    (``GLUON_API``), a Hopper GPU (sm_90: wgmma), latent and expert widths of whole 256-position macro steps
    and whole programs, packed rows of whole 16-byte words, scale rows of whole 4-byte words."""
    if not (GLUON_API and x.is_cuda and torch.cuda.get_device_capability(x.device) == (9, 0)):
        return False
    L, I = x.shape[1], w1[0].shape[1]
    rows = 16 * warps * (2 if two else 1)            # down: weight rows (features) a program; gate/up: half
    packed_ok = all(p.stride(2) == 1 and p.stride(0) % 16 == 0 and p.stride(1) % 16 == 0 and p.data_ptr() % 16 == 0
                    and s.stride(2) == 1 and s.stride(0) % 4 == 0 and s.stride(1) % 4 == 0 and s.data_ptr() % 4 == 0
                    for p, s in (w1, w2, w3))
    return L % 256 == 0 and I % 256 == 0 and L % rows == 0 and I % (rows // 2) == 0 and packed_ok
