"""The router logits kernel and the expert alignment on CUDA at the real sizes (Kimi-Linear, the
K3 slice and K3 release; 1 .. 1024 tokens), outputs poisoned first (NaN-filled allocator): logits
against the float64 math with the fp32-accumulation bound of tests/ops/test_triton_router.py,
the alignment exactly against the plain-list construction there; then both inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from kimik3.ops.router import route_tokens, router_logits
from kimik3.ops.triton import moe as moe_kernels
from kimik3.ops.triton.router import router_logit_partials, router_logits_gemm_triton, router_logits_triton
from tests.gpu.test_fast_ops import poison_allocator
from kimik3.model.cuda_graphs import capture_graph
from tests.ops.test_triton_router import expected_alignment

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = {"kimi_linear": (2304, 256, 8), "k3_slice": (7168, 64, 16), "k3_release": (7168, 896, 16)}  # D, E, top-k
TOKENS = (1, 32, 128, 1024)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _logits_ok(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    want = x.double() @ w.double().t()
    return bool(((out.double() - want).abs() <= 2 ** -20 * (x.double().abs() @ w.double().abs().t())).all())


def _ids(T: int, E: int, k: int, g: torch.Generator) -> torch.Tensor:
    """k distinct experts per token, uniformly at random."""
    return torch.rand(T, E, generator=g, device="cuda").argsort(dim=1)[:, :k]


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["fp32_weight", "bf16_weight"])
@pytest.mark.parametrize("T", TOKENS + (4096,))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_router_logits_match_float64_on_cuda(shape, T, wdtype):
    """The decode kernel, the tensor-core GEMM kernel (TF32 x3 for an fp32 weight, bf16 products for
    the checkpoint's bf16 weight), and ``router_logits`` (the decode kernel up to
    ROUTER_LOGITS_MAX_TOKENS, then the GEMM kernel; an fp32 weight takes cuBLAS fp32 below
    ROUTER_LOGITS_GEMM_MIN_LOGITS), for x contiguous and as a column slice of a wider tensor."""
    D, E, _ = SHAPES[shape]
    g = _gen(T + E)
    wide = (torch.randn(T, D + 128, generator=g, device="cuda") * 2).to(torch.bfloat16)
    w = (torch.randn(E, D, generator=g, device="cuda") * D ** -0.5).to(wdtype)
    for x in (wide[:, :D].contiguous(), wide[:, 64:64 + D]):
        for fn in (router_logits_triton, router_logits_gemm_triton, router_logits):
            poison_allocator()
            out = fn(x, w)
            assert out.shape == (T, E) and out.dtype == torch.float32
            assert _logits_ok(out, x, w), (fn.__name__, x.stride())


@pytest.mark.parametrize("T", TOKENS + (256, 512))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_align_matches_plain_lists_on_cuda(shape, T):
    """``_sort_by_expert`` at R = T x top-k (the kernel up to ALIGN_KERNEL_MAX_ROWS, torch past
    it), with the tile BM the MoE picks for that load, and twice the same answer."""
    _, E, k = SHAPES[shape]
    ids = _ids(T, E, k, _gen(T * k))
    BM = moe_kernels._tiles(T * k / E)["BM"]
    want = expected_alignment(ids.reshape(-1).tolist(), E, BM)
    poison_allocator()
    rows, block_expert = moe_kernels._sort_by_expert(ids, E, BM)
    assert rows.tolist() == want[0] and block_expert.tolist() == want[1]
    again = moe_kernels._sort_by_expert(ids, E, BM)
    assert torch.equal(again[0], rows) and torch.equal(again[1], block_expert)


@pytest.mark.parametrize("BM", [16, 64, 128])
@pytest.mark.parametrize("R", [37, 1000, 4096])
def test_align_skewed_ids_on_cuda(R, BM):
    """Most rows on a few experts, some experts with one row, most with none (ids may repeat)."""
    g = _gen(R + BM)
    E = 896
    flat = torch.randint(0, 12, (R,), generator=g, device="cuda")
    flat[::7] = 300
    flat[:5] = torch.tensor([895, 0, 17, 400, 401], device="cuda")
    want = expected_alignment(flat.tolist(), E, BM)
    poison_allocator()
    rows, block_expert = moe_kernels._sort_by_expert(flat.view(R, 1), E, BM)
    assert rows.tolist() == want[0] and block_expert.tolist() == want[1]


def test_router_logits_and_align_replay_in_a_cuda_graph():
    """Captured once, replayed on new inputs copied into the captured buffers: both stay exact (the
    checkpoint's bf16 gate weight: 128 tokens take the tensor-core GEMM kernel)."""
    D, E, k = SHAPES["k3_release"]
    T = 128
    g = _gen(3)
    x = torch.empty(T, D, device="cuda", dtype=torch.bfloat16)
    ids = torch.empty(T, k, device="cuda", dtype=torch.int64)
    w = (torch.randn(E, D, generator=g, device="cuda") * D ** -0.5).to(torch.bfloat16)
    BM = moe_kernels._tiles(T * k / E)["BM"]
    x.copy_(torch.randn(T, D, generator=g, device="cuda"))
    ids.copy_(_ids(T, E, k, g))

    def step():
        return router_logits(x, w), moe_kernels._sort_by_expert(ids, E, BM)
    step()
    graph, (logits, (rows, block_expert)) = capture_graph(step)
    for seed in range(3):
        x.copy_(torch.randn(T, D, generator=_gen(10 + seed), device="cuda"))
        ids.copy_(_ids(T, E, k, _gen(20 + seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert _logits_ok(logits, x, w)
        want = expected_alignment(ids.reshape(-1).tolist(), E, BM)
        assert rows.tolist() == want[0] and block_expert.tolist() == want[1]


def _routing_ok(weights, ids, x, w, bias, k, scale) -> bool:
    """A top-k of the float64 biased sigmoid scores up to fp32's error (a chosen expert's score at least the
    k-th best's less 1e-4: near-ties may go either way), in descending order to the same tolerance, and the
    weights those experts' float64 scores renormalised and scaled."""
    s = torch.sigmoid(x.double() @ w.double().t())
    choice = s + bias.double()
    picked = choice.gather(1, ids)
    kth = choice.topk(k, dim=-1).values[:, -1:]
    distinct = all(len(set(r)) == k for r in ids.tolist())
    ordered = bool((picked[:, 1:] <= picked[:, :-1] + 1e-4).all())
    want = s.gather(1, ids)
    want = want / want.sum(-1, keepdim=True) * scale
    return distinct and ordered and bool((picked >= kth - 1e-4).all()) and torch.allclose(weights.double(), want,
                                                                                          rtol=1e-5, atol=0)


@pytest.mark.parametrize("T", (8, 32, 128, 256))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_split_k_routing_on_cuda(shape, T):
    """The split-K partials sum to the float64 logits within the fp32 bound; ``route_tokens`` (split-K,
    summed in the routing kernel) picks a top-k of the float64 routing (``_routing_ok``) on the checkpoint's
    bf16 gate weight; then the two launches replay in a CUDA graph on new inputs."""
    D, E, k = SHAPES[shape]
    g = _gen(T * E + 1)
    x = (torch.randn(T, D, generator=g, device="cuda") * 2).to(torch.bfloat16)
    w = (torch.randn(E, D, generator=g, device="cuda") * D ** -0.5).to(torch.bfloat16)
    bias = torch.randn(E, generator=g, device="cuda") * 0.1
    poison_allocator()
    parts = router_logit_partials(x, w)
    assert parts.shape[0] > 1 and _logits_ok(parts.sum(0), x, w)
    args = (k, "sigmoid", 1, 1, True, 2.446, 0.0)
    weights, ids = route_tokens(x, w, bias, *args)
    assert _routing_ok(weights, ids, x, w, bias, k, 2.446)
    graph, (gw, gi) = capture_graph(lambda: route_tokens(x, w, bias, *args))
    x.copy_((torch.randn(T, D, generator=_gen(T), device="cuda") * 2).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert _routing_ok(gw, gi, x, w, bias, k, 2.446)
