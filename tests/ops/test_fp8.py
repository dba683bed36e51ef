"""FP8 (E4M3) numbers and the FP8 MLA latent cache, on the CPU: round trips against float64 within the
format's bound (``kimik3.ops.fp8``), the MLA references over an FP8 cache against float64 attention over
its dequantised rows, and the Triton kernels (TRITON_INTERPRET=1, small shapes) against the same.

Bound of one E4M3 round trip with scale s = amax / 448: |x - dq(q(x))| <= max(2**-4 |x|, 2**-10 s) (half
the 3-bit ulp of a normal value, half the subnormal step below 2**-6 s). Triton's interpreter converts
float32 to fp8 toward zero (a whole ulp: 2**-3 |x|, 2**-9 s), as it does to bf16 (test_triton_kernels.py).
"""

import pytest
import torch

from kimik3.ops import fp8
from kimik3.ops.mla import cache_latent, mla_decode_attention, mla_prefill_attention
from kimik3.ops.norm import rms_norm
from tests.helpers import rel_err

BF16 = torch.bfloat16


def gen(seed):
    return torch.Generator().manual_seed(seed)


def within_round_trip(got: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, ulps: float = 1.0) -> bool:
    """|got - x| within ``ulps`` halves of the E4M3 rounding bound of each element (float64)."""
    got, x = got.double(), x.double()
    bound = torch.maximum(fp8.ROUNDING_BOUND * x.abs(), fp8.SUBNORMAL_STEP / 2 * scale.double().unsqueeze(-1))
    return bool(((got - x).abs() <= ulps * bound * (1 + 1e-6) + 1e-300).all())


def rows_of_every_magnitude(g) -> torch.Tensor:
    x = torch.randn(6, 96, generator=g, dtype=torch.float64)
    x[1] *= 1e-3                                        # a small row: its own scale
    x[2] *= 300.0                                       # past E4M3's range before scaling
    x[3, :48] *= 1e-5                                   # a row spanning 5 decades: the small half subnormal
    x[4] = 0.0                                          # a zero row
    x[5, 7] = 1e4                                       # one outlier
    return x


def test_row_round_trip_is_within_the_e4m3_bound_of_float64():
    x = rows_of_every_magnitude(gen(0))
    codes, scale = fp8.quantize_rows(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (6,)
    amax = x.abs().amax(-1)
    assert torch.allclose(scale.double(), torch.where(amax > 0, amax / 448, 1.0), rtol=2 ** -23)
    back = fp8.dequantize_rows(codes, scale, torch.float64)
    assert within_round_trip(back, x, scale)
    assert torch.equal(back[4], torch.zeros(96, dtype=torch.float64))
    assert (codes.float().abs().amax(-1)[[0, 1, 2, 3, 5]] == 448).all()          # every row uses the whole range
    # the bound is tight: some element errs by more than half of it (round to nearest, not better)
    rel = ((back - x).abs() / x.abs().clamp_min(1e-30))[0]
    assert rel.max() > fp8.ROUNDING_BOUND / 2


def test_weight_round_trip_blocks_and_channels_within_the_bound():
    g = gen(1)
    w = torch.randn(300, 200, generator=g, dtype=torch.float64)
    w[:128, :128] *= 1e-3                                # a block of small weights keeps its own scale
    w[5] *= 50                                           # a loud output channel
    for block in (128, None):
        codes, scale = fp8.quantize_weight(w, block)
        assert codes.shape == w.shape and codes.dtype == torch.float8_e4m3fn
        assert scale.shape == ((3, 2) if block else (300, 1))
        back = fp8.dequantize_weight(codes, scale, torch.float64)
        per_elem = fp8.expand_weight_scale(scale, 300, 200).double()
        bound = torch.maximum(fp8.ROUNDING_BOUND * w.abs(), fp8.SUBNORMAL_STEP / 2 * per_elem)
        assert ((back - w).abs() <= bound * (1 + 1e-6)).all(), block
    codes, scale = fp8.quantize_weight(w, 128)
    assert scale[0, 0] < 1e-2 * scale[0, 1]                                     # the small block's scale


# ---- the MLA latent cache in FP8 ------------------------------------------------------------
R, P = 32, 16


def _cache(g, blocks=12, bs=4, magnitude=1.0):
    latent = torch.randn(blocks, bs, R + P, generator=g, dtype=torch.float64) * magnitude
    codes, scale = fp8.quantize_rows(latent)
    return codes, scale, fp8.dequantize_rows(codes, scale, torch.float64)


def test_cache_latent_reference_stores_the_normed_row_in_e4m3_with_its_scale():
    """The row [rms_norm(c_kv) | k_pe] in the model dtype, quantised: within one rounding of the float64 row
    of that bf16 row, its scale at the slot; other rows and scales untouched."""
    g = gen(2)
    c = (torch.randn(3, R + P, generator=g) * 4).to(BF16)
    w = (1 + 0.2 * torch.randn(R, generator=g)).to(BF16)
    cache = torch.zeros(2, 4, R + P, dtype=torch.float8_e4m3fn)
    scales = torch.full((2, 4), 7.0)
    slots = torch.tensor([6, 1, 3])
    cache_latent(c, w, 1e-6, cache, slots, scales)
    row = torch.cat([rms_norm(c[:, :R], w, 1e-6), c[:, R:]], dim=-1).double()   # the bf16 row
    got = fp8.dequantize_rows(cache.view(-1, R + P)[slots], scales.view(-1)[slots], torch.float64)
    assert torch.allclose(scales.view(-1)[slots].double(), row.abs().amax(-1) / 448, rtol=2 ** -23)
    assert within_round_trip(got, row, scales.view(-1)[slots])
    others = torch.tensor([0, 2, 4, 5, 7])
    assert (cache.view(-1, R + P)[others].float() == 0).all() and (scales.view(-1)[others] == 7.0).all()


def test_reference_decode_over_an_fp8_cache_is_attention_over_its_dequantised_rows():
    g = gen(3)
    codes, scale, deq = _cache(g)
    tables = torch.tensor([[3, 5, 1, -1], [7, 2, 9, 11]], dtype=torch.int32)
    lens = [9, 16]
    q_lat, q_pe = torch.randn(2, 3, R, generator=g, dtype=torch.float64), torch.randn(2, 3, P, generator=g,
                                                                                       dtype=torch.float64)
    got = mla_decode_attention(q_lat, q_pe, codes, tables, lens, R, 0.3, cache_scale=scale)
    want = mla_decode_attention(q_lat, q_pe, deq, tables, lens, R, 0.3)
    assert rel_err(got, want) < 1e-14


@pytest.mark.parametrize("form", ["naive", "absorbed"])
def test_reference_prefill_over_an_fp8_cache_is_attention_over_its_dequantised_rows(form):
    g = gen(4)
    codes, scale, deq = _cache(g)
    H, d_nope, dv = 2, 8, 8
    kv_b = torch.randn(H * (d_nope + dv), R, generator=g, dtype=torch.float64) * 0.2
    tables = torch.tensor([[3, 5, 1, 4], [7, 2, 9, 11]], dtype=torch.int32)
    q = torch.randn(7, H, d_nope + P, generator=g, dtype=torch.float64)
    args = (tables, kv_b, [3, 4], [6, 9], R, dv, 0.25, form)
    got = mla_prefill_attention(q, codes, *args, cache_scale=scale)
    assert rel_err(got, mla_prefill_attention(q, deq, *args)) < 1e-12


triton = pytest.importorskip("triton")


@pytest.mark.parametrize("form,bn,trans", [("gather", 16, False), ("paged", 16, False), ("gather", 16, True),
                                           ("default", 16, False)])
@pytest.mark.parametrize("lens,bs", [([9, 1, 23], 4), ([40, 17, 3], 16)], ids=["ragged-bs4", "ragged-bs16"])
def test_mla_decode_kernel_reads_fp8_rows_and_scales(form, bn, trans, lens, bs):
    """The Triton decode over an FP8 cache (codes + per-token scales, rows of very different magnitudes)
    against float64 attention over the dequantised rows, at the bf16 tests' bound; the split scratch comes
    NaN-filled (an unwritten split read would show)."""
    from kimik3.ops.triton.mla_decode import DecodeConfig, mla_decode_triton
    if form == "paged" and bs < 16:
        pytest.skip("the paged form takes blocks of 16+")
    g = gen(5)
    N, H = 3, 5
    codes, scale, deq = _cache(g, blocks=14, bs=bs)
    scale = scale * torch.logspace(-1, 1, 14 * bs, dtype=torch.float32)[torch.randperm(14 * bs, generator=g)].view(14, bs)
    deq = fp8.dequantize_rows(codes, scale, torch.float64)
    tables = torch.full((N, 8), -1, dtype=torch.int32)
    perm, used = torch.randperm(13, generator=g) + 1, 0
    for n, L in enumerate(lens):
        nb = -(-L // bs)
        tables[n, :nb] = perm[used:used + nb].int()
        used += nb
    q_lat = torch.randn(N, H, R, generator=g).to(BF16) * 0.3
    q_pe = torch.randn(N, H, P, generator=g).to(BF16) * 0.3
    ref = mla_decode_attention(q_lat.double(), q_pe.double(), deq, tables, lens, R, 0.2)
    real_empty = torch.empty
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
        cfg = None if form == "default" else DecodeConfig(form=form, bh=16, bn=bn, trans=trans)
        out = mla_decode_triton(q_lat, q_pe, codes, tables, torch.tensor(lens, dtype=torch.int32), 64, 0.2,
                                num_sms=4, config=cfg, cache_scale=scale)
    assert out.dtype == BF16 and torch.isfinite(out).all()
    for n in range(N):
        assert rel_err(out[n], ref[n]) < 1e-2, n


def test_mla_decode_kernel_refuses_an_fp8_cache_without_matching_scales():
    from kimik3.ops.triton.mla_decode import mla_decode_triton
    codes = torch.zeros(4, 4, R + P, dtype=torch.float8_e4m3fn)
    q, qp, tables, lens = torch.zeros(1, 2, R, dtype=BF16), torch.zeros(1, 2, P, dtype=BF16), \
        torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="float32 scales"):
        mla_decode_triton(q, qp, codes, tables, lens, 4, 0.1, cache_scale=torch.ones(4, 3))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        mla_decode_triton(q, qp, codes.to(BF16), tables, lens, 4, 0.1, cache_scale=torch.ones(4, 4))


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_cache_latent_kernel_quantises_rows_within_the_bound(dtype):
    """The Triton cache write of an FP8 cache: each row's scale amax / 448 of the row in the model dtype, its
    codes within the interpreter's rounding (toward zero: one ulp) of float64 [norm(c_kv) * w | k_pe]
    (itself within one model-dtype rounding); other rows and scales untouched."""
    from kimik3.ops.triton.norm import cache_latent_triton
    g = gen(6)
    T, eps = 5, 1e-6
    c = (torch.randn(T, R + P, generator=g) * 3).to(dtype)
    c[1] *= 1e-3
    c[3, R:] *= 100                                                   # a loud rope part sets the row's scale
    w = (1 + 0.2 * torch.randn(R, generator=g)).to(dtype)
    cache = torch.zeros(4, 4, R + P, dtype=torch.float8_e4m3fn)
    scales = torch.full((4, 4), 5.0)
    slots = torch.tensor([13, 2, 7, 0, 9])
    cache_latent_triton(c, w, eps, cache, slots, scales)
    x = c[:, :R].double()
    want = torch.cat([x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double(), c[:, R:].double()], -1)
    s = scales.view(-1)[slots]
    ulp = 2 ** -7 if dtype == BF16 else 2 ** -10
    assert torch.allclose(s.double(), want.abs().amax(-1) / 448, rtol=2 * ulp)
    codes = cache.view(-1, R + P)[slots].double()
    got = codes * s.double().unsqueeze(-1)
    bound = torch.maximum(2 * fp8.ROUNDING_BOUND * want.abs(), fp8.SUBNORMAL_STEP * s.double().unsqueeze(-1))
    close = (got - want).abs() <= bound + 2 * ulp * want.abs()
    # Triton 3.9's interpreter drops the carry when rounding up crosses a power of two (1.97 -> 1.0, not 2.0;
    # 124.1 -> 64): such an element holds half the correctly rounded power of two (the GPU converts right)
    right = (want / s.double().unsqueeze(-1)).to(torch.float8_e4m3fn).double()
    power = (right.abs() == 2.0 ** right.abs().clamp_min(2 ** -9).log2().round()) & (right != 0)
    carry_dropped = power & (codes == right / 2)
    assert (close | carry_dropped).all()
    assert close.float().mean() > 0.9
    others = torch.ones(16, dtype=torch.bool)
    others[slots] = False
    assert (cache.view(-1, R + P)[others].float() == 0).all() and (scales.view(-1)[others] == 5.0).all()
