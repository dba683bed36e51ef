"""FP8 routed experts: ``--quantization fp8`` of bf16 experts (``fused_moe_fp8``: E4M3 weights with channel
scales; activations quantised per 128 columns at prefill sizes) and W4A8 on MXFP4 experts (``fused_moe_mxfp4``
under ``KernelOptions.w4a8_moe``: MXFP8 activations). The CPU references against float64 computed straight
from the dequantised weights and the round-tripped activations; the Triton kernels (TRITON_INTERPRET=1, small
ragged shapes, outputs poisoned) against the references, and their quantisation pieces bit for bit.

Triton's interpreter rounds fp32 -> bf16 toward zero, and an activation quantised after such a rounding may
land on the neighbouring E4M3 value (a 2**-4 step) where the reference rounds to nearest: the FP8 kernels are
held to the reference tightly with fp16 activations (the interpreter rounds those to nearest), and the bf16
W4A8 kernels are checked piece by piece on their own intermediate (the gate/up output they wrote).
"""

from __future__ import annotations

import math

import pytest
import torch

from kimik3.ops import fp8, mxfp4
from kimik3.ops.moe import fp8_act_group, fused_moe, fused_moe_fp8, fused_moe_mxfp4, w4a8_applies
from kimik3.ops.options import KernelTuning
from tests.helpers import rel_err

F64, BF16, FP16 = torch.float64, torch.bfloat16, torch.float16
TUNE = KernelTuning()


def gen(seed):
    return torch.Generator().manual_seed(seed)


def silu64(g, u):
    return torch.nn.functional.silu(g) * u


def situ64(g, u, beta=4.0, linear_beta=25.0):
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))


ACTS = {"silu": (silu64, 1.0, None), "situ": (situ64, 4.0, 25.0)}


def moe64(x, w1, w2, w3, weights, ids, act, read=None):
    """Straight from the math in float64: out_t = sum_j w_tj (read(act(read(x_t) W1^T, read(x_t) W3^T)) W2^T);
    ``read``: how the kernels see their activations (None: as they are)."""
    read = read or (lambda a: a)
    x, weights = x.double(), weights.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        xt = read(x[t:t + 1])
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = act(xt @ w1[e].double().t(), xt @ w3[e].double().t())
            out[t] += weights[t, j] * (read(h) @ w2[e].double().t())[0]
    return out


def ragged_ids(T, E, k, g):
    """Distinct experts per token: expert 0 in every token, expert 1 in token T // 2 alone, the last two in none."""
    ids = torch.empty(T, k, dtype=torch.long)
    for t in range(T):
        first = [0, 1] if (t == T // 2 and k > 1) else [0]
        rest = (torch.randperm(E - 4, generator=g) + 2)[:k - len(first)]
        ids[t] = torch.cat([torch.tensor(first), rest])
    return ids


def fp8_experts(E, N, K, g, loud=True):
    """Random experts [E, N, K] (one loud output channel each) -> (float64 weights, (codes, channel scales))."""
    w = torch.randn(E, N, K, generator=g, dtype=F64) / math.sqrt(K)
    if loud:
        w[:, 3] *= 20
    codes, scale = torch.empty(E, N, K, dtype=fp8.FP8), torch.empty(E, N)
    for e in range(E):
        c, s = fp8.quantize_weight(w[e], block=None)
        codes[e], scale[e] = c, s.view(-1)
    return w, (codes, scale)


def dequant(pair):
    codes, scale = pair
    return codes.double() * scale.double().unsqueeze(-1)


def mxfp4_experts(E, N, K, g, spread=2):
    """Random MXFP4 experts -> ((packed, scale), float64 weights)."""
    codes = torch.randint(0, 16, (E * N, K), generator=g, dtype=torch.uint8)
    base = 127 - round(math.log2(2 * math.sqrt(K)))
    scale = (base + torch.randint(-spread, spread + 1, (E * N, K // 32), generator=g)).to(torch.uint8)
    packed = mxfp4.pack_codes(codes)
    return ((packed.view(E, N, K // 2), scale.view(E, N, K // 32)),
            mxfp4.dequantize(packed, scale, F64).view(E, N, K))


def round_trip64(group):
    return lambda a: fp8.round_trip_groups(a.float(), group).double()


# ---- the activations' power-of-two group scales -------------------------------------------------------
@pytest.mark.parametrize("group", [32, 128])
def test_group_scales_are_the_smallest_power_of_two_and_the_rounding_within_bound(group):
    g = gen(group)
    M, K = 24, 300                                                    # a ragged last group
    x = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-30, 30, (M, 1), generator=g).float())
    x[2] = 0                                                          # an all-zero row
    x[5, :group] *= 1e-4                                              # one quiet group in a loud row
    x[7, :] = 448 * 2.0 ** 5                                          # amax exactly 448 * 2**5: s = 5, code 448
    codes, s = fp8.quantize_groups(x, group)
    kb = -(-K // group)
    pad = torch.zeros(M, kb * group, dtype=F64)
    pad[:, :K] = x.double()
    amax = pad.view(M, kb, group).abs().amax(2)
    want = torch.tensor([[max(math.ceil(math.log2(a / 448)), -126) if a > 0 else -126 for a in row]
                         for row in amax.tolist()], dtype=torch.int32)
    assert torch.equal(s, want)
    assert codes.dtype == fp8.FP8 and codes.float().abs().max() <= 448
    assert (codes[2].float() == 0).all() and (codes[7].float() == 448).all() and (s[7] == 5).all()
    back = fp8.dequantize_groups(codes, s, F64, group)
    assert ((back - x.double()).abs() <= fp8.group_rounding_bound(x, group)).all()
    assert torch.equal(fp8.round_trip_groups(x, group), back.float())
    assert rel_err(back[5, :group], x[5, :group]) < 2 ** -4                # the quiet group keeps its precision


# ---- the CPU references against float64 ---------------------------------------------------------------
@pytest.mark.parametrize("act", ["silu", "situ"])
@pytest.mark.parametrize("form", ["decode", "prefill"])
def test_fp8_experts_reference_matches_float64(form, act):
    """Below ``fp8_experts_quant_rows_per_expert`` rows per expert the weights alone are FP8; from it the
    activations are quantised per 128 columns (I = 160: a ragged second group). float32 activations: the
    reference's float32 products against float64 within 1e-5; near the unquantised experts."""
    g = gen(3)
    E, L, I, k = 8, 256, 160, 2
    T = TUNE.fp8_experts_quant_rows_per_expert * E // k + (1 if form == "prefill" else -E // k)
    w13, q13 = fp8_experts(E, 2 * I, L, g)
    w2, q2 = fp8_experts(E, L, I, g)
    w1q, w3q = (q13[0][:, :I], q13[1][:, :I]), (q13[0][:, I:], q13[1][:, I:])
    x = torch.randn(T, L, generator=g)
    ids = ragged_ids(T, E, k, g)
    weights = torch.rand(T, k, generator=g)
    f64, beta, linear_beta = ACTS[act]
    assert fp8_act_group(ids, E) == (128 if form == "prefill" else None)
    out = fused_moe_fp8(x, w1q, q2, w3q, weights, ids, act, beta, linear_beta, combine_fp32=True)
    d13 = dequant(q13)
    read = round_trip64(128) if form == "prefill" else None
    ref = moe64(x, d13[:, :I], dequant(q2), d13[:, I:], weights, ids, f64, read)
    assert out.dtype == torch.float32 and out.shape == (T, L)
    for t in range(T):
        assert rel_err(out[t], ref[t]) < 1e-5, t
    exact = moe64(x, w13[:, :I], w2, w13[:, I:], weights, ids, f64)
    # FP8's rounding and no more: E4M3 keeps 3 bits (2.5% rms a rounding); four in a chain at prefill
    assert 1e-3 < rel_err(out, exact) < (0.05 if form == "decode" else 0.1)


def test_fp8_experts_threshold_counts_rows_per_expert():
    E, k = 16, 4
    at = TUNE.fp8_experts_quant_rows_per_expert * E // k
    assert fp8_act_group(torch.zeros(at, k, dtype=torch.long), E) == 128
    assert fp8_act_group(torch.zeros(at - 1, k, dtype=torch.long), E) is None


@pytest.mark.parametrize("act", ["silu", "situ"])
def test_w4a8_reference_matches_float64_and_is_off_by_default(act, kernel_options):
    """MXFP4 experts under ``w4a8_moe``, from ``w4a8_rows_per_expert`` rows per expert: the activations read
    as MXFP8 (per 32), the weights exact; float32 products against float64 within 1e-5. Off (the default) or
    below the threshold: the bf16-activation reference, unchanged."""
    g = gen(5)
    E, L, I, k = 6, 128, 96, 3
    T = TUNE.w4a8_rows_per_expert * E // k
    w1, d1 = mxfp4_experts(E, I, L, g)
    w3, d3 = mxfp4_experts(E, I, L, g)
    w2, d2 = mxfp4_experts(E, L, I, g)
    x = torch.randn(T, L, generator=g)
    x[:, 7] *= 40                                                  # an outlier channel, as activations have
    ids = ragged_ids(T, E, k, g)
    weights = torch.rand(T, k, generator=g)
    f64, beta, linear_beta = ACTS[act]
    plain = fused_moe_mxfp4(x, w1, w2, w3, weights, ids, act, beta, linear_beta, combine_fp32=True)
    assert torch.equal(plain, fused_moe(x, d1.float(), d2.float(), d3.float(), weights, ids, act, beta, linear_beta,
                                        combine_fp32=True))
    kernel_options(w4a8_moe=True)
    assert w4a8_applies(ids, E) and not w4a8_applies(ids[:-1], E)
    out = fused_moe_mxfp4(x, w1, w2, w3, weights, ids, act, beta, linear_beta, combine_fp32=True)
    ref = moe64(x, d1, d2, d3, weights, ids, f64, round_trip64(32))
    for t in range(T):
        assert rel_err(out[t], ref[t]) < 1e-5, t
    assert torch.equal(fused_moe_mxfp4(x[:-1], w1, w2, w3, weights[:-1], ids[:-1], act, beta, linear_beta, True),
                       plain[:-1])                                   # below the threshold: bf16 activations
    # the stated accuracy against the bf16-activation path (docs/fp8.md): the gate/up products within the
    # activations' rounding bound carried through |W|, elementwise; the layer within 10% on these random experts
    # (two E4M3 roundings of the activations in a chain: ~2.5% rms each)
    xt = x[:5].double()
    dx = fp8.group_rounding_bound(x[:5], 32)
    for e in range(2):
        moved = (round_trip64(32)(xt) - xt) @ d1[e].t()
        assert (moved.abs() <= dx @ d1[e].abs().t() * (1 + 1e-9)).all()
    assert 0.005 < rel_err(out, plain) < 0.1


def test_fp8_expert_operands_are_checked():
    g = gen(9)
    _, (codes, scale) = fp8_experts(4, 32, 64, g, loud=False)
    x, ids, w = torch.randn(2, 64), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
    with pytest.raises(ValueError, match=r"w1 must be \(float8_e4m3fn codes \[E, N, K\], float32 scale \[E, N\]\)"):
        fused_moe_fp8(x, (codes, scale[:, :3]), (codes, scale), (codes, scale), w, ids, "silu", 1.0, None, True)


# ---- the Triton kernels (interpreter) -----------------------------------------------------------------
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from kimik3.ops.triton.moe_fp8 import act_tile, e2m1_e4m3_tile, e8m0_factor, round_e4m3  # noqa: E402


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty returns NaN-filled tensors: an output element a kernel leaves unwritten shows."""
    real = torch.empty

    def empty(*a, **k):
        t = real(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize("form,T,k", [("decode-one-token", 1, 4), ("decode", 5, 3), ("prefill", 21, 3)])
def test_fp8_expert_kernels_match_the_reference(form, T, k, poisoned, kernel_options):
    """fp16 activations (rounded to nearest by the interpreter too): the kernels against ``fused_moe_fp8``'s
    reference within 2e-3 per token, ragged routing (expert 0 in every token, one in a single token, two in
    none) over ragged widths (I = 160: a partial 128-column group and tile); prefill at the tuned threshold."""
    from kimik3.ops.triton.moe import fused_moe_triton
    g = gen(T)
    E, L, I = 10, 256, 160
    if form == "prefill":
        kernel_options(fp8_experts_quant_rows_per_expert=T * k // E)
    _, q13 = fp8_experts(E, 2 * I, L, g)
    _, q2 = fp8_experts(E, L, I, g)
    w1q, w3q = (q13[0][:, :I], q13[1][:, :I]), (q13[0][:, I:], q13[1][:, I:])
    x = torch.randn(T, L, generator=g).to(FP16)
    ids = ragged_ids(T, E, k, g) if T > 1 else torch.tensor([[4, 0, 7, 2]])
    weights = torch.rand(T, k, generator=g)
    group = fp8_act_group(ids, E)
    assert group == (128 if form == "prefill" else None)
    ref = fused_moe_fp8(x, w1q, q2, w3q, weights, ids, "situ", 4.0, 25.0, combine_fp32=True)
    out = fused_moe_triton(x, w1q, q2, w3q, weights, ids, True, 4.0, 25.0, act_group=group)
    assert out.dtype == FP16 and out.shape == (T, L)
    for t in range(T):
        assert rel_err(out[t], ref[t]) < 2e-3, t


class Spy:
    """A Triton kernel launched as usual, its arguments kept (``kernel[grid](*args)``)."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append((args, kw))
            return self.kernel[grid](*args, **kw)
        return launch


def check_on_own_intermediate(monkeypatch, x, w, d, weights, ids, group, tol_h=2e-2):
    """Run the block kernels on bf16 x (experts ``w``, float64 values ``d`` = (w1, w2, w3)) with SITU, keeping
    the down kernel's arguments; then, row by row: the gate/up output h against float64 of ``group``-quantised
    x (None: x as it is) within its bf16 roundings; the down rows y against float64 of the quantised h (the
    kernel's own) times W2^T within one bf16 rounding; the combine of those rows. Every assignment written.
    Returns the output."""
    from kimik3.ops.triton import moe as kernels
    down = Spy(kernels._down_kernel)
    monkeypatch.setattr(kernels, "_down_kernel", down)
    T, k = ids.shape
    out = kernels.fused_moe_triton(x, *w, weights, ids, True, 4.0, 25.0, act_group=group)
    monkeypatch.setattr(kernels, "_down_kernel", down.kernel)
    (h, _, _, y, sorted_rows, *_), _ = down.calls[0]
    read = round_trip64(group) if group else (lambda a: a.double())
    xq = read(x)
    seen = set()
    for i, r in enumerate(sorted_rows.tolist()):
        if r >= T * k:
            continue
        seen.add(r)
        t, e = r // k, int(ids[r // k, r % k])
        assert rel_err(h[i], situ64(xq[t] @ d[0][e].t(), xq[t] @ d[2][e].t())) < tol_h, (r, "h")
        assert rel_err(y[r], (read(h[i:i + 1]) @ d[1][e].t())[0]) < 8e-3, (r, "y")
    assert seen == set(range(T * k))
    combined = (weights.double().unsqueeze(-1) * y.double().view(T, k, -1)).sum(1)
    assert rel_err(out, combined) < 8e-3
    return out


@pytest.mark.parametrize("group", [None, 128], ids=["decode", "prefill"])
def test_fp8_expert_kernels_bf16_on_their_own_intermediate(group, poisoned, monkeypatch):
    """bf16 activations, both forms, checked on the kernels' own intermediate (``check_on_own_intermediate``)."""
    g = gen(17)
    E, L, I, T, k = 8, 128, 160, 9, 2
    _, q13 = fp8_experts(E, 2 * I, L, g)
    _, q2 = fp8_experts(E, L, I, g)
    w1q, w3q = (q13[0][:, :I], q13[1][:, :I]), (q13[0][:, I:], q13[1][:, I:])
    d13 = dequant(q13)
    x = torch.randn(T, L, generator=g).to(BF16)
    out = check_on_own_intermediate(monkeypatch, x, (w1q, q2, w3q), (d13[:, :I], dequant(q2), d13[:, I:]),
                                    torch.rand(T, k, generator=g), ragged_ids(T, E, k, g), group)
    assert out.dtype == BF16 and out.shape == (T, L)


@pytest.mark.parametrize("T", [3, 40], ids=["small", "ragged-blocks"])
def test_w4a8_kernels_match_float64_on_their_own_intermediate(T, poisoned, monkeypatch):
    """W4A8 (bf16 x, MXFP4 experts whose group scales span 5 binades, an outlier channel): MXFP8 activations,
    exact MXFP4 weights (``check_on_own_intermediate``); the result moved from the bf16-activation kernels'
    by no more than the stated bound."""
    from kimik3.ops.triton import moe as kernels
    g = gen(T + 40)
    E, L, I, k = 8, 128, 96, 2
    w1, d1 = mxfp4_experts(E, I, L, g, spread=2)
    w3, d3 = mxfp4_experts(E, I, L, g, spread=2)
    w2, d2 = mxfp4_experts(E, L, I, g, spread=2)
    x = torch.randn(T, L, generator=g)
    x[:, 9] *= 30
    x = x.to(BF16)
    ids = ragged_ids(T, E, k, g)
    weights = torch.rand(T, k, generator=g)
    out = check_on_own_intermediate(monkeypatch, x, (w1, w2, w3), (d1, d2, d3), weights, ids, 32)
    plain = kernels.fused_moe_triton(x, w1, w2, w3, weights, ids, True, 4.0, 25.0)
    assert 0.002 < rel_err(out, plain) < 0.1


def test_expert_kernels_refuse_what_they_do_not_take():
    from kimik3.ops.triton.moe import fused_moe_triton
    g = gen(2)
    _, q = fp8_experts(4, 32, 64, g, loud=False)
    w, dense = mxfp4_experts(4, 32, 64, g)[0], torch.randn(4, 32, 64).to(BF16)
    x, ids, wt = torch.randn(2, 64).to(BF16), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
    with pytest.raises(ValueError, match="FP8 experts quantise their activations per 128 columns"):
        fused_moe_triton(x, q, q, q, wt, ids, True, 4.0, 25.0, act_group=32)
    with pytest.raises(ValueError, match=r"MXFP4 experts take MXFP8 activations \(act_group=32\)"):
        fused_moe_triton(x, w, w, w, wt, ids, True, 4.0, 25.0, act_group=128)
    with pytest.raises(ValueError, match="dense experts take their activations as they are"):
        fused_moe_triton(x, dense, dense.transpose(1, 2), dense, wt, ids, True, 4.0, 25.0, act_group=128)
    with pytest.raises(ValueError, match="need BKH = 16"):
        fused_moe_triton(x, w, w, w, wt, ids, True, 4.0, 25.0, act_group=32,
                         tiles=dict(BM=16, BN1=32, BN2=32, BKH=32, warps=4, stages=2))


def test_fp8_dispatch_follows_the_thresholds_and_the_option(kernel_options, monkeypatch):
    """With the kernels taking CPU tensors (``cpu_kernels``): FP8 experts reach ``fused_moe_triton`` with
    act_group 128 from the threshold (None below); MXFP4 experts with 32 only under ``w4a8_moe``."""
    from kimik3.ops.triton import moe as kernels
    seen = []
    monkeypatch.setattr(kernels, "fused_moe_triton", lambda *a, **kw: seen.append(kw["act_group"]) or a[0])
    kernel_options(cpu_kernels=True)
    g = gen(4)
    E, k = 4, 2
    _, q = fp8_experts(E, 32, 64, g, loud=False)
    w = mxfp4_experts(E, 32, 64, g)[0]
    x = torch.randn(64, 64).to(BF16)
    for T in (TUNE.fp8_experts_quant_rows_per_expert * E // k, TUNE.fp8_experts_quant_rows_per_expert * E // k - 1):
        fused_moe_fp8(x[:T], q, q, q, torch.ones(T, k), torch.zeros(T, k, dtype=torch.long), "silu", 1.0, None, True)
    assert seen == [128, None]
    seen.clear()
    T = TUNE.w4a8_rows_per_expert * E // k
    xs, ids = torch.randn(T, 64).to(BF16), torch.zeros(T, k, dtype=torch.long)
    fused_moe_mxfp4(xs, w, w, w, torch.ones(T, k), ids, "situ", 4.0, 25.0, True)
    kernel_options(w4a8_moe=True)
    fused_moe_mxfp4(xs, w, w, w, torch.ones(T, k), ids, "situ", 4.0, 25.0, True)
    fused_moe_mxfp4(xs[:-1], w, w, w, torch.ones(T - 1, k), ids[:-1], "situ", 4.0, 25.0, True)
    assert seen == [None, 32, None]


# ---- the kernels' FP8 pieces, bit for bit ---------------------------------------------------------------
@triton.jit
def _act_tiles_kernel(x, out, K, BM: tl.constexpr, BK: tl.constexpr):
    r, c = tl.arange(0, BM), tl.arange(0, BK)
    for k0 in range(0, K, BK):
        cc = k0 + c
        q, fa = act_tile(x + r[:, None] * K + cc[None, :], (cc < K)[None, :], True, True)
        tl.store(out + r[:, None] * K + cc[None, :], q * fa[:, None], mask=(cc < K)[None, :])


@triton.jit
def _e2m1_kernel(packed, scale, out, KH, BN: tl.constexpr):
    n = tl.arange(0, BN)
    mn = n < BN
    k = tl.arange(0, 32)
    for kh in range(0, KH, 16):
        w = e2m1_e4m3_tile(packed + n[:, None] * KH, kh, KH, mn, BN, 16, True)
        f = e8m0_factor(tl.load(scale + n * (KH // 16) + kh // 16).to(tl.int32))
        tl.store(out + n[:, None] * (2 * KH) + 2 * kh + k[None, :], w * f[:, None])


@triton.jit
def _round_kernel(x, y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y + i, round_e4m3(tl.load(x + i)))


@pytest.mark.parametrize("dtype", [BF16, FP16, torch.float32])
@pytest.mark.parametrize("group", [32, 128])
def test_activation_tiles_quantise_as_the_reference(group, dtype):
    """``moe_fp8.act_tile`` (the interpreter's float32 rounding) against ``fp8.round_trip_groups`` bit for bit:
    rows over 2**-40 .. 2**40, a zero row, a quiet group, groups whose amax is 448 times a power of two, a ragged
    last group."""
    g = gen(group)
    BM, K = 16, 300
    x = torch.randn(BM, K, generator=g) * torch.exp2(torch.randint(-40, 40, (BM, 1), generator=g).float())
    x[1] = 0
    x[4, 40:90] *= 1e-3
    x[6] = torch.randn(K, generator=g) * 0.1
    x[6, ::7] = 448 * 2.0 ** 3                       # amax exactly 448 * 2**3 (significand 1.75): s = 3, not 4,
    x[6, 1::7] = 3 * 2.0 ** -6                       # which this value (code 3 * 2**-9 at s = 3, a tie at 4) shows
    x = x.to(dtype)
    out = torch.empty(BM, K)
    _act_tiles_kernel[(1,)](x, out, K, BM=BM, BK=group)
    assert torch.equal(out, fp8.round_trip_groups(x.float(), group))


def test_e2m1_expansion_to_e4m3_is_exact():
    """Every nibble and E8M0 codes 0 .. 250 (2**-127, subnormal, included; above 250 a 6 overflows float32):
    the E4M3 expansion times the group factor is ``mxfp4.dequantize``."""
    g = gen(8)
    N, K = 16, 256
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    codes[0, :16] = torch.arange(16, dtype=torch.uint8)
    scale = torch.randint(0, 251, (N, K // 32), generator=g).to(torch.uint8)
    scale[0, :2] = torch.tensor([0, 250], dtype=torch.uint8)
    packed = mxfp4.pack_codes(codes)
    out = torch.empty(N, K)
    _e2m1_kernel[(1,)](packed, scale, out, K // 2, BN=N)
    assert torch.equal(out.double(), mxfp4.dequantize(packed, scale, F64))


def test_e4m3_rounding_of_the_interpreter_path_is_torchs():
    """``round_e4m3`` against torch's float32 -> float8_e4m3fn (round to nearest even), over normals,
    subnormals and exact ties."""
    g = gen(1)
    N = 1 << 14
    v = ((torch.rand(N, generator=g) * 2 - 1) * torch.exp2(torch.randint(-14, 9, (N,), generator=g).float())).clamp(-448, 448)
    grid = torch.arange(256, dtype=torch.uint8).view(fp8.FP8).float()
    grid = grid[grid.isfinite()].unique()
    ties = (grid[1:] + grid[:-1]) / 2
    v = torch.cat([v, ties, grid])
    v = torch.cat([v, torch.zeros(triton.next_power_of_2(len(v)) - len(v))])
    out = torch.empty_like(v)
    _round_kernel[(1,)](v, out, N=len(v))
    assert torch.equal(out, v.to(fp8.FP8).float())
