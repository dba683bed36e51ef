"""The routing kernel against the torch reference, on CPU through TRITON_INTERPRET=1."""

import pytest
import torch

pytest.importorskip("triton")

from kimik3.ops.options import KernelTuning                             # noqa: E402
from kimik3.ops.router import route                                     # noqa: E402


@pytest.mark.parametrize("E,k,groups,topk_group,act,renorm,scale", [
    (64, 16, 1, 1, "sigmoid", True, 1.0),          # the K3 shape of the slice model
    (896, 16, 1, 1, "sigmoid", True, 1.0),         # K3 release: 896 experts, top-16
    (32, 4, 4, 2, "sigmoid", True, 2.5),           # grouped top-k
    (24, 3, 1, 1, "softmax", False, 1.0),
    (8, 1, 1, 1, "sigmoid", True, 2.446),           # top-1: no renormalisation
    (256, 8, 1, 1, "sigmoid", True, 2.446),         # Kimi-Linear-48B: 256 experts, top-8, one group
], ids=["slice", "release", "grouped", "softmax", "top1", "kimi_linear"])
def test_route_kernel_matches_reference(E, k, groups, topk_group, act, renorm, scale):
    from kimik3.ops.triton.router import route_triton
    g = torch.Generator().manual_seed(E + k)
    logits = torch.randn(7, E, generator=g) * 3
    bias = torch.randn(E, generator=g) * 0.3
    for b in (bias, None):
        args = (k, act, groups, topk_group, renorm, scale, 1e-20)
        w_ref, i_ref = route(logits, b, *args)
        w, i = route_triton(logits, b, *args)
        assert torch.equal(i, i_ref)
        assert torch.allclose(w, w_ref, rtol=1e-6, atol=1e-7)


def test_kimi_linear_routing_matches_float64():
    """Kimi-Linear's router parameters (sigmoid, 256 experts, top-8, one group, renormalised,
    routed_scaling_factor 2.446) against the math in float64: top-8 of sigmoid + bias, weights
    from the unbiased scores, renormalised, scaled."""
    from kimik3.ops.triton.router import route_triton
    g = torch.Generator().manual_seed(48)
    logits = torch.randn(9, 256, generator=g) * 3
    bias = torch.randn(256, generator=g) * 0.3
    s = torch.sigmoid(logits.double())
    ids64 = torch.argsort(s + bias.double(), dim=-1, descending=True)[:, :8]
    w64 = s.gather(1, ids64)
    w64 = w64 / w64.sum(-1, keepdim=True) * 2.446
    for fn in (route, route_triton):
        w, i = fn(logits, bias, 8, "sigmoid", 1, 1, True, 2.446, 1e-20)
        assert torch.equal(i, ids64)
        assert torch.allclose(w.double(), w64, rtol=1e-6, atol=0)


# ---- router logits -----------------------------------------------------------------------
def _logits_bound(x, w):
    """fp32 products summed in fp32 (any order, blocked): within 2**-20 of sum |x_d w_d| of the
    float64 result (worst case ~D 2**-24; bf16 or TF32 operands would miss it by 100x)."""
    return 2 ** -20 * (x.double().abs() @ w.double().abs().t())


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["fp32_weight", "bf16_weight"])
@pytest.mark.parametrize("T,E,D", [(1, 64, 2304), (1, 256, 2304), (5, 64, 512), (5, 896, 512), (37, 64, 2304),
                                   (37, 256, 512)])
def test_router_logits_kernel_matches_float64(T, E, D, wdtype):
    """fp32 logits of bf16 x and the gate weight (fp32, or bf16 as the checkpoint stores it) against
    the float64 math, x a column slice of a wider tensor (row stride > D; contiguous x in the test
    below), at each tile choice of ``logits_config``: one token x one or two experts, 8 tokens x one,
    two or four experts."""
    from kimik3.ops.triton.router import logits_config, router_logits_triton
    g = torch.Generator().manual_seed(T * E + D)
    x = (torch.randn(T, D + 96, generator=g) * 2).to(torch.bfloat16)[:, 64:64 + D]
    w = (torch.randn(E, D, generator=g) * D ** -0.5).to(wdtype)
    out = router_logits_triton(x, w)
    assert out.shape == (T, E) and out.dtype == torch.float32
    assert ((out.double() - x.double() @ w.double().t()).abs() <= _logits_bound(x, w)).all(), logits_config(T, E)


@pytest.mark.parametrize("T,E,D,tiles,dtypes", [
    (150, 256, 2304, (32, 32, 32, 4), (torch.bfloat16, torch.float32)),
    (7, 64, 520, (16, 64, 64, 4), (torch.bfloat16, torch.float32)),
    (150, 256, 2304, None, (torch.bfloat16, torch.bfloat16)),
    (70, 96, 520, None, (torch.float16, torch.float16)),
    (300, 40, 136, None, (torch.bfloat16, torch.bfloat16)),
], ids=["kimi_linear_prefill", "ragged", "kimi_linear_prefill_bf16_weight", "fp16_ragged", "bf16_long"])
def test_router_logits_gemm_kernel_matches_float64(T, E, D, tiles, dtypes):
    """The tensor-core kernel (TF32 x3 for an fp32 weight, exact 16-bit products for a weight of x's
    dtype, on a GPU; fp32 products in the interpreter) against the float64 math, within the bound of
    fp32 products: tokens, experts and the width past the last full tile, the default tiles of each
    size class (``gemm_tiles``) and given ones."""
    from kimik3.ops.triton.router import router_logits_gemm_triton
    g = torch.Generator().manual_seed(T + D)
    xdtype, wdtype = dtypes
    x = (torch.randn(T, D, generator=g) * 2).to(xdtype)
    w = (torch.randn(E, D, generator=g) * D ** -0.5).to(wdtype)
    out = router_logits_gemm_triton(x, w, tiles)
    assert out.shape == (T, E) and out.dtype == torch.float32
    assert ((out.double() - x.double() @ w.double().t()).abs() <= _logits_bound(x, w)).all()


def test_router_logits_kernels_refuse_mixed_16_bit_operands():
    from kimik3.ops.triton.router import router_logits_gemm_triton, router_logits_triton
    x = torch.randn(3, 64).to(torch.bfloat16)
    for fn in (router_logits_triton, router_logits_gemm_triton):
        with pytest.raises(ValueError, match="an fp32 weight or one of x's dtype, got torch.bfloat16 and torch.float16"):
            fn(x, torch.randn(8, 64).to(torch.float16))
        with pytest.raises(ValueError, match="takes bf16/fp16 x"):
            fn(x.float(), torch.randn(8, 64))


def test_router_logits_takes_the_gemm_kernel_for_long_steps(monkeypatch, kernel_options):
    """Past the SIMT kernel's limits: a weight of x's dtype always takes the GEMM kernel; an fp32 one
    from ROUTER_LOGITS_GEMM_MIN_LOGITS logits (the cast + fp32 GEMM before); no unit feature stride
    keeps the torch math."""
    from kimik3.ops import router
    from kimik3.ops.triton import router as kernel
    calls = []
    real = kernel.router_logits_gemm_triton
    kernel_options(cpu_kernels=True)                                 # the kernels on CPU tensors
    kernel_options(router_logits_max_tokens=2)
    kernel_options(router_logits_simt_max_logits=2 * 16)
    kernel_options(router_logits_gemm_min_logits=9 * 16)       # 16 experts: from 9 tokens
    monkeypatch.setattr(kernel, "router_logits_gemm_triton",
                        lambda x, w: calls.append((x.shape[0], w.dtype)) or real(x, w))
    w = torch.randn(16, 96) * 96 ** -0.5
    for wdtype in (torch.float32, torch.bfloat16):
        for T in (8, 9, 40):
            x = torch.randn(T, 96).to(torch.bfloat16)
            out = router.router_logits(x, w.to(wdtype))
            assert ((out.double() - x.double() @ w.to(wdtype).double().t()).abs()
                    <= _logits_bound(x, w.to(wdtype).double())).all()
    x = torch.randn(12, 192).to(torch.bfloat16)[:, ::2]                # no unit feature stride: torch math
    assert router.router_logits(x, w).shape == (12, 16)
    assert router.router_logits(x, w.to(torch.bfloat16)).shape == (12, 16)
    bf16 = torch.bfloat16
    assert calls == [(9, torch.float32), (40, torch.float32), (8, bf16), (9, bf16), (40, bf16)]


def test_router_logits_takes_the_kernel_on_the_fast_path(monkeypatch, kernel_options):
    """``router_logits`` (what ``route_tokens`` calls outside its split-K range) sends bf16/fp16 x to the SIMT kernel with an
    fp32 weight up to ROUTER_LOGITS_MAX_TOKENS tokens (ROUTER_LOGITS_MAX_TOKENS_LARGE for weights over
    2**20 elements) and with one of x's dtype (the checkpoint's bf16) up to ROUTER_LOGITS_SIMT_MAX_LOGITS
    tokens x experts (checked by pretending the fast path is on); more tokens with an fp32 weight below
    the GEMM's threshold, fp32 x, or a 16-bit weight of the other dtype keep the torch math; an unfit
    weight is refused."""
    from kimik3.ops import router
    from kimik3.ops.triton import router as kernel
    calls = []
    real = kernel.router_logits_triton
    kernel_options(cpu_kernels=True)                                 # the kernels on CPU tensors
    kernel_options(router_logits_max_tokens=8)
    kernel_options(router_logits_max_tokens_large=2)
    kernel_options(router_logits_simt_max_logits=8 * 16)
    monkeypatch.setattr(kernel, "router_logits_triton", lambda x, w: calls.append((x.shape, w.dtype)) or real(x, w))
    small, large = torch.randn(16, 64), torch.randn(2, (1 << 19) + 64) * 2 ** -9      # 2**20 + 128 elements
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    for T, dtype, w in ((3, bf16, small), (8, fp16, small), (9, bf16, small), (3, fp32, small),
                        (3, bf16, small.to(bf16)), (8, fp16, small.to(fp16)), (3, bf16, small.to(fp16)),
                        (2, bf16, large), (3, bf16, large), (2, bf16, large.to(bf16))):
        x = torch.randn(T, w.shape[1]).to(dtype)
        out = router.router_logits(x, w)
        assert out.dtype == torch.float32
        assert ((out.double() - x.double() @ w.double().t()).abs() <= _logits_bound(x, w.double())).all()
    assert calls == [((3, 64), fp32), ((8, 64), fp32), ((3, 64), bf16), ((8, 64), fp16),
                     ((2, (1 << 19) + 64), fp32), ((2, (1 << 19) + 64), bf16)]
    with pytest.raises(ValueError, match=r"x has width 64 but the router weight is \(16, 32\)"):
        real(torch.randn(2, 64).to(torch.bfloat16), torch.randn(16, 32))


# ---- expert alignment --------------------------------------------------------------------
def expected_alignment(flat: list[int], E: int, BM: int) -> tuple[list[int], list[int]]:
    """``_sort_by_expert``'s contract in plain lists: each expert's rows in row order, padded with
    R to a multiple of BM, experts in order, then R up to the capacity; one block id per BM
    entries (-1 past the last expert's blocks)."""
    R = len(flat)
    cap = -(-(R + min(E, R) * (BM - 1)) // BM) * BM
    by_expert = [[] for _ in range(E)]
    for r, e in enumerate(flat):
        by_expert[e].append(r)
    rows, blocks = [], []
    for e, mine in enumerate(by_expert):
        n = -(-len(mine) // BM) * BM
        rows += mine + [R] * (n - len(mine))
        blocks += [e] * (n // BM)
    return rows + [R] * (cap - len(rows)), blocks + [-1] * (cap // BM - len(blocks))


def _poisoned_empty(monkeypatch):
    """torch.empty that returns -7 / NaN filled tensors, so an unwritten output element shows."""
    real = torch.empty

    def empty(*a, **k):
        t = real(*a, **k)
        return t.fill_(float("nan") if t.is_floating_point() else -7)
    monkeypatch.setattr(torch, "empty", empty)


ALIGN_CASES = {   # name: (E, BM, ids as a function of a generator)
    "decode_k3": (64, 16, lambda g: torch.stack([torch.randperm(64, generator=g)[:16] for _ in range(1)])),
    "one_row": (256, 16, lambda g: torch.tensor([[200]])),
    "kimi_linear_37": (256, 16, lambda g: torch.stack([torch.randperm(256, generator=g)[:8] for _ in range(37)])),
    "release_5": (896, 16, lambda g: torch.stack([torch.randperm(896, generator=g)[:16] for _ in range(5)])),
    # skewed: a few experts with many rows, some with one, most with none; repeats within a token
    "skewed": (40, 16, lambda g: torch.cat([torch.full((100,), 3), torch.full((37,), 39), torch.tensor([0, 17, 5]),
                                            torch.randint(4, 9, (60,), generator=g)])[torch.randperm(200, generator=g)]
               .view(50, 4)),
    "big_blocks": (24, 64, lambda g: torch.randint(0, 24, (77, 4), generator=g)),
    "all_one_expert": (8, 128, lambda g: torch.full((129, 2), 5)),
}


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch_ops"])
@pytest.mark.parametrize("case", list(ALIGN_CASES))
def test_sort_by_expert_matches_plain_lists(case, kernel, monkeypatch, kernel_options):
    """The alignment's exact outputs (sorted rows, block experts) against ``expected_alignment``,
    outputs poisoned first; rows 1 .. 400 and experts with 0, 1 and many rows."""
    from kimik3.ops.triton import moe as moe_kernels
    if not kernel:
        kernel_options(align_kernel_max_rows=-1)
    E, BM, make = ALIGN_CASES[case]
    ids = make(torch.Generator().manual_seed(len(case)))
    want_rows, want_blocks = expected_alignment(ids.reshape(-1).tolist(), E, BM)
    _poisoned_empty(monkeypatch)
    rows, block_expert = moe_kernels._sort_by_expert(ids, E, BM)
    assert rows.dtype == block_expert.dtype == torch.int64
    assert rows.tolist() == want_rows
    assert block_expert.tolist() == want_blocks


def test_align_kernel_matches_plain_lists_across_row_counts():
    """Row counts 1 .. 300 below, at and past powers of two and ALIGN_BLOCKS (one row per program up
    to 64 rows, then several) with random ids of 48 experts, one of them on a third of the rows
    (a stable argsort decides the expected order here)."""
    from kimik3.ops.triton import moe as moe_kernels
    g = torch.Generator().manual_seed(5)
    E, BM = 48, 16
    for R in (1, 2, 3, 7, 8, 9, 31, 63, 64, 65, 127, 129, 256, 300):
        flat = torch.randint(0, E, (R,), generator=g)
        flat[: R // 3] = flat[0]                         # one expert with many rows
        order = torch.argsort(flat, stable=True).tolist()
        rows, block_expert = moe_kernels._sort_by_expert(flat.view(R, 1), E, BM)
        placed = [r for r in rows.tolist() if r != R]
        assert placed == order, R
        want_rows, want_blocks = expected_alignment(flat.tolist(), E, BM)
        assert rows.tolist() == want_rows and block_expert.tolist() == want_blocks, R


# ---- split-K logits summed by the routing kernel -------------------------------------------
@pytest.mark.parametrize("T,E,D,tiles", [
    (8, 64, 1032, None),                    # K3-like at decode: the width past the last full split
    (37, 256, 1160, None),                  # Kimi-Linear-like experts, ragged tokens
    (5, 96, 640, (16, 32, 64, 4, 3)),       # three splits of 192 + 192 + 256 -> 256, 256, 128
    (20, 40, 136, (16, 16, 32, 4, 5)),      # the last split narrower than one K step
], ids=["k3_like", "kimi_linear_like", "given_tiles", "ragged_split"])
def test_router_logit_partials_sum_to_float64_logits(T, E, D, tiles, monkeypatch):
    """Each split's partial is the float64 product over its width (within the fp32 bound), and their
    sum the whole product: the splits cover the width once (outputs poisoned first)."""
    from kimik3.ops.triton import router as kernel
    g = torch.Generator().manual_seed(T * E + D)
    x = (torch.randn(T, D, generator=g) * 2).to(torch.bfloat16)
    w = (torch.randn(E, D, generator=g) * D ** -0.5).to(torch.bfloat16)
    _poisoned_empty(monkeypatch)
    parts = kernel.router_logit_partials(x, w, tiles)
    _, _, BK, _, asked = tiles or kernel.split_tiles(T, E, D)
    S, KS = parts.shape[0], -(-(-(-D // BK)) // asked) * BK         # each split ceil(steps / asked) K steps
    assert S > 1 and parts.shape[1:] == (T, E) and parts.dtype == torch.float32
    for s in range(S):
        xs, ws = x[:, s * KS:(s + 1) * KS], w[:, s * KS:(s + 1) * KS]
        assert ((parts[s].double() - xs.double() @ ws.double().t()).abs() <= _logits_bound(xs, ws)).all(), s
    assert ((parts.double().sum(0) - x.double() @ w.double().t()).abs() <= _logits_bound(x, w)).all()


def test_split_tiles_cover_the_width_with_enough_programs():
    """Splits of at least SPLIT_MIN_STEPS K steps (none empty), and more than one where the width allows,
    for the three router shapes at decode sizes."""
    import triton as tr

    from kimik3.ops.triton.router import split_tiles
    SPLIT_MIN_STEPS = KernelTuning().router_split_min_steps
    for D, E in ((7168, 64), (7168, 896), (2304, 256)):
        for T in (8, 32, 128, 256):
            BM, BN, BK, _, S = split_tiles(T, E, D)
            steps = tr.cdiv(D, BK)
            per = tr.cdiv(steps, S)
            assert S > 1 and per >= SPLIT_MIN_STEPS and (S - 1) * per < steps, (D, E, T, S)


def test_a_step_and_its_padded_graph_route_alike():
    """An eager step of T tokens and the CUDA graph it is padded to (the decode ladder of 256 sequences) take
    the same logits path and the same split tiles, so a row's logits have the same bits in both: where they
    did not (unsplit at 5-7 tokens, split at 8), a greedy token differed between eager and graph steps on the
    H100 at an expert near-tie."""
    from kimik3.model.cuda_graphs import graph_batch_sizes, padded_batch_size
    from kimik3.ops.router import splits_logits
    from kimik3.ops.triton.router import split_tiles
    sizes = graph_batch_sizes(256)
    for T in range(1, 257):
        padded = padded_batch_size(T, sizes)
        assert splits_logits(T) == splits_logits(padded), (T, padded)
        for D, E in ((7168, 64), (7168, 896), (2304, 256)):
            if splits_logits(T):
                (bm, _, _, _, s), (bm_p, _, _, _, s_p) = split_tiles(T, E, D), split_tiles(padded, E, D)
                assert (bm, s) == (bm_p, s_p), (T, padded, D, E)


@pytest.mark.parametrize("E,k,groups,topk_group,D", [(64, 16, 1, 1, 1032), (256, 8, 1, 1, 1160),
                                                     (32, 4, 4, 2, 1032)], ids=["k3_like", "kimi_linear", "grouped"])
def test_route_tokens_matches_float64_routing(E, k, groups, topk_group, D, monkeypatch, kernel_options):
    """``route_tokens`` on the split-K path (the fast path pretended on, as on CUDA) against the routing
    math in float64 from the float64 logits: the same experts in the same order, weights within fp32
    rounding; below ``KernelTuning.router_split_min_tokens`` it takes the unsplit logits, with the same result."""
    from kimik3.ops import router
    from kimik3.ops.triton import router as kernel
    calls = []
    real = kernel.router_logit_partials
    monkeypatch.setattr(kernel, "router_logit_partials", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    kernel_options(cpu_kernels=True)                                 # the kernels on CPU tensors
    g = torch.Generator().manual_seed(E + D)
    w = (torch.randn(E, D, generator=g) * D ** -0.5).to(torch.bfloat16)
    bias = torch.randn(E, generator=g) * 0.1
    for T in (KernelTuning().router_split_min_tokens - 1, 9, 40):
        x = (torch.randn(T, D, generator=g) * 2).to(torch.bfloat16)
        logits = x.double() @ w.double().t()
        s = torch.sigmoid(logits)
        choice = s + bias.double()
        if groups > 1:
            grouped = choice.view(T, groups, E // groups)
            keep = grouped.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices
            mask = torch.zeros(T, groups, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(T, E)
        ids64 = choice.topk(k, dim=-1).indices
        w64 = s.gather(1, ids64)
        w64 = w64 / w64.sum(-1, keepdim=True) * 2.5
        weights, ids = router.route_tokens(x, w, bias, k, "sigmoid", groups, topk_group, True, 2.5, 0.0)
        assert torch.equal(ids, ids64), T
        assert torch.allclose(weights.double(), w64, rtol=1e-5, atol=0), T
    assert calls == [9, 40]
