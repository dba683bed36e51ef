"""FP8 routed experts on the card: FP8 experts (``--quantization fp8`` of bf16 experts: E4M3 weights widened at
decode, E4M3 x E4M3 with activations quantised per 128 columns at prefill) and W4A8 on MXFP4 experts (MXFP8
activations, ``--enable-w4a8-moe``), against the references run on the same CUDA tensors (``reference_ops``:
the CPU path's e4m3 round trips), on ragged shapes and routings, outputs NaN-poisoned first. The kernels use
the hardware's round-to-nearest conversions, as the reference does, so the two differ only where an fp32 sum
in another order rounds h to another bf16 value and its E4M3 code with it. Engine: Kimi-Linear-shaped FP8
experts and the default model's W4A8 experts through ``LLM``, decode steps in CUDA graphs, greedy tokens equal
to the same engine run eagerly.

    pytest -q -m gpu tests/gpu/test_moe_fp8_gpu.py
"""

from __future__ import annotations

import math

import pytest
import torch

from kimik3.ops import fp8, mxfp4
from kimik3.ops.backend import reference_ops
from kimik3.ops.moe import fused_moe_fp8, fused_moe_mxfp4
from kimik3.ops.options import KernelOptions, kernel_options, use_kernel_options
from tests.helpers import rel_err, worst_rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16, FP16 = torch.bfloat16, torch.float16
BOUND = 1e-2


def poison_allocator(nbytes: int = 1 << 30) -> None:
    junk = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del junk


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _ids(T, E, k, g):
    """Distinct experts per token; expert 0 in every token, the last two in none (ragged per-expert rows)."""
    rest = torch.rand(T, E - 3, generator=g, device="cuda").argsort(dim=1)[:, :k - 1] + 1
    return torch.cat([torch.zeros(T, 1, dtype=torch.long, device="cuda"), rest], dim=1)


def _fp8_experts(E, N, K, g):
    w = torch.randn(E, N, K, generator=g, device="cuda") / math.sqrt(K)
    w[:, 5] *= 16
    codes, scale = torch.empty(E, N, K, dtype=fp8.FP8, device="cuda"), torch.empty(E, N, device="cuda")
    for e in range(E):
        c, s = fp8.quantize_weight(w[e], block=None)
        codes[e], scale[e] = c, s.view(-1)
    return codes, scale


def _mxfp4_experts(E, N, K, g):
    codes = torch.randint(0, 16, (E * N, K), generator=g, device="cuda", dtype=torch.uint8)
    base = 127 - round(math.log2(2 * math.sqrt(K)))
    scale = (base + torch.randint(-2, 3, (E * N, K // 32), generator=g, device="cuda")).to(torch.uint8)
    return mxfp4.pack_codes(codes).view(E, N, K // 2), scale.view(E, N, K // 32)


FP8_SHAPES = [(32, 2304, 1024, 8), (12, 264, 136, 3)]          # Kimi-Linear widths; ragged widths


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("T", [1, 7, 64, 1500], ids=["T1", "T7", "T64", "T1500-prefill"])
@pytest.mark.parametrize("E,L,I,k", FP8_SHAPES, ids=["kl", "ragged"])
def test_fp8_experts_match_the_reference(E, L, I, k, T, dtype):
    g = _gen(T + L)
    c13, s13 = _fp8_experts(E, 2 * I, L, g)
    w2 = _fp8_experts(E, L, I, g)
    w1, w3 = (c13[:, :I], s13[:, :I]), (c13[:, I:], s13[:, I:])
    x = torch.randn(T, L, generator=g, device="cuda").to(dtype)
    ids = _ids(T, E, k, g)
    weights = torch.rand(T, k, generator=g, device="cuda")
    poison_allocator()
    out = fused_moe_fp8(x, w1, w2, w3, weights, ids, "situ", 4.0, 25.0, True)
    with reference_ops():
        ref = fused_moe_fp8(x, w1, w2, w3, weights, ids, "situ", 4.0, 25.0, True)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert worst_rel_err(out, ref) < BOUND


W4A8_SHAPES = [(16, 3584, 3072, 16), (10, 160, 96, 3)]          # K3 widths; small ragged


@pytest.mark.parametrize("T", [2, 40, 700], ids=["T2", "T40", "T700"])
@pytest.mark.parametrize("E,L,I,k", W4A8_SHAPES, ids=["k3", "small"])
def test_w4a8_experts_match_the_reference(E, L, I, k, T):
    """The W4A8 kernels through the op under ``w4a8_moe`` (at the threshold and above) and directly at decode
    sizes (64-row tiles holding few rows), against the reference; and its distance from the bf16-activation
    kernels within the stated bound."""
    from kimik3.ops.triton.moe import fused_moe_triton
    g = _gen(T + L + 1)
    w1, w3, w2 = _mxfp4_experts(E, I, L, g), _mxfp4_experts(E, I, L, g), _mxfp4_experts(E, L, I, g)
    x = torch.randn(T, L, generator=g, device="cuda")
    x[:, 11] *= 30
    x = x.to(BF16)
    ids = _ids(T, E, k, g)
    weights = torch.rand(T, k, generator=g, device="cuda")
    options = KernelOptions(w4a8_moe=True).tuned(w4a8_rows_per_expert=min(kernel_options().tuning.w4a8_rows_per_expert,
                                                                          T * k // E))
    with use_kernel_options(options):
        poison_allocator()
        out = fused_moe_mxfp4(x, w1, w2, w3, weights, ids, "situ", 4.0, 25.0, True)
        direct = fused_moe_triton(x, w1, w2, w3, weights, ids, True, 4.0, 25.0, act_group=32)
        with reference_ops():
            ref = fused_moe_mxfp4(x, w1, w2, w3, weights, ids, "situ", 4.0, 25.0, True)
    plain = fused_moe_mxfp4(x, w1, w2, w3, weights, ids, "situ", 4.0, 25.0, True)
    assert torch.isfinite(out).all() and torch.equal(out, direct)
    assert worst_rel_err(out, ref) < BOUND
    assert 0.002 < rel_err(out, plain) < 0.1


def test_w4a8_in_a_cuda_graph_matches_eager():
    """Decode-size W4A8 launches (sort, kernels, combine) capture into a graph and replay to the eager bits."""
    from kimik3.ops.triton.moe import fused_moe_triton
    from kimik3.model.cuda_graphs import capture_graph
    g = _gen(3)
    E, L, I, k, T = 10, 256, 128, 4, 32
    w1, w3, w2 = _mxfp4_experts(E, I, L, g), _mxfp4_experts(E, I, L, g), _mxfp4_experts(E, L, I, g)
    x = torch.randn(T, L, generator=g, device="cuda").to(BF16)
    ids, weights = _ids(T, E, k, g), torch.rand(T, k, generator=g, device="cuda")
    eager = fused_moe_triton(x, w1, w2, w3, weights, ids, True, 4.0, 25.0, act_group=32)
    graph, out = capture_graph(lambda: fused_moe_triton(x, w1, w2, w3, weights, ids, True, 4.0, 25.0, act_group=32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def _greedy(llm, prompts):
    from kimik3.engine import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_engine_with_fp8_kimi_linear_experts_in_graphs(tmp_path):
    """A Kimi-Linear-shaped checkpoint (hidden 512, 16 experts top-4) with ``--quantization fp8``: the experts
    E4M3 on the card, decode steps in CUDA graphs give the eager run's greedy tokens; a 600-token prompt takes
    the prefill form."""
    import kimik3
    from kimik3.model.moe import Experts
    from kimik3.testing import make_tiny_checkpoint
    make_tiny_checkpoint(tmp_path, "kimi_linear", hidden=512, num_experts=16, top_k=4, vocab_size=512)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 for j in range(20 + 580 * (i == 0))]} for i in range(4)]
    outs = []
    for eager in (False, True):
        with kimik3.LLM(model=str(tmp_path), tokenizer=str(kimik3.DEFAULT_MODEL), quantization="fp8",
                        max_model_len=1024, max_num_seqs=4, enforce_eager=eager, use_tqdm_on_load=False) as llm:
            assert all(m.fp8 for m in llm.engine.model.modules() if isinstance(m, Experts))
            outs.append(_greedy(llm, prompts))
    assert outs[0] == outs[1]


def test_engine_with_w4a8_experts_in_graphs():
    """The default model (K3-shaped, MXFP4 experts) with ``enable_w4a8_moe``: graphs give the eager tokens."""
    import kimik3
    from kimik3.engine.args import EngineArgs
    from kimik3.ops.options import install_kernel_options
    prompts = [{"prompt_token_ids": list(range(5 + i, 300 + 3 * i))} for i in range(4)]
    outs = []
    try:
        for eager in (False, True):
            with kimik3.LLM(enable_w4a8_moe=True, max_model_len=512, max_num_seqs=4, enforce_eager=eager,
                            use_tqdm_on_load=False) as llm:
                assert kernel_options().w4a8_moe
                outs.append(_greedy(llm, prompts))
    finally:                    # the engine installed its options process-wide: the suite's again
        install_kernel_options(EngineArgs().kernel_options())
    assert outs[0] == outs[1]
