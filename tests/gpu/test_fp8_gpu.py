"""FP8 on the card (issue #56): the FP8 latent cache's write and decode / prefill reads, and FP8 weights' GEMV,
block-scaled GEMM and torch._scaled_mm prefill, against float64 references of the same quantised operands, on
ragged shapes; outputs start NaN-poisoned (an unwritten element shows as non-finite). Engine: an FP8 cache and
FP8 weights end to end, in CUDA graphs.

    pytest -q -m gpu tests/gpu/test_fp8_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from kimik3.ops import fp8
from kimik3.ops.backend import reference_ops
from kimik3.ops.linear import FP8_GEMV_MAX_ROWS, fp8_linear
from kimik3.ops.mla import cache_latent, mla_decode_attention, mla_prefill_attention
from tests.helpers import worst_rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16 = torch.bfloat16
BF16_BOUND = 1e-2


def poison_allocator(nbytes: int = 1 << 30) -> None:
    junk = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del junk


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _fp8_paged(lens, bs, D, g, magnitudes=True):
    """An FP8 latent cache holding ``lens`` tokens per sequence in scattered blocks: codes, per-token scales
    (spread over 1e-2 .. 1e2 when ``magnitudes``), float64 rows and the block tables."""
    blocks = sum(-(-n // bs) for n in lens) + 3
    rows = torch.randn(blocks, bs, D, generator=g, device="cuda", dtype=torch.float64)
    if magnitudes:
        rows *= torch.logspace(-2, 2, blocks * bs, device="cuda", dtype=torch.float64)[
            torch.randperm(blocks * bs, generator=g, device="cuda")].view(blocks, bs, 1)
    codes, scale = fp8.quantize_rows(rows)
    perm = torch.randperm(blocks - 1, generator=g, device="cuda") + 1
    tables = torch.full((len(lens), max(-(-n // bs) for n in lens)), -1, dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // bs)
        tables[i, :nb] = perm[used:used + nb].int()
        used += nb
    return codes, scale, fp8.dequantize_rows(codes, scale, torch.float64), tables


@pytest.mark.parametrize("H,bs", [(96, 16), (32, 64), (8, 16), (5, 16)], ids=["k3-h96", "kl-h32-bs64", "h8", "h5"])
@pytest.mark.parametrize("lens", [[1, 37, 4100, 257], [2000]], ids=["ragged4", "one"])
def test_fp8_decode_matches_float64(H, bs, lens):
    R, P = 512, 64
    g = _gen(H + len(lens))
    codes, scale, deq, tables = _fp8_paged(lens, bs, R + P, g)
    q_lat = (torch.randn(len(lens), H, R, generator=g, device="cuda") * 0.05).to(BF16)
    q_pe = (torch.randn(len(lens), H, P, generator=g, device="cuda") * 0.05).to(BF16)
    with reference_ops():
        ref = mla_decode_attention(q_lat.double(), q_pe.double(), deq, tables, lens, R, 0.07)
    poison_allocator()
    out = mla_decode_attention(q_lat, q_pe, codes, tables, torch.tensor(lens, device="cuda"), R, 0.07,
                               max_seq_len=max(lens), cache_scale=scale)
    assert torch.isfinite(out).all()
    for n in range(len(lens)):
        assert worst_rel_err(out[n], ref[n]) < BF16_BOUND, n


@pytest.mark.parametrize("form", ["naive", "absorbed"])
def test_fp8_prefill_matches_float64(form):
    """Ragged chunks over FP8 context: the kernel reads the piece dequantised as it is gathered."""
    H, R, P, dn, dv, bs = 32, 512, 64, 128, 128, 16
    q_lens, ctx = [37, 1, 300, 16], [0, 900, 64, 2049]
    g = _gen(7)
    codes, scale, deq, tables = _fp8_paged([q + c for q, c in zip(q_lens, ctx)], bs, R + P, g, magnitudes=False)
    q = (torch.randn(sum(q_lens), H, dn + P, generator=g, device="cuda") * 0.3).to(BF16)
    kv_b = (torch.randn(H * (dn + dv), R, generator=g, device="cuda") * 0.05).to(BF16)
    with reference_ops():
        ref = mla_prefill_attention(q.double(), deq, tables, kv_b.double(), q_lens, ctx, R, dv, 0.07, form)
    poison_allocator()
    out = mla_prefill_attention(q, codes, tables, kv_b, q_lens, ctx, R, dv, 0.07, form, cache_scale=scale)
    starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    assert torch.isfinite(out).all()
    for n in range(len(q_lens)):
        assert worst_rel_err(out[starts[n]:starts[n + 1]], ref[starts[n]:starts[n + 1]]) < BF16_BOUND, n


def test_fp8_cache_write_quantises_rows_within_the_e4m3_bound():
    """The Triton write (norm, quantisation, scatter) against the torch reference's: the scale amax / 448 of the
    bf16 row (the two norms may round an element one bf16 ulp apart), the values within one E4M3 step."""
    R, P, T = 512, 64, 37
    g = _gen(3)
    c = (torch.randn(T, R + P, generator=g, device="cuda") * 3).to(BF16)
    c[5, R:] *= 300
    w = (1 + 0.2 * torch.randn(R, generator=g, device="cuda")).to(BF16)
    codes = torch.zeros(8, 16, R + P, dtype=torch.float8_e4m3fn, device="cuda")
    scales = torch.full((8, 16), 7.0, device="cuda")
    slots = torch.randperm(8 * 16, generator=g, device="cuda")[:T]
    cache_latent(c, w, 1e-6, codes, slots, scales)
    with reference_ops():
        ref_codes, ref_scales = torch.zeros_like(codes), torch.full_like(scales, 7.0)
        cache_latent(c, w, 1e-6, ref_codes, slots, ref_scales)
    s = scales.view(-1)[slots].double()
    assert torch.allclose(s, ref_scales.view(-1)[slots].double(), rtol=2 ** -7)     # amax: a bf16 ulp at most
    got = codes.view(-1, R + P)[slots].double() * s.unsqueeze(1)
    want = ref_codes.view(-1, R + P)[slots].double() * s.unsqueeze(1)
    step = torch.maximum(2 ** -3 * want.abs(), 2 ** -9 * s.unsqueeze(1))          # one E4M3 step
    assert ((got - want).abs() <= step + 2 ** -7 * want.abs()).all() and (got == want).double().mean() > 0.9
    others = torch.ones(8 * 16, dtype=torch.bool, device="cuda")
    others[slots] = False
    assert (codes.view(-1, R + P)[others].float() == 0).all() and (scales.view(-1)[others] == 7).all()


SHAPES = [(1, 4096, 2048), (7, 2304, 7168), (16, 130, 300), (300, 4096, 2048), (4096, 1536, 7168), (33, 208, 4160)]


@pytest.mark.parametrize("block", [None, 128], ids=["channel", "block"])
@pytest.mark.parametrize("M,N,K", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_fp8_linear_matches_float64(M, N, K, block):
    """Decode rows (GEMV: bf16 activations, E4M3 weight) and prefill (activations quantised: _scaled_mm for
    channel scales on 16-multiples, our block-scaled kernel otherwise) against float64 over the same
    round-tripped operands; ragged N / K (130 x 300, 208 x 4160) take the masked tiles."""
    g = _gen(M + N + K)
    w = torch.randn(N, K, generator=g, device="cuda", dtype=torch.float64) * 0.02
    codes, scale = fp8.quantize_weight(w, block)
    scale = scale.view(-1) if block is None else scale
    x = torch.randn(M, K, generator=g, device="cuda").to(BF16)
    wd = fp8.dequantize_weight(codes, scale.view(-1, 1) if block is None else scale, torch.float64)
    if M > FP8_GEMV_MAX_ROWS:
        xd = fp8.dequantize_activations(*fp8.quantize_activations(x, block), torch.float64)
    else:
        xd = x.double()
    poison_allocator()
    y = fp8_linear(x, codes, scale)
    assert y.dtype == BF16 and torch.isfinite(y).all()
    assert worst_rel_err(y, xd @ wd.t()) < BF16_BOUND


def test_engine_with_fp8_cache_and_weights_in_graphs():
    """The default model in bf16 with an FP8 cache and FP8 weights, decode steps in CUDA graphs: greedy tokens
    agree with the same engine run eagerly."""
    import kimik3
    from kimik3.engine import SamplingParams
    prompts = [{"prompt_token_ids": list(range(5 + i, 40 + 3 * i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = []
    for eager in (False, True):
        with kimik3.LLM(quantization="fp8", kv_cache_dtype="fp8", max_model_len=256, max_num_seqs=4,
                        enforce_eager=eager, use_tqdm_on_load=False) as llm:
            assert llm.engine.cache.mla_latent.dtype == torch.float8_e4m3fn
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1]
