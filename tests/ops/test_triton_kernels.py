"""Our Triton kernels against the torch reference ops, on CPU through TRITON_INTERPRET=1 at tiny
sizes (the same kernels run on CUDA in tests/gpu, with METHOD.md's bf16 bounds).

Triton's interpreter rounds fp32 -> bf16 toward zero (seen with triton 3.9: 1.00703 -> 1.0), a
bias of up to one bf16 ulp (2**-8 relative) per rounding; bounds below allow for that and no more.
"""

import math

import pytest
import torch

triton = pytest.importorskip("triton")

from kimik3.ops import mxfp4                                            # noqa: E402
from kimik3.ops.attn_res import attn_res_mix                            # noqa: E402
from kimik3.ops.conv import causal_conv1d                               # noqa: E402
from kimik3.ops.mla import mla_decode_attention                         # noqa: E402
from kimik3.ops.moe import fused_moe                                    # noqa: E402
from kimik3.ops.options import KernelTuning                             # noqa: E402
from tests.helpers import rel_err

BF16 = torch.bfloat16


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ---- l2norm ------------------------------------------------------------------------------
@pytest.mark.parametrize("rows,D", [(1, 128), (37, 128), (300, 64), (5, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_l2norm_kernel_matches_float64(rows, D, dtype):
    """Rows x / sqrt(sum(x^2) + 1e-6) from the math in float64, one rounding to ``dtype`` apart; row
    counts below, at and across the kernel's row block; a zero row stays zero, a tiny one sees eps."""
    from kimik3.ops.triton.l2norm import l2norm_triton
    x = (torch.randn(rows, 3, D, generator=gen(rows + D)) * 4).to(dtype)
    x[0, 1] = 0
    x[-1, 2] *= 1e-3                  # a row whose sum of squares is near eps: eps must be the math's
    x64 = x.double()
    want = x64 / torch.sqrt(x64.pow(2).sum(-1, keepdim=True) + 1e-6)
    got = l2norm_triton(x)
    assert got.shape == x.shape and got.dtype == dtype
    ulp = 2 ** -7 if dtype == BF16 else 2 ** -22     # one rounding of values <= 1 (interpreter: toward zero)
    assert (got.double() - want).abs().max() <= ulp
    assert torch.equal(got[0, 1], torch.zeros(D, dtype=dtype))


def test_l2norm_kernel_refuses_a_row_size_it_cannot_tile():
    from kimik3.ops.triton.l2norm import l2norm_triton
    with pytest.raises(ValueError, match="power of two"):
        l2norm_triton(torch.randn(2, 96))


# ---- conv --------------------------------------------------------------------------------
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("lens,ctx,given", [([5, 1, 9], [0, 3, 2], True), ([1, 1, 1, 1], [4, 1, 2, 7], True),
                                            ([1, 1, 1, 1], [4, 1, 2, 7], False), ([2, 1, 3], [4, 1, 2], False)],
                         ids=["varlen", "decode", "decode_kernel", "short_all_history"])
def test_conv_pool_kernel_matches_reference(lens, ctx, given, groups):
    """The windows and outputs against the reference; the inputs read with a row stride (a column
    slice of a merged projection), the outputs in ``groups`` channel groups side by side. Without
    ``has_state`` (every sequence has history) a decode step takes its own one-pass kernel."""
    from kimik3.ops.triton.conv import causal_conv1d_pool_triton
    g = gen(0)
    C, W, N = 40, 4, len(lens)
    x = torch.randn(sum(lens), C + 24, generator=g).to(BF16)[:, :C]
    w = torch.randn(C, W, generator=g)
    pool = torch.randn(9, C, W - 1, generator=g).to(BF16)
    slots = torch.tensor([7, 2, 5, 3][:N])                               # scattered, non-contiguous rows
    has = torch.tensor(ctx) > 0
    cu = torch.tensor([0, *lens]).cumsum(0)
    state0 = pool[slots].masked_fill(~has.view(-1, 1, 1), 0)
    y_ref, s_ref = causal_conv1d(x, w, state0, lens)
    before = pool.clone()
    y = causal_conv1d_pool_triton(x, w, pool, slots, has if given else None, cu, groups)
    assert y.shape == (groups, sum(lens), C // groups)
    assert rel_err(torch.cat(y.unbind(0), dim=-1), y_ref) < 8e-3        # one truncating bf16 rounding
    assert torch.equal(pool[slots], s_ref)
    untouched = [i for i in range(9) if i not in slots.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("tile", [(64, 64, 4), (8, 256, 8)])
def test_conv_pool_kernel_other_tiles_match_reference(tile):
    """Tiles of other shapes (the prefill sweep's): sequences that start inside a tile, channels past
    the last full tile; against the reference, and the default tile's numbers exactly."""
    from kimik3.ops.triton.conv import causal_conv1d_pool_triton
    g = gen(1)
    C, W, lens = 40, 4, [70, 3, 20]
    x = torch.randn(sum(lens), C, generator=g).to(BF16)
    w = torch.randn(C, W, generator=g)
    pool = torch.randn(4, C, W - 1, generator=g).to(BF16)
    slots, has, cu = torch.tensor([3, 1, 2]), torch.tensor([True, False, True]), torch.tensor([0, *lens]).cumsum(0)
    y_ref, s_ref = causal_conv1d(x, w, pool[slots].masked_fill(~has.view(-1, 1, 1), 0), lens)
    pool2 = pool.clone()
    want = causal_conv1d_pool_triton(x, w, pool, slots, has, cu)
    got = causal_conv1d_pool_triton(x, w, pool2, slots, has, cu, tile=tile)
    assert rel_err(got[0], y_ref) < 8e-3 and torch.equal(pool2[slots], s_ref)
    assert torch.equal(got, want)


@pytest.mark.parametrize("W", [2, 3])
def test_conv_pool_kernel_narrow_kernels_match_reference(W):
    """Kernel sizes below 4 (zero taps in the prefill kernel's registers, windows of W-1 columns):
    sequences starting inside a run, fresh and continued, against the reference; a zero tap never
    reads past its window (an inf there stays in its own channel)."""
    from kimik3.ops.triton.conv import causal_conv1d_pool_triton
    g = gen(2)
    C, lens = 24, [9, 2, 30]
    x = torch.randn(sum(lens), C, generator=g).to(BF16)
    w = torch.randn(C, W, generator=g)
    pool = torch.randn(4, C, W - 1, generator=g).to(BF16)
    pool[2, 5, W - 2] = float("inf")        # an overflowed window column: only channel 5 of sequence 0 sees it
    slots, has, cu = torch.tensor([2, 3, 1]), torch.tensor([True, False, True]), torch.tensor([0, *lens]).cumsum(0)
    y_ref, s_ref = causal_conv1d(x, w, pool[slots].masked_fill(~has.view(-1, 1, 1), 0), lens)
    got = causal_conv1d_pool_triton(x, w, pool, slots, has, cu, tile=(8, 16, 1))[0]
    finite = torch.isfinite(y_ref)
    assert not finite.all() and torch.equal(torch.isfinite(got), finite)
    assert rel_err(got[finite], y_ref[finite]) < 8e-3 and torch.equal(pool[slots], s_ref)


def test_conv_pool_kernel_names_a_kernel_size_it_does_not_take():
    from kimik3.ops.triton.conv import causal_conv1d_pool_triton
    with pytest.raises(ValueError, match="kernel size 5"):
        causal_conv1d_pool_triton(torch.randn(4, 8).to(BF16), torch.randn(8, 5), torch.zeros(2, 8, 4).to(BF16),
                                  torch.tensor([1]), torch.tensor([True]), torch.tensor([0, 4]))


# ---- KDA decode ----------------------------------------------------------------------------
@pytest.mark.parametrize("low_rank", [0, 64, 16], ids=["dense", "low_rank", "low_rank_narrow"])
@pytest.mark.parametrize("with_norm", [False, True], ids=["o", "normed"])
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
def test_kda_decode_kernel_matches_float64(lower_bound, with_norm, low_rank):
    """One decode step of three sequences in scattered pool slots against the equations in float64:
    gate (K3's bounded sigmoid or Kimi-Linear's softplus, with a logit past softplus's threshold),
    beta = sigmoid(b), q and k L2-normalised (q by K^-1/2), decay, delta rule, output. q and b are
    read with row strides (slices of a wider projection); value channels span two programs. With the
    output norm: rmsnorm(o) * w * sigmoid(gate) of o rounded to bf16, the gate read with a row stride.
    Low rank: f and the output gate as low-rank pairs (rows of a wider tensor times [H K, R] up-projections,
    R = 64 or 16, computed in the kernel), on values whose products sum exactly in fp32, so both round as float64's."""
    from kimik3.ops.triton.kda import kda_decode_triton
    g = gen(5)
    N, H, K = 3, 2, 32
    V = K
    wide = torch.randn(N, 3 * H * K + H + 8, generator=g).to(BF16)
    q = wide[:, :H * K].view(N, H, K)
    k, v = (wide[:, H * K * (i + 1):H * K * (i + 2)].view(N, H, K) for i in range(2))
    b = wide[:, 3 * H * K:3 * H * K + H]
    f = (torch.randn(N, H, K, generator=g) * 3).to(BF16)
    f[0, 0, 0] = 30.0                                                    # softplus's identity branch
    A_log = torch.randn(H, generator=g) * 0.5
    dt_bias = torch.randn(H * K, generator=g) * 0.5
    pool = torch.randn(6, H, V, K, generator=g)
    slots = torch.tensor([4, 1, 3])
    before = pool.clone()
    out_gate = torch.randn(N, H * V + 5, generator=g).to(BF16)[:, 5:].view(N, H, V)
    norm_w = torch.randn(V, generator=g) * 0.3 + 1
    f_arg, gate_arg = f, out_gate
    if low_rank:
        R = low_rank                                                     # chunks of 32, or one narrower chunk
        lr_a = (torch.randint(-4, 5, (N, 2 * R + 3), generator=g) * 0.25).to(BF16)[:, 3:]    # f_a | g_a, row stride
        f_w, g_w = ((torch.randint(-3, 4, (H * K, R), generator=g) * 0.125).to(BF16) for _ in range(2))
        f_arg, gate_arg = (lr_a[:, :R], f_w), (lr_a[:, R:], g_w)
        f = (lr_a[:, :R].double() @ f_w.double().t()).to(BF16).view(N, H, K)                  # exact sums, rounded
        out_gate = (lr_a[:, R:].double() @ g_w.double().t()).to(BF16).view(N, H, V)
    norm = (norm_w, gate_arg, 1e-5, BF16) if with_norm else None
    o = kda_decode_triton(q, k, v, f_arg, b, A_log, dt_bias, lower_bound, pool, slots, block_v=16, norm=norm)

    d = lambda t: t.double()                                             # noqa: E731
    z = d(f) + d(dt_bias).view(1, H, K)
    a = torch.exp(d(A_log)).view(1, H, 1)
    gate = lower_bound * torch.sigmoid(a * z) if lower_bound is not None else -a * torch.where(
        z > 20, z, torch.log1p(torch.exp(z)))
    qn = d(q) / torch.sqrt((d(q) ** 2).sum(-1, keepdim=True) + 1e-6) / math.sqrt(K)
    kn = d(k) / torch.sqrt((d(k) ** 2).sum(-1, keepdim=True) + 1e-6)
    beta = torch.sigmoid(d(b))
    S = d(before[slots]) * torch.exp(gate).unsqueeze(2)                  # [N, H, V, K]: rows decay by key channel
    delta = beta.unsqueeze(-1) * (d(v) - (S * kn.unsqueeze(2)).sum(-1))
    S = S + delta.unsqueeze(-1) * kn.unsqueeze(2)
    want = (S * qn.unsqueeze(2)).sum(-1)
    if with_norm:                                                        # o rounded to bf16, as fla's o is
        o_bf16 = want.to(BF16).double()
        want = o_bf16 / torch.sqrt((o_bf16 ** 2).mean(-1, keepdim=True) + 1e-5) * d(norm_w) * torch.sigmoid(d(out_gate))
    assert o.shape == (N, H, V) and o.dtype == BF16
    assert rel_err(o, want) < 8e-3                                       # one truncating bf16 rounding
    assert (d(pool[slots]) - S).abs().max() <= 1e-5 * S.abs().max()
    untouched = [i for i in range(6) if i not in slots.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


# ---- MLA decode --------------------------------------------------------------------------
@pytest.mark.parametrize("form,bs,bv,trans", [("gather", 4, 0, False), ("paged", 16, 0, False), ("gather", 4, 16, False),
                                              ("paged", 16, 16, False), ("gather", 4, 16, True), ("paged", 16, 0, True),
                                              ("gather", 4, 0, True), ("default", 4, 0, False)],
                         ids=["gather", "paged", "gather-half-columns", "paged-half-columns", "gather-half-columns-t",
                              "paged-t", "gather-t", "default"])
@pytest.mark.parametrize("max_len,sms", [(23, 4), (4096, 64), (50, 1)], ids=["tight", "graph_pinned_long", "one_split"])
def test_mla_decode_kernel_matches_reference(max_len, sms, form, bs, bv, trans, monkeypatch):
    """max_len 4096: a launch sized for long sequences (CUDA graphs pin it to max_model_len) over
    short ones: every sequence spreads over the splits, and a one-token sequence leaves most empty
    (their partial outputs are never written nor read: the scratch comes NaN-filled);
    one SM: one split walks all of a sequence's blocks.
    Both forms of pass 1; the paged one with a feature width (P = 8) under its 16-wide tile; each
    also with programs that output half of the R latent columns (bv = 16), and with the products
    transposed (token rows as the M side); and the default launch (``config_for``). The gather form
    loads each tile's block ids a tile ahead: "one_split" walks many tiles in one program."""
    from kimik3.ops.triton.mla_decode import DecodeConfig, mla_decode_triton
    g = gen(1)
    N, H, R, P = 3, 5, 32, 8
    lens = [9, 1, 23] if bs == 4 else [9, 1, 50]
    cache = torch.randn(20, bs, R + P, generator=g).to(BF16)
    perm = torch.randperm(19, generator=g) + 1
    tables = torch.full((N, 6), -1, dtype=torch.int32)
    used = 0
    for n, L in enumerate(lens):
        nb = -(-L // bs)
        tables[n, :nb] = perm[used:used + nb].int()
        used += nb
    q_lat = torch.randn(N, H, R, generator=g).to(BF16)
    q_pe = torch.randn(N, H, P, generator=g).to(BF16)
    scale = 0.2
    ref = mla_decode_attention(q_lat.double(), q_pe.double(), cache.double(), tables, lens, R, scale)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    out = mla_decode_triton(q_lat, q_pe, cache, tables, torch.tensor(lens, dtype=torch.int32), max(max_len, *lens),
                            scale, num_sms=sms,
                            config=None if form == "default" else DecodeConfig(form=form, bh=16, bn=16, bv=bv, trans=trans))
    for n in range(N):
        assert rel_err(out[n], ref[n]) < 1e-2, n


@pytest.mark.parametrize("S", [1, 7, 70], ids=["one_split", "one_chunk", "three_chunks"])
def test_mla_decode_merge_matches_float64(S):
    """Pass 2 alone: S split partials (outputs [BR], log2-sum-exps) of each (sequence, head) merged, BS
    splits at a time, against the float64 softmax merge: the largest lse in a later chunk than the first
    (the running sum must be rescaled), empty splits (lse -inf, outputs NaN: never read), one head whose
    splits are all empty but one."""
    from kimik3.ops.triton.mla_decode import MERGE_SPLITS, _mla_decode_merge_kernel
    g = gen(S)
    N, H, R, BR = 2, 3, 24, 32
    lse = torch.randn(N * H, S, generator=g) * 4 + torch.linspace(0, 12, S)       # later splits weigh more
    lse[:, 1::5] = float("-inf")
    lse[1, :] = float("-inf")
    lse[1, S // 2] = 3.0
    part_o = torch.randn(N * H, S, BR, generator=g)
    part_o[lse == float("-inf")] = float("nan")
    w = torch.exp2(lse.double() - lse.double().max(-1, keepdim=True).values)
    want = (w[..., None] * part_o.double().nan_to_num()).sum(1) / w.sum(1, keepdim=True)
    out = torch.empty(N, H, R, dtype=BF16)
    out_lse = torch.empty(N, H)
    _mla_decode_merge_kernel[(N, H)](part_o.reshape(-1, BR), lse.reshape(-1), out, out_lse, H, R, out.stride(0),
                                     out.stride(1), S, BR=BR, BS=min(MERGE_SPLITS, triton.next_power_of_2(S)),
                                     LSE=True, PDL=False)
    assert S <= MERGE_SPLITS or S > 2 * MERGE_SPLITS                   # the chunks the ids name
    assert rel_err(out.reshape(N * H, R), want[:, :R]) < 8e-3           # one bf16 rounding
    want_lse = torch.logsumexp(lse.double() * math.log(2), dim=-1)      # log2 units in, natural log out
    assert torch.allclose(out_lse.reshape(-1).double(), want_lse, rtol=1e-5, atol=1e-5)


def test_mla_decode_kernel_returns_the_log_sum_exp():
    """``return_lse`` (decode context parallelism merges ranks' partials with it): each row's natural-log
    log-sum-exp as the float64 reference gives it; a sequence without keys gives output 0 and lse -inf
    (not NaN), as ``merge_attention`` needs."""
    from kimik3.ops.triton.mla_decode import mla_decode_triton
    g = gen(3)
    N, H, R, P, bs = 3, 4, 32, 8, 4
    lens = [5, 0, 11]
    cache = torch.randn(12, bs, R + P, generator=g).to(BF16)
    tables = torch.tensor([[1, 2, 0], [3, 0, 0], [4, 5, 6]], dtype=torch.int32)
    q_lat, q_pe = torch.randn(N, H, R, generator=g).to(BF16), torch.randn(N, H, P, generator=g).to(BF16)
    ref, ref_lse = mla_decode_attention(q_lat.double(), q_pe.double(), cache.double(), tables, lens, R, 0.2,
                                        return_lse=True)
    out, lse = mla_decode_triton(q_lat, q_pe, cache, tables, torch.tensor(lens, dtype=torch.int32), 11, 0.2,
                                 return_lse=True)
    assert torch.equal(out[1].float(), torch.zeros(H, R)) and torch.isneginf(lse[1]).all()
    assert torch.isneginf(ref_lse[1]).all() and not ref[1].any()
    for n in (0, 2):
        assert rel_err(out[n], ref[n]) < 1e-2
        assert torch.allclose(lse[n].double(), ref_lse[n], atol=2e-2)


@pytest.mark.parametrize("W", [4, 2])
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
def test_kda_decode_step_after_the_conv_matches_float64(lower_bound, W):
    """A KDA layer's decode step as the model runs it on CUDA: the conv's decode kernel (conv + SiLU of the raw
    q / k / v channels over each sequence's window, rounded to bf16) then the step's kernel with the output
    norm, against the math in float64; the windows shifted by one with the raw input appended, bit for bit;
    other slots untouched."""
    from kimik3.ops.triton.conv import causal_conv1d_pool_triton
    from kimik3.ops.triton.kda import kda_decode_triton
    g = gen(17 + W)
    N, H, K = 3, 2, 32
    P = H * K
    raw = torch.randn(N, 3 * P + 9, generator=g).to(BF16)[:, 9:]                # a slice of the merged projection
    conv_w = torch.randn(3 * P, W, generator=g) * 0.5
    windows = torch.randn(5, 3 * P, W - 1, generator=g).to(BF16)
    f = (torch.randn(N, H, K, generator=g) * 3).to(BF16)
    b = torch.randn(N, H, generator=g).to(BF16)
    A_log, dt_bias = torch.randn(H, generator=g) * 0.5, torch.randn(P, generator=g) * 0.5
    states = torch.randn(5, H, K, K, generator=g)
    out_gate = torch.randn(N, H, K, generator=g).to(BF16)
    norm = (torch.randn(K, generator=g) * 0.3 + 1, out_gate, 1e-5, BF16)
    slots = torch.tensor([4, 0, 2])
    conv_pool, state_pool = windows.clone(), states.clone()
    qkv = causal_conv1d_pool_triton(raw, conv_w, conv_pool, slots, None, torch.arange(N + 1), 3)
    o = kda_decode_triton(*(t.view(N, H, K) for t in qkv), f, b, A_log, dt_bias, lower_bound, state_pool, slots,
                          norm=norm)

    d = lambda t: t.double()                                             # noqa: E731
    hist = torch.cat([d(windows[slots]), d(raw).unsqueeze(-1)], -1)      # [N, 3P, W]
    acc = (hist * d(conv_w)).sum(-1)
    y = (acc * torch.sigmoid(acc)).to(BF16).double()                     # the conv's output, rounded
    q, k, v = (y[:, i * P:(i + 1) * P].view(N, H, K) for i in range(3))
    z = d(f) + d(dt_bias).view(1, H, K)
    a = torch.exp(d(A_log)).view(1, H, 1)
    gate = lower_bound * torch.sigmoid(a * z) if lower_bound is not None else -a * torch.where(
        z > 20, z, torch.log1p(torch.exp(z)))
    qn = q / torch.sqrt((q ** 2).sum(-1, keepdim=True) + 1e-6) / math.sqrt(K)
    kn = k / torch.sqrt((k ** 2).sum(-1, keepdim=True) + 1e-6)
    S = d(states[slots]) * torch.exp(gate).unsqueeze(2)
    S = S + (torch.sigmoid(d(b)).unsqueeze(-1) * (v - (S * kn.unsqueeze(2)).sum(-1))).unsqueeze(-1) * kn.unsqueeze(2)
    o_bf16 = (S * qn.unsqueeze(2)).sum(-1).to(BF16).double()
    want = o_bf16 / torch.sqrt((o_bf16 ** 2).mean(-1, keepdim=True) + 1e-5) * d(norm[0]) * torch.sigmoid(d(out_gate))
    assert o.shape == (N, H, K) and o.dtype == BF16
    assert rel_err(o, want) < 8e-3                                       # one truncating bf16 rounding
    # q, k, v are the conv's bf16 outputs: a truncating rounding there moves the new state by up to an ulp of
    # the delta rule's terms
    assert (d(state_pool[slots]) - S).abs().max() <= 2 ** -5 * S.abs().max()
    assert torch.equal(conv_pool[slots], torch.cat([windows[slots, :, 1:], raw.unsqueeze(-1)], -1))
    others = [1, 3]
    assert torch.equal(conv_pool[others], windows[others]) and torch.equal(state_pool[others], states[others])


# ---- MLA cache rows ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("R,P", [(32, 8), (48, 5)], ids=["pow2", "ragged"])
def test_cache_latent_kernel_matches_float64(R, P, dtype):
    """Each token's row [rms_norm(c_kv) * w | k_pe] lands at its slot: the norm from the math in float64
    within its two roundings (the normalised row, then times the weight), k_pe bit for bit; rows of
    other slots untouched; c read through a row stride (a column slice of the merged projection)."""
    from kimik3.ops.triton.norm import cache_latent_triton
    g = gen(R + P)
    T, eps = 5, 1e-6
    wide = torch.randn(T, 3 + R + P + 4, generator=g).mul(3).to(dtype)
    c = wide[:, 3:3 + R + P]
    c[1, :R] *= 1e-3                                                     # a small row: eps must be the math's
    w = (1 + 0.2 * torch.randn(R, generator=g)).to(dtype)
    cache = torch.randn(4, 4, R + P, generator=g).to(dtype)
    before = cache.clone()
    slots = torch.tensor([13, 2, 7, 0, 9])
    cache_latent_triton(c, w, eps, cache, slots)
    rows = cache.view(-1, R + P)
    x = c[:, :R].double()
    normed = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    want = normed * w.double()
    ulp = 2 ** -7 if dtype == BF16 else 2 ** -10                   # one rounding, the interpreter's truncation
    got = rows[slots, :R].double()
    assert ((got - want).abs() <= ulp * (want.abs() + normed.abs() * w.double().abs())).all()
    assert torch.equal(rows[slots, R:], c[:, R:])
    others = torch.ones(16, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(rows[others], before.view(-1, R + P)[others])


def test_cache_latent_kernel_refuses_mismatched_operands():
    from kimik3.ops.triton.norm import cache_latent_triton
    c, w, cache, slots = torch.zeros(2, 40, dtype=BF16), torch.ones(32), torch.zeros(2, 4, 40, dtype=BF16), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="do not match"):
        cache_latent_triton(c, w, 1e-6, torch.zeros(2, 4, 36, dtype=BF16), slots)         # cache rows of another width
    with pytest.raises(ValueError, match="do not match"):
        cache_latent_triton(c.float(), w, 1e-6, cache, slots)                            # another dtype than the cache
    with pytest.raises(ValueError, match="do not match"):
        cache_latent_triton(c, w, 1e-6, cache, torch.tensor([0]))                        # a slot short
    with pytest.raises(ValueError, match="do not match"):
        cache_latent_triton(c, torch.ones(40), 1e-6, cache, slots)                       # no rope part left


def test_cache_latent_reference_path_is_the_norm_then_the_copy():
    """ops.mla.cache_latent on the CPU: rms_norm of the latent part, the rope part as it is, at the slots."""
    from kimik3.ops.mla import cache_latent
    from kimik3.ops.norm import rms_norm
    g = gen(5)
    c = torch.randn(3, 40, generator=g).to(BF16)
    w = torch.randn(32, generator=g).to(BF16)
    cache = torch.zeros(2, 4, 40, dtype=BF16)
    cache_latent(c, w, 1e-6, cache, torch.tensor([6, 1, 3]))
    rows = cache.view(-1, 40)
    assert torch.equal(rows[[6, 1, 3], :32], rms_norm(c[:, :32], w, 1e-6))
    assert torch.equal(rows[[6, 1, 3], 32:], c[:, 32:])


# ---- MoE MXFP4 ---------------------------------------------------------------------------
def _packed_experts(E, N, K, g):
    codes = torch.randint(0, 16, (E * N, K), generator=g, dtype=torch.uint8)
    scale = (127 - round(math.log2(2 * math.sqrt(K))) + torch.randint(-1, 2, (E * N, K // 32), generator=g)).to(torch.uint8)
    packed = mxfp4.pack_codes(codes)
    dense = mxfp4.dequantize(packed, scale, BF16).view(E, N, K)
    return (packed.view(E, N, K // 2), scale.view(E, N, K // 32)), dense


@pytest.mark.parametrize("T", [1, 3, 40], ids=["T1", "T3", "T40"])
def test_moe_mxfp4_kernel_matches_dense_reference(T):
    from kimik3.ops.triton.moe import fused_moe_triton
    g = gen(2)
    E, L, I, k = 6, 64, 96, 3
    w1, d1 = _packed_experts(E, I, L, g)
    w3, d3 = _packed_experts(E, I, L, g)
    w2, d2 = _packed_experts(E, L, I, g)
    x = torch.randn(T, L, generator=g).to(BF16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)

    ref = fused_moe(x, d1, d2, d3, weights, ids, "situ", 4.0, 25.0, combine_fp32=True)
    out = fused_moe_triton(x, w1, w2, w3, weights, ids, True, 4.0, 25.0)
    assert rel_err(out, ref) < 3e-2        # four truncating bf16 roundings in a chain


@pytest.mark.parametrize("mxfp4", [False, True], ids=["dense", "mxfp4"])
def test_moe_one_token_blocks_equal_the_aligned_path(mxfp4, monkeypatch):
    """A single token's k distinct experts take a block each without the alignment launch: the same bits
    as the aligned tables, and the alignment is never called."""
    from kimik3.ops.triton import moe as kernels
    g = gen(31)
    E, L, I, k = 8, 64, 96, 5
    if mxfp4:
        (w1, _), (w3, _), (w2, _) = (_packed_experts(E, n, m, g) for n, m in ((I, L), (I, L), (L, I)))
    else:
        w1, w3 = (torch.randn(E, I, L, generator=g).to(BF16) * L ** -0.5 for _ in range(2))
        w2 = torch.randn(E, L, I, generator=g).to(BF16) * I ** -0.5
    x = torch.randn(1, L, generator=g).to(BF16)
    ids = torch.randperm(E, generator=g)[:k].view(1, k)
    weights = torch.rand(1, k, generator=g)
    tiles = kernels._tiles(k / E, mxfp4)
    aligned = kernels.fused_moe_triton(x, w1, w2, w3, weights, ids, False, 1.0, None, tiles=dict(tiles, one_token=False))
    monkeypatch.setattr(kernels, "_sort_by_expert", None)                 # must not be needed
    # (given tiles, dense experts stay on the block kernels rather than the streaming ones)
    direct = kernels.fused_moe_triton(x, w1, w2, w3, weights, ids, False, 1.0, None, tiles=tiles if not mxfp4 else None)
    assert torch.equal(direct, aligned)


def _one_token_want(x, w1, w2, w3, weights, ids, act, beta, linear_beta):
    """One token's experts from the math in float64, rounded where the kernels round (each product, the
    activation's output h, each expert's output), and the bound a correct kernel meets: one ulp of the
    output, plus one ulp of every rounded intermediate moved to its other neighbour (fp32 sums)."""
    ulp = 2 ** -8 if x.dtype == BF16 else 2 ** -11
    want, scale = torch.zeros(x.shape[-1], dtype=torch.float64), torch.zeros(x.shape[-1], dtype=torch.float64)
    xd = x[0].double()
    for j, e in enumerate(ids[0].tolist()):
        gate, up = ((w[e].double() @ xd).to(x.dtype).double() for w in (w1, w3))
        if act == "silu":
            h = gate * torch.sigmoid(gate) * up
        else:
            up_c = up if linear_beta is None else linear_beta * torch.tanh(up / linear_beta)
            h = beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * up_c
        h_abs = (h.abs() + ulp * (gate.abs() + 1) * (up.abs() + 1))          # h within a flip of gate / up
        h = h.to(x.dtype).double()
        y = (w2[e].double() @ h).to(x.dtype).double()
        w = float(weights[0, j])
        want += w * y
        scale += abs(w) * (w2[e].double().abs() @ (h_abs * (1 + ulp)) * (1 + ulp) + y.abs() * ulp)
    return want, 2 * ulp * (want.abs() + scale)


@pytest.mark.parametrize("down", ["default", "loops"])
@pytest.mark.parametrize("act", ["silu", "situ"])
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("L,I,k,halves", [(64, 96, 5, True), (200, 24, 3, False), (512, 64, 8, True)],
                         ids=["ragged_w13", "tails", "even_w13"])
def test_one_token_experts_match_float64(L, I, k, halves, dtype, act, down):
    """One token's experts on the streaming kernels (gate/up with the activation, then each program's
    columns of the k down-projections combined with the fp32 routing weights) against the math in float64;
    w1 / w3 as the halves of one [E, 2I, L] tensor (the model's ``Experts.w13``) or apart; widths across
    and at the kernels' blocks; an expert chosen twice counts twice; the down-and-combine launch unrolled (the
    default) or looping."""
    from kimik3.ops.triton import moe as kernels
    from kimik3.ops.triton.gemv import GemvConfig, one_token_experts
    g = gen(L + I + k)
    E = 9
    if halves:
        both = (torch.randn(E, 2 * I, L, generator=g) * L ** -0.5).to(dtype)
        w1, w3 = both[:, :I], both[:, I:]
    else:
        w1, w3 = ((torch.randn(E, I, L, generator=g) * L ** -0.5).to(dtype) for _ in range(2))
    w2 = (torch.randn(E, L, I, generator=g) * I ** -0.5).to(dtype)
    x = torch.randn(1, L, generator=g).to(dtype)
    ids = torch.randperm(E, generator=g)[:k].view(1, k)
    ids[0, -1] = ids[0, 0]                                                     # one expert twice
    weights = torch.rand(1, k, generator=g) * 2.446 / k
    beta, linear_beta = (4.0, 25.0) if act == "situ" else (1.0, None)
    if down == "loops":
        cfgs = (GemvConfig(bn=4, bk=64), GemvConfig(bn=8, bk=32))
        out = one_token_experts(x, w1, w2, w3, weights, ids, act == "situ", beta, linear_beta, configs=cfgs)
    else:
        out = kernels.fused_moe_triton(x, w1, w2, w3, weights, ids, act == "situ", beta, linear_beta)
    want, bound = _one_token_want(x, w1, w2, w3, weights, ids, act, beta, linear_beta)
    assert out.shape == (1, L) and out.dtype == dtype
    assert ((out[0].double() - want).abs() <= bound).all()


def test_one_token_experts_refuse_mismatched_operands():
    from kimik3.ops.triton.gemv import one_token_experts
    w = torch.zeros(4, 16, 32, dtype=BF16)
    w2 = torch.zeros(4, 32, 16, dtype=BF16)
    x, weights, ids = torch.zeros(1, 32, dtype=BF16), torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="one token"):
        one_token_experts(torch.zeros(2, 32, dtype=BF16), w, w2, w, torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long),
                          False, 1.0, None)
    with pytest.raises(ValueError, match="do not match"):
        one_token_experts(x, w, w2.transpose(1, 2), w, weights, ids, False, 1.0, None)
    with pytest.raises(ValueError, match="do not match"):
        one_token_experts(x, w, w2.half(), w, weights, ids, False, 1.0, None)


@pytest.mark.parametrize("kernel", [True, False], ids=["one_program", "torch_ops"])
@pytest.mark.parametrize("T,E,k,BM", [(1, 64, 16, 16), (40, 6, 3, 16), (9, 8, 8, 4), (33, 5, 2, 8)])
def test_sort_by_expert_layout(T, E, k, BM, kernel, monkeypatch, kernel_options):
    """Every assignment once, inside a block of its own expert, in row order; each expert gets
    ceil(count / BM) blocks; -1 only for the blocks past the end."""
    from kimik3.ops.triton import moe as moe_kernels
    if not kernel:
        kernel_options(align_kernel_max_rows=-1)
    g = gen(7)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    rows, block_expert = moe_kernels._sort_by_expert(ids, E, BM)
    flat, R = ids.reshape(-1).tolist(), T * k
    rows, block_expert = rows.tolist(), block_expert.tolist()
    placed = [r for r in rows if r != R]
    assert sorted(placed) == list(range(R)) and len(rows) % BM == 0
    for p, r in enumerate(rows):
        if r != R:
            assert block_expert[p // BM] == flat[r]
    counts = [flat.count(e) for e in range(E)]
    used = [b for b in block_expert if b != -1]
    assert used == sorted(used) and all(used.count(e) == -(-counts[e] // BM) for e in range(E))
    assert block_expert[len(used):] == [-1] * (len(block_expert) - len(used))
    for e in range(E):
        mine = [r for r in rows if r != R and flat[r] == e]
        assert mine == sorted(mine)


@pytest.mark.parametrize("high", [False, True], ids=["scales_to_128", "high_scales"])
def test_dequantize_mxfp4_kernel_is_exact(high):
    """The prefill path's dequantization kernel against ``mxfp4.dequantize`` (the format's definition),
    bit for bit, into a strided output (the second half of a [E, 2N, K] scratch, as gate | up fills it)
    poisoned first; rows and bytes past whole tiles; scale codes up to 140 with ``high``."""
    from kimik3.ops.triton.moe import dequantize_mxfp4
    g = gen(31 + high)
    E, N, K = 3, 37, 160
    codes = torch.randint(0, 16, (E * N, K), generator=g, dtype=torch.uint8)
    top = 140 if high else 128
    scale = torch.randint(100, top + 1, (E * N, K // 32), generator=g).to(torch.uint8)
    packed = mxfp4.pack_codes(codes)
    want = mxfp4.dequantize(packed, scale, torch.float64).view(E, N, K)
    out = torch.full((E, 2 * N, K), float("nan"), dtype=BF16)
    dequantize_mxfp4(packed.view(E, N, K // 2), scale.view(E, N, K // 32), out[:, N:], high_scales=high)
    assert torch.equal(out[:, N:].double(), want)
    assert out[:, :N].isnan().all()


@pytest.mark.parametrize("act", ["silu", "situ"])
def test_moe_mxfp4_grouped_mm_path_matches_float64(act, monkeypatch, kernel_options):
    """At ``KernelTuning.mxfp4_grouped_mm_rows_per_expert`` rows per expert and more (prefill), MXFP4 experts are dequantized
    a chunk of experts at a time and run through torch._grouped_mm (the CPU build runs it): against the
    float64 math on the dequantized weights, per token, with chunks of 5 experts (so the last is
    partial) on a ragged routing (expert 0 in every token, expert 1 in one, four experts with none:
    a chunk with no rows is skipped); the fused tile kernels are not called."""
    from kimik3.ops.triton import moe as kernels
    monkeypatch.setattr(kernels, "_gate_up_kernel", None)                # the tiles must not run
    kernel_options(mxfp4_grouped_mm_rows_per_expert=4)
    E, L, I, k = 24, 64, 32, 4
    kernel_options(mxfp4_dequant_chunk_bytes=5 * 2 * I * L * 2)
    g = gen(41)
    w13, d13 = _packed_experts(E, 2 * I, L, g)
    w2, d2 = _packed_experts(E, L, I, g)
    halves = [(w13[0][:, :I], w13[1][:, :I]), (w13[0][:, I:], w13[1][:, I:])]
    T = 4 * E // k + 7
    x = torch.randn(T, L, generator=g).to(BF16)
    ids = ragged_ids(T, E, k, g)
    ids[:, -1] = torch.where(ids[:, -1] >= E - 10, ids[:, -1] - 6, ids[:, -1])   # experts 14..19 unused too
    weights = torch.rand(T, k, generator=g) * 2.4
    situ = act == "situ"
    out = kernels.fused_moe_triton(x, halves[0], w2, halves[1], weights, ids, situ, 4.0, 25.0 if situ else None)
    f64 = situ64 if situ else (lambda a, b: torch.nn.functional.silu(a) * b)
    ref = moe_float64(x, d13[:, :I], d2, d13[:, I:], weights, ids, f64)
    assert out.dtype == BF16 and out.shape == (T, L)
    for t in range(T):
        assert rel_err(out[t], ref[t]) < 2e-2, t


def test_moe_mxfp4_kernel_silu_without_up_clip():
    from kimik3.ops.triton.moe import fused_moe_triton
    # one expert, one-hot tokens: each output sums silu over one column of W1 (W3, W2 all ones)
    g = gen(3)
    E, L, I = 1, 32, 32
    w1, d1 = _packed_experts(E, I, L, g)
    ones = torch.full((E, I, L // 2), 0x22, dtype=torch.uint8), torch.full((E, I, L // 32), 127, dtype=torch.uint8)
    dense_ones = torch.ones(E, I, L)
    x = torch.eye(L)[:8].to(BF16)
    ids = torch.zeros(8, 1, dtype=torch.long)
    w = torch.ones(8, 1)
    # silu(g) * u with u = 1 and W2 = ones: out = sum_i silu(W1[i, t])
    out = fused_moe_triton(x, w1, ones, ones, w, ids, False, 1.0, None)
    ref = fused_moe(x, d1, dense_ones.to(BF16), dense_ones.to(BF16), w, ids, "silu", 1.0, None, True)
    assert rel_err(out, ref) < 1e-2


def test_moe_wgmma_tiles_for_experts_the_kernels_cannot_take_are_an_error():
    """Asking for the register-operand kernels (``moe_wgmma``: tiles with BT) where they cannot run (here: no
    sm_90 GPU; likewise widths that are not whole macro steps) names the tiles instead of running others."""
    from kimik3.ops.triton.moe import fused_moe_triton
    g = gen(4)
    w1, _ = _packed_experts(2, 256, 256, g)
    w2, _ = _packed_experts(2, 256, 256, g)
    x = torch.randn(3, 256, generator=g).to(BF16)
    ids = torch.zeros(3, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="wgmma expert kernels cannot take these experts.*'BT': 16"):
        fused_moe_triton(x, w1, w2, w1, torch.ones(3, 1), ids, True, 4.0, 25.0, tiles=dict(BT=16, warps=4))


def test_moe_wgmma_activations_in_slot_order():
    """``moe_wgmma.slot_ordered`` puts each row's natural K position k = 32 q + 2 j + n (of every 128) at the
    fragment slot s = j0 + 2 q + 8 n + 16 j1 + 32 j2 + 64 j3 (j = j0 + 2 j1 + 4 j2 + 8 j3): the order the
    expanded weights take, so the product over K is unchanged (the GPU tests check the products)."""
    from kimik3.ops.triton.moe_wgmma import slot_ordered
    x = torch.arange(3 * 256).view(3, 256)
    out = slot_ordered(x)
    for k in range(256):
        q, j, n = (k % 128) // 32, (k % 32) // 2, k % 2
        s = (j & 1) + 2 * q + 8 * n + 16 * ((j >> 1) & 1) + 32 * ((j >> 2) & 1) + 64 * (j >> 3) + 128 * (k // 128)
        assert torch.equal(out[:, s], x[:, k]), k


# ---- MoE, dense bf16 / fp16 experts -------------------------------------------------------
def moe_float64(x, w1, w2, w3, weights, ids, act):
    """Straight from the math in float64: out_t = sum_j w_tj * (act(x W1_e^T, x W3_e^T) W2_e^T)."""
    x, w1, w2, w3, weights = (t.double() for t in (x, w1, w2, w3, weights))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = x[t] @ w1[e].t(), x[t] @ w3[e].t()
            out[t] += weights[t, j] * (act(g, u) @ w2[e].t())
    return out


def ragged_ids(T, E, k, g):
    """Distinct experts per token: expert 0 gets every token, expert 1 exactly one (token T // 2),
    the last four none, the rest at random from 2 .. E - 5."""
    ids = torch.empty(T, k, dtype=torch.long)
    for t in range(T):
        first = [0, 1] if (t == T // 2 and k > 1) else [0]
        rest = (torch.randperm(E - 6, generator=g) + 2)[:k - len(first)]
        ids[t] = torch.cat([torch.tensor(first), rest])
    return ids


def situ64(g, u, beta=4.0, linear_beta=25.0):
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))


def check_dense_experts(dtype, act, T, k, seed, E=24, L=64, I=32):
    """fused_moe_triton on a ragged routing (expert 0 in every token, expert 1 in one, four experts with
    none) against float64, per token: a bad row cannot hide in a global norm."""
    from kimik3.ops.triton.moe import fused_moe_triton
    g = gen(seed)
    w1, w3 = (torch.randn(E, I, L, generator=g) / L ** 0.5 for _ in range(2))
    w2 = torch.randn(E, L, I, generator=g) / I ** 0.5
    x = torch.randn(T, L, generator=g)
    ids = ragged_ids(T, E, k, g)
    weights = torch.rand(T, k, generator=g) * 2.4
    lo = [t.to(dtype) for t in (x, w1, w2, w3)]
    out = fused_moe_triton(lo[0], lo[1], lo[2], lo[3], weights, ids, act == "situ", 4.0, 25.0 if act == "situ" else None)
    f64 = situ64 if act == "situ" else (lambda a, b: torch.nn.functional.silu(a) * b)
    ref = moe_float64(*(t.double() for t in lo), weights, ids, f64)
    assert out.dtype == dtype and out.shape == (T, L)
    for t in range(T):
        assert rel_err(out[t], ref[t]) < 2e-2, t


@pytest.mark.parametrize("act", ["silu", "situ"])
def test_moe_dense_grouped_mm_path_matches_float64(act, monkeypatch):
    """At ``KernelTuning.grouped_mm_rows_per_expert`` rows per expert and more, dense bf16 experts take torch._grouped_mm
    (the CPU build runs it too) between our sort, gating and combine; the tile kernels are not called."""
    from kimik3.ops.triton import moe as kernels
    monkeypatch.setattr(kernels, "_gate_up_kernel", None)                # the tiles must not run
    check_dense_experts(BF16, act, KernelTuning().grouped_mm_rows_per_expert * 24 // 8 + 3, 8, seed=12)


@pytest.mark.parametrize("merged", [False, True], ids=["separate", "w13_halves"])
def test_moe_dense_grouped_mm_runs_gate_and_up_as_one_gemm_for_halves_of_one_weight(merged, monkeypatch):
    """w1 and w3 as the halves of one [E, 2I, L] tensor (``Experts.w13``): one grouped GEMM for both
    (two in all, with the down projection), against float64; separate tensors take one GEMM each."""
    from kimik3.ops.triton import moe as kernels
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    g = gen(21)
    E, L, I, T, k = 24, 64, 32, KernelTuning().grouped_mm_rows_per_expert * 3 + 5, 8
    w13 = torch.randn(E, 2 * I, L, generator=g) / L ** 0.5
    w2 = torch.randn(E, L, I, generator=g) / I ** 0.5
    x = torch.randn(T, L, generator=g)
    ids = ragged_ids(T, E, k, g)
    weights = torch.rand(T, k, generator=g)
    lo = [t.to(BF16) for t in (x, w13, w2)]
    b1, b3 = (lo[1][:, :I], lo[1][:, I:]) if merged else (lo[1][:, :I].clone(), lo[1][:, I:].clone())
    out = kernels.fused_moe_triton(lo[0], b1, lo[2], b3, weights, ids, False, 1.0, None)
    ref = moe_float64(lo[0], b1, lo[2], b3, weights, ids, lambda a, b: torch.nn.functional.silu(a) * b)
    assert len(calls) == (2 if merged else 3)
    for t in range(T):
        assert rel_err(out[t], ref[t]) < 2e-2, t


@pytest.mark.parametrize("dtype,act,T,k", [(BF16, "silu", 5, 4), (torch.float16, "silu", 3, 16), (BF16, "situ", 9, 2),
                                           (BF16, "silu", 1, 8)], ids=["bf16-silu", "fp16-top16", "bf16-situ", "decode"])
def test_moe_dense_kernel_matches_float64(dtype, act, T, k):
    check_dense_experts(dtype, act, T, k, seed=11)


# ---- attention residual mix --------------------------------------------------------------
@pytest.mark.parametrize("wdtype", [torch.float32, BF16], ids=["fp32_weights", "bf16_weights"])
@pytest.mark.parametrize("n", [2, 5, 9])
def test_attn_res_kernel_matches_reference(n, wdtype):
    """The mix against the float64 reference, with the norm and projection weights as stored (the
    checkpoint's bf16: the kernel folds gamma * proj in fp32 itself)."""
    from kimik3.ops.triton.attn_res import attn_res_mix_triton
    g = gen(4)
    T, D = 6, 48
    sources = [torch.randn(T, D, generator=g).to(BF16) for _ in range(n)]
    gamma, proj = (1 + 0.1 * torch.randn(D, generator=g)).to(wdtype), torch.randn(1, D, generator=g).to(wdtype)
    ref = attn_res_mix([s.double() for s in sources], gamma.double(), proj.double(), 1e-5)
    out = attn_res_mix_triton(sources, gamma, proj, 1e-5)
    assert rel_err(out, ref) < 1e-5


def _mix_norm_float64(sources, gamma, proj, eps, consumer, fp32_weight):
    """The sub-layer input from the math in float64: alpha = softmax_i(w . v_i / rms(v_i)), w = gamma * proj,
    mix = sum_i alpha_i v_i, then mix / rms(mix) * consumer (the official form rounds the mix to bf16 first)."""
    v = torch.stack([s.double() for s in sources])
    w = gamma.double() * proj.double().view(-1)
    score = (v @ w) / v.pow(2).mean(-1).add(eps).sqrt()
    mix = (torch.softmax(score, 0).unsqueeze(-1) * v).sum(0)
    if not fp32_weight:
        mix = mix.to(BF16).double()
    return mix / mix.pow(2).mean(-1, keepdim=True).add(eps).sqrt() * consumer.double()


@pytest.mark.parametrize("fp32_weight", [True, False], ids=["vllm_fused", "official"])
@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_attn_res_mix_norm_kernel_path_matches_float64(n, fp32_weight, monkeypatch, kernel_options):
    """The sub-layer input in one kernel (the norm in the mix's epilogue) on CPU tensors, against the math;
    one source takes the plain norm; the kernel must be the one that ran."""
    from kimik3.ops import attn_res
    from kimik3.ops.triton import attn_res as kernel
    kernel_options(cpu_kernels=True)                                     # the kernels on CPU tensors
    calls = []
    real = kernel.attn_res_mix_triton
    monkeypatch.setattr(kernel, "attn_res_mix_triton", lambda *a, **k: calls.append(a[4]) or real(*a, **k))
    g = gen(5 + n)
    T, D = 7, 96
    sources = [torch.randn(T, D, generator=g).to(BF16) for _ in range(n)]
    gamma, proj = 1 + 0.1 * torch.randn(D, generator=g), torch.randn(1, D, generator=g)
    consumer = 1 + 0.2 * torch.randn(D, generator=g)
    out = attn_res.attn_res_mix_norm(sources, gamma, proj, 1e-5, consumer, fp32_weight, BF16)
    ref = _mix_norm_float64(sources, gamma, proj, 1e-5, consumer, fp32_weight)
    assert out.dtype == BF16 and rel_err(out, ref) < 1e-2
    assert calls == ([] if n == 1 else [kernel.FP32_WEIGHT_NORM if fp32_weight else kernel.KIMI_NORM])


# ---- RMSNorm -----------------------------------------------------------------------------
@pytest.mark.parametrize("rows,D", [(1, 2304), (3, 7168), (37, 128), (70, 48), (5, 512)])
@pytest.mark.parametrize("form", ["kimi", "fp32_weight", "gated"])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_rms_norm_kernel_matches_float64(rows, D, form, dtype):
    """x * rsqrt(mean(x^2) + eps) * w [* sigmoid(gate)] from the math in float64, per element within
    the form's roundings (three for Kimi's bf16 form, one otherwise; the interpreter truncates); row
    counts below, at and across the kernel's row block, widths that are not powers of two, a row
    read with a stride (MLA's latent slice), and a zero row (eps alone)."""
    from kimik3.ops.triton.norm import FP32_WEIGHT, GATED, KIMI, rms_norm_triton
    g = gen(rows * D)
    wide = (torch.randn(rows, D + 64, generator=g) * 3).to(dtype)
    x = wide[:, :D]                                      # row stride D + 64
    x[0] = 0 if rows > 1 else x[0]
    w = 1 + 0.3 * torch.randn(D, generator=g)
    gate = torch.randn(rows, D, generator=g).to(dtype)
    eps = 1e-5
    x64 = x.double()
    want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    if form == "kimi":
        want = want * w.to(dtype).double()
    else:
        want = want * w.double()
    if form == "gated":
        want = want * torch.sigmoid(gate.double())
    code = {"kimi": KIMI, "fp32_weight": FP32_WEIGHT, "gated": GATED}[form]
    out_dtype = dtype if form == "kimi" else BF16
    got = rms_norm_triton(x, w, eps, code, out_dtype, gate if form == "gated" else None)
    assert got.shape == x.shape and got.dtype == out_dtype
    roundings = 3 if form == "kimi" and dtype == BF16 else 1   # Kimi's: the row, the weight, the product
    ulp = 2 ** -7 if out_dtype == BF16 else 2 ** -22      # truncation: up to one whole ulp per rounding
    bound = roundings * ulp * want.abs() + 1e-30
    assert ((got.double() - want).abs() <= bound).all(), ((got.double() - want).abs() - bound).max()
    if rows > 1:
        assert torch.equal(got[0], torch.zeros(D, dtype=out_dtype))


@pytest.mark.parametrize("rows,D", [(1, 2304), (37, 128), (70, 48)])
def test_rms_norm_kernel_residual_add_and_rounded_input(rows, D):
    """The residual stream's add fused into Kimi's norm: s = x + r rounded once to bf16 (equal to
    torch's bf16 add), y the norm of that s from the math in float64 within Kimi's three roundings;
    and an fp32 row normed as its bf16 rounding (the AttnRes mix), which must equal the norm of the
    pre-rounded row bit for bit. Both read with row strides."""
    from kimik3.ops.triton.norm import KIMI, rms_norm_triton
    g = gen(rows + D)
    x = (torch.randn(rows, D + 8, generator=g) * 3).to(BF16)[:, :D]
    r = (torch.randn(rows, D + 16, generator=g) * 3).to(BF16)[:, 8:D + 8]
    w = 1 + 0.3 * torch.randn(D, generator=g)
    s, y = rms_norm_triton(x, w, 1e-5, KIMI, BF16, residual=r)
    s64 = (x.double() + r.double()).to(BF16).double()                     # one rounding of the exact sum
    assert s.dtype == BF16 and ((s.double() - s64).abs() <= 2 ** -7 * s64.abs()).all()   # interpreter truncates
    want = s.double() * torch.rsqrt(s.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.to(BF16).double()
    assert ((y.double() - want).abs() <= 3 * 2 ** -7 * want.abs() + 1e-30).all()
    assert torch.equal(y, rms_norm_triton(s, w, 1e-5, KIMI, BF16))      # the norm of the stored (rounded) sum
    base = (torch.randn(rows, D + 4, generator=g) * 2).to(BF16)[:, :D]
    mix = base.float()
    mix[:, ::2] *= 1 + 2 ** -10            # fp32 values a quarter ulp past bf16 ones: both roundings give base
    assert torch.equal(rms_norm_triton(mix, w, 1e-5, KIMI, BF16), rms_norm_triton(base, w, 1e-5, KIMI, BF16))


@pytest.mark.parametrize("rows,D", [(1, 2304), (37, 128)])
def test_rms_norm_kernel_adds_two_residuals(rows, D):
    """s = x + (r1 + r2) (a MoE layer's routed and shared outputs into the stream): each sum rounded to bf16,
    against float64 within a bf16 step of the inner sum and of s (the interpreter truncates); the norm is of
    the stored s; the CPU op (``add_rms_norm``) gives torch's roundings of the same order of sums."""
    from kimik3.ops.norm import add_rms_norm
    from kimik3.ops.triton.norm import KIMI, rms_norm_triton
    g = gen(rows * D)
    x, r1, r2 = ((torch.randn(rows, D, generator=g) * 3).to(BF16) for _ in range(3))
    w = 1 + 0.3 * torch.randn(D, generator=g)
    s, y = rms_norm_triton(x, w, 1e-5, KIMI, BF16, residual=r1, residual2=r2)
    inner = r1.double() + r2.double()
    s64 = x.double() + inner
    assert ((s.double() - s64).abs() <= 2 ** -7 * (s64.abs() + inner.abs()) + 2 ** -7 * s.double().abs()).all()
    assert torch.equal(y, rms_norm_triton(s, w, 1e-5, KIMI, BF16))      # the norm of the stored (rounded) sum
    s_cpu, y_cpu = add_rms_norm(x, r1, w.to(BF16), 1e-5, residual2=r2)
    assert torch.equal(s_cpu, x + (r1 + r2))
    with pytest.raises(ValueError, match="residual2 needs residual"):
        rms_norm_triton(x, w, 1e-5, KIMI, BF16, residual2=r2)


def test_rms_norm_ops_take_the_kernel_on_the_fast_path(monkeypatch, kernel_options):
    """rms_norm / rms_norm_fp32_weight / gated_rms_norm route CUDA-class tensors to the kernel (the
    dispatch is checked here by pretending the fast path is on; float64 stays on the reference)."""
    from kimik3.ops import norm
    from kimik3.ops.triton import norm as kernel
    calls = []
    real = kernel.rms_norm_triton
    kernel_options(cpu_kernels=True)                                     # the kernels on CPU tensors
    monkeypatch.setattr(kernel, "rms_norm_triton", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    g = gen(11)                          # seeded: the global RNG's state depends on which tests ran before
    x, w, gate = (torch.randn(4, 64, generator=g).to(BF16), torch.randn(64, generator=g),
                  torch.randn(4, 64, generator=g).to(BF16))
    ref = [norm.rms_norm(x.double(), w.double(), 1e-6), norm.rms_norm_fp32_weight(x.double(), w.double(), 1e-6, torch.float64),
           norm.gated_rms_norm(x.double(), w.double(), gate.double(), 1e-6, torch.float64),
           norm.add_rms_norm(x.double(), gate.double(), w.double(), 1e-6)[1]]
    assert calls == []
    got = [norm.rms_norm(x, w, 1e-6), norm.rms_norm_fp32_weight(x, w, 1e-6, BF16), norm.gated_rms_norm(x, w, gate, 1e-6, BF16),
           norm.add_rms_norm(x, gate, w, 1e-6)[1]]
    assert calls == [kernel.KIMI, kernel.FP32_WEIGHT, kernel.GATED, kernel.KIMI]
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 2e-2       # up to two bf16 roundings, which the interpreter truncates


# ---- GLU gating --------------------------------------------------------------------------
@pytest.mark.parametrize("act", ["silu", "situ", "situ_unclipped"])
@pytest.mark.parametrize("rows,I", [(1, 1024), (9, 3072), (70, 48)])
def test_glu_kernel_matches_float64(act, rows, I):
    """act(g) * u from the math in float64 (SiLU: g sigmoid(g); SITU: beta tanh(g / beta) sigmoid(g)
    times linear_beta tanh(u / linear_beta), or u unclipped), one bf16 rounding apart; gate and up
    read as the two halves of one merged projection's rows (row stride 2 I)."""
    from kimik3.ops.triton.activation import glu_triton
    g = gen(rows + I)
    merged = (torch.randn(rows, 2 * I, generator=g) * 4).to(BF16)
    gate, up = merged.chunk(2, dim=-1)
    beta, lb = 2.0, (None if act == "situ_unclipped" else 3.0)
    g64, u64 = gate.double(), up.double()
    if act == "silu":
        want = g64 * torch.sigmoid(g64) * u64
    else:
        want = beta * torch.tanh(g64 / beta) * torch.sigmoid(g64) * (u64 if lb is None else lb * torch.tanh(u64 / lb))
    got = glu_triton(gate, up, act != "silu", beta, lb)
    assert got.shape == gate.shape and got.dtype == BF16 and got.is_contiguous()
    # one truncating rounding, plus tanh's fp32 form (2 sigmoid(2x) - 1: 1e-7 absolute, near 0)
    assert ((got.double() - want).abs() <= 2 ** -7 * want.abs() + 1e-6).all()


def test_glu_ops_take_the_kernel_on_the_fast_path(monkeypatch, kernel_options):
    from kimik3.ops import activation
    from kimik3.ops.triton import activation as kernel
    calls = []
    real = kernel.glu_triton
    kernel_options(cpu_kernels=True)                                     # the kernels on CPU tensors
    monkeypatch.setattr(kernel, "glu_triton", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    gate, up = torch.randn(3, 40).to(BF16), torch.randn(3, 40).to(BF16)
    ref = activation.situ_and_mul(gate.double(), up.double(), 2.0, 3.0)
    assert calls == []
    got = [activation.silu_and_mul(gate, up), activation.situ_and_mul(gate, up, 2.0, 3.0)]
    assert calls == [False, True]
    assert rel_err(got[1], ref) < 1e-2


def test_elementwise_kernels_refuse_mismatched_operands():
    """The norm, gating and conv wrappers name what does not fit instead of reading out of bounds."""
    from kimik3.ops.triton.activation import glu_triton
    from kimik3.ops.triton.conv import causal_conv1d_pool_triton
    from kimik3.ops.triton.norm import KIMI, rms_norm_triton
    with pytest.raises(ValueError, match=r"weight shape \(63,\) does not match rows of 64"):
        rms_norm_triton(torch.randn(2, 64), torch.ones(63), 1e-6, KIMI, torch.float32)
    with pytest.raises(ValueError, match=r"gate \(2, 8\) and up \(2, 9\) differ"):
        glu_triton(torch.randn(2, 8), torch.randn(2, 9), False)
    with pytest.raises(ValueError, match="10 channels do not split into 3 groups"):
        causal_conv1d_pool_triton(torch.randn(4, 10), torch.randn(10, 4), torch.zeros(2, 10, 3), torch.tensor([1]),
                                  torch.tensor([False]), torch.tensor([0, 4]), 3)


def test_decode_kernels_refuse_operands_that_do_not_fit():
    """The KDA step and the fused residual norm name what does not fit instead of reading out of bounds."""
    from kimik3.ops.triton.kda import kda_decode_triton
    from kimik3.ops.triton.norm import KIMI, rms_norm_triton
    N, H, K = 2, 2, 16
    q, k, v, f = (torch.randn(N, H, K).to(BF16) for _ in range(4))
    b, A_log, dt_bias = torch.randn(N, H).to(BF16), torch.zeros(H), torch.zeros(H * K)
    slots = torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"state pool must be fp32 \[slots, 2, 16, 16\]"):
        kda_decode_triton(q, k, v, f, b, A_log, dt_bias, None, torch.zeros(3, H, K, K, dtype=BF16), slots)
    with pytest.raises(ValueError, match=r"state pool must be fp32 \[slots, 2, 16, 16\]"):
        kda_decode_triton(q, k, v, f, b, A_log, dt_bias, None, torch.zeros(3, H, K, 2 * K), slots)
    with pytest.raises(ValueError, match="K=16, V=16 need K a power of two and V a multiple of the power-of-two block 12"):
        kda_decode_triton(q, k, v, f, b, A_log, dt_bias, None, torch.zeros(3, H, K, K), slots, block_v=12)
    with pytest.raises(ValueError, match=r"normed output's dtype must be v's \(torch.bfloat16\) or float32, got torch.float16"):
        kda_decode_triton(q, k, v, f, b, A_log, dt_bias, None, torch.zeros(3, H, K, K), slots,
                          norm=(torch.ones(K), torch.randn(N, H, K).to(BF16), 1e-5, torch.float16))
    with pytest.raises(ValueError, match="k needs each row's heads packed"):
        kda_decode_triton(q, torch.randn(N, K, H).to(BF16).transpose(1, 2), v, f, b, A_log, dt_bias, None,
                          torch.zeros(3, H, K, K), slots)
    with pytest.raises(ValueError, match=r"output norm needs weight \[16\] and gate \[2, 2, 16\]"):
        kda_decode_triton(q, k, v, f, b, A_log, dt_bias, None, torch.zeros(3, H, K, K), slots,
                          norm=(torch.ones(K), torch.zeros(N, K, H).transpose(1, 2), 1e-5, BF16))
    with pytest.raises(ValueError, match=r"low-rank f needs a \[2, R\] .* w \[32, R\] of torch.bfloat16, R a power of two"):
        kda_decode_triton(q, k, v, (torch.randn(N, 24).to(BF16), torch.randn(H * K, 24).to(BF16)), b, A_log, dt_bias,
                          None, torch.zeros(3, H, K, K), slots)
    with pytest.raises(ValueError, match=r"low-rank gate needs .* got a torch.float32"):
        kda_decode_triton(q, k, v, f, b, A_log, dt_bias, None, torch.zeros(3, H, K, K), slots,
                          norm=(torch.ones(K), (torch.randn(N, 16), torch.randn(H * K, 16).to(BF16)), 1e-5, BF16))
    with pytest.raises(ValueError, match=r"residual torch.float32 \(2, 8\) does not match x torch.bfloat16 \(2, 8\)"):
        rms_norm_triton(torch.randn(2, 8).to(BF16), torch.ones(8), 1e-6, KIMI, BF16, residual=torch.randn(2, 8))


# ---- programmatic dependent launch --------------------------------------------------------
def test_pdl_launch_options(monkeypatch, kernel_options):
    """PDL only for CUDA tensors on a capable device, outside the interpreter, unless ``KernelOptions.pdl``
    turned it off; the kernels then get PDL=True and the launch option, else PDL=False alone."""
    from kimik3.ops.options import KernelOptions
    from kimik3.ops.triton import common

    class FakeCuda:
        is_cuda = True
        device = torch.device("cuda", 0)

    assert common.pdl(torch.zeros(1)) == {"PDL": False}
    monkeypatch.setattr(common, "INTERPRETING", False)
    monkeypatch.setattr(common, "_pdl_capable", lambda index: index == 0)
    assert common.pdl(FakeCuda()) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(common, "_pdl_capable", lambda index: False)          # pre-Hopper, or not NVIDIA
    assert common.pdl(FakeCuda()) == {"PDL": False}
    monkeypatch.setattr(common, "_pdl_capable", lambda index: True)
    kernel_options(KernelOptions(pdl=False))
    assert common.pdl(FakeCuda()) == {"PDL": False}
    kernel_options(KernelOptions(pdl=True))
    assert common.pdl(FakeCuda()) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(common, "INTERPRETING", True)
    assert common.pdl(FakeCuda()) == {"PDL": False}


def test_kernel_wrappers_refuse_mismatched_operands():
    """The new entry points name what does not fit instead of reading out of bounds."""
    from kimik3.ops.triton.attn_res import attn_res_mix_triton
    from kimik3.ops.triton.moe import dequantize_mxfp4
    packed, scale = torch.zeros(2, 8, 32, dtype=torch.uint8), torch.zeros(2, 8, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"dequantize_mxfp4: packed \(2, 8, 32\), scale \(2, 8, 2\) and out"):
        dequantize_mxfp4(packed, scale, torch.empty(2, 8, 32, dtype=BF16))              # K is 64, not 32
    with pytest.raises(ValueError, match="unit stride on the inner axis"):
        dequantize_mxfp4(packed, scale, torch.empty(2, 64, 8, dtype=BF16).transpose(1, 2))
    sources = [torch.randn(3, 16).to(BF16) for _ in range(2)]
    with pytest.raises(ValueError, match=r"norm weight \(16,\) and proj weight \(1, 8\) do not hold 16 values each"):
        attn_res_mix_triton(sources, torch.ones(16), torch.ones(1, 8), 1e-5)


# ---- decode-sized projections (gemv) -----------------------------------------------------------
@pytest.mark.parametrize("M,N,K,cfg", [(1, 40, 96, None), (3, 33, 200, None), (4, 64, 512, (4, 64)),
                                       (8, 16, 64, None), (2, 7, 1000, (16, 128))],
                         ids=["one_row", "ragged", "even", "eight_rows", "tail_columns"])
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_gemv_kernel_matches_float64(M, N, K, cfg, dtype):
    """x @ w^T from the math in float64, within one rounding of the output plus the fp32 sums' error;
    rows, columns and K below, at and across the kernel's blocks (masked tails and the even path)."""
    from kimik3.ops.triton.gemv import GemvConfig, gemv
    g = gen(M * 1000 + N + K)
    x = torch.randn(2, M, K, generator=g).to(dtype)[1]             # a view: rows at an offset
    w = torch.randn(N, K, generator=g).to(dtype)
    y = gemv(x, w, GemvConfig(*cfg) if cfg else None)
    want = x.double() @ w.double().t()
    scale = x.double().abs() @ w.double().abs().t()
    assert y.shape == (M, N) and y.dtype == dtype
    assert ((y.double() - want).abs() <= 2 ** -7 * want.abs() + K * 2 ** -23 * scale).all()


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_gemv_stores_the_rounded_product_in_float32(dtype):
    """``out_dtype`` float32 (the LM head's logits): the product rounded to x's dtype, then converted (what
    ``linear(x, w).float()`` gives); one launch."""
    from kimik3.ops.triton.gemv import gemv
    g = gen(41)
    x = torch.randn(1, 700, generator=g).to(dtype)
    w = torch.randn(45, 700, generator=g).to(dtype)
    y = gemv(x, w, out_dtype=torch.float32)
    want = (x.double() @ w.double().t())
    scale = x.double().abs() @ w.double().abs().t()
    assert y.dtype == torch.float32 and torch.equal(y, y.to(dtype).float())       # holds a value of x's dtype
    assert ((y.double() - want).abs() <= 2 ** -7 * want.abs() + 700 * 2 ** -23 * scale).all()
    with pytest.raises(ValueError, match="out_dtype"):
        gemv(x, w, out_dtype=torch.float64)


def test_gemv_refuses_mismatched_operands():
    from kimik3.ops.triton.gemv import gemv
    x = torch.zeros(1, 64, dtype=BF16)
    with pytest.raises(ValueError, match="does not match"):
        gemv(x, torch.zeros(8, 32, dtype=BF16))
    with pytest.raises(ValueError, match="does not match"):
        gemv(x, torch.zeros(8, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="bf16 or fp16"):
        gemv(x.float(), torch.zeros(8, 64))
    with pytest.raises(ValueError, match="odd 7 rows"):
        gemv(x, torch.zeros(7, 64, dtype=BF16), glu_act=(False, 1.0, None))


def test_only_the_down_and_combine_launch_unrolls():
    """Unrolled projections and gate/up launches measured slower, so they always loop: a config asking them to
    unroll is refused; the default down-and-combine launch unrolls; one token's gate/up K step divides L where a
    power of two from 64 does (no masked tail step)."""
    from kimik3.ops.triton.gemv import GemvConfig, combine_config, expert_up_config, gemv, one_token_experts
    x = torch.zeros(1, 64, dtype=BF16)
    with pytest.raises(ValueError, match="gemv: unroll applies to the down-and-combine launch only"):
        gemv(x, torch.zeros(8, 64, dtype=BF16), GemvConfig(bn=4, bk=64, unroll=True))
    w = torch.zeros(3, 4, 64, dtype=BF16)
    with pytest.raises(ValueError, match="gate/up: unroll applies to the down-and-combine launch only"):
        one_token_experts(x, w, torch.zeros(3, 64, 4, dtype=BF16), w, torch.ones(1, 2), torch.tensor([[0, 1]]),
                          False, 1.0, None, configs=(GemvConfig(unroll=True), GemvConfig()))
    assert combine_config(2304, 1024).unroll
    # L = 200 has no power-of-two factor from 64: gemv_config's step (256, the next power of two of L)
    assert [expert_up_config(L, 1024, 8).bk for L in (2304, 7168, 4096, 200)] == [256, 512, 512, 256]


@pytest.mark.parametrize("act", ["silu", "situ", "situ_unclipped"])
@pytest.mark.parametrize("M,I,K", [(1, 24, 200), (5, 16, 512)], ids=["one_row_ragged", "five_rows_even"])
def test_gemv_glu_matches_float64(act, M, I, K):
    """The gate/up projection and its activation in one launch: act(round(x W_g^T), round(x W_u^T)) from the
    math in float64 (SiLU, or SITU with and without the up clip), within the output's rounding."""
    from kimik3.ops.triton.gemv import gemv
    g = gen(M * 7 + I + K)
    x = torch.randn(M, K, generator=g).to(BF16)
    w = (torch.randn(2 * I, K, generator=g) * K ** -0.5).to(BF16)
    situ, beta, linear_beta = act.startswith("situ"), 4.0, (None if act == "situ_unclipped" else 2.0)
    y = gemv(x, w, glu_act=(situ, beta, linear_beta))
    gate, up = ((x.double() @ w[rows].double().t()).to(BF16).double() for rows in (slice(0, I), slice(I, 2 * I)))
    if situ:
        gated = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
        want = gated * (up if linear_beta is None else linear_beta * torch.tanh(up / linear_beta))
    else:
        want = gate * torch.sigmoid(gate) * up
    assert y.shape == (M, I) and y.dtype == BF16
    # the products may round to the other bf16 neighbour (fp32 sums): one ulp of gate and up, then the output's
    slack = 2 ** -7 * (gate.abs() + 1) * (up.abs() + 1)
    assert ((y.double() - want).abs() <= 2 ** -7 * want.abs() + slack).all()


def test_linear_ops_reference_path_equals_the_two_launch_form():
    """ops.linear / linear_glu on the CPU: torch's linear, and the activation op on its two halves."""
    from kimik3.ops.activation import glu_activation
    from kimik3.ops.linear import linear, linear_glu
    g = gen(3)
    x = torch.randn(3, 32, generator=g).to(BF16)
    w = torch.randn(20, 32, generator=g).to(BF16)
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))
    gate, up = torch.nn.functional.linear(x, w).chunk(2, dim=-1)
    assert torch.equal(linear_glu(x, w, "situ", 4.0, 25.0), glu_activation("situ", 4.0, 25.0)(gate, up))
