"""Expert offload on the GPU (``--cpu-offload-gb``): the staging kernel reading pinned host memory, inside a
CUDA graph too; the engine with decode graphs on the K3-width slice (MXFP4 experts) and the Kimi-Linear-width
slice (bf16 experts) with 30% / 60% of the experts in host memory, misses copied after routing or prefetched on
the copy stream (captured in the graphs), gives the resident engine's tokens and logprobs bit for bit (the same
kernels on the same shapes, only the weight rows looked up); misses computed on the host (eager) stay within
the bf16 rounding of resident; the policy's start-up measurement gives plausible rates; a tiny checkpoint
loaded with offload (pinned experts from the loader) gives the resident model's logits; FP8 experts (codes and
scales in the pool) offload exactly too."""

from __future__ import annotations

import json

import pytest
import torch

from kimik3.engine import EngineConfig, LLMEngine
from kimik3.model.expert_offload import ExpertOffloadConfig, expert_bytes
from tests.gpu.test_engine_graphs import CONFIG, KIMI_LINEAR_CONFIG, generate, make, requests

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_staging_kernel_reads_pinned_rows_in_a_graph():
    from kimik3.ops.expert_copy import byte_rows, copy_experts
    E, R, n = 10, 12, 5000                          # 20000 bytes a row: several programs a row
    g = torch.Generator().manual_seed(0)
    host = torch.randint(0, 256, (E, 4 * n), generator=g, dtype=torch.uint8).pin_memory()
    dev = torch.zeros(R, 4 * n, dtype=torch.uint8, device="cuda")
    experts = torch.tensor([9, 2, 4, 7], device="cuda")
    rows = torch.tensor([11, 3, 0, 6], device="cuda")
    used = torch.zeros(E, dtype=torch.bool, device="cuda")
    src, dst = byte_rows(host), byte_rows(dev)
    copy_experts(src, dst, experts, rows, used)               # warm-up (compiles), nothing used
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copy_experts(src, dst, experts, rows, used)
    for pick in ([9, 4], [2, 7, 1], []):
        dev.zero_()
        used.zero_()
        used[pick] = True
        graph.replay()
        torch.cuda.synchronize()
        want = torch.zeros(R, 4 * n, dtype=torch.uint8)
        for e, r in zip(experts.tolist(), rows.tolist()):
            if e in pick:
                want[r] = host[e]
        assert torch.equal(dev.cpu(), want), pick


def _offload(model, fraction: float, **kw) -> None:
    moes = model.moe_blocks()
    total = len(moes) * moes[0].experts.w13.shape[0] * expert_bytes(moes[0].experts)
    model.offload_experts(ExpertOffloadConfig(int(fraction * total), **kw))


@pytest.mark.parametrize("config", [CONFIG, KIMI_LINEAR_CONFIG], ids=["k3-slice-mxfp4", "kimi-linear-slice-bf16"])
def test_offloaded_engine_graphs_equal_resident(config):
    from benchmarks.gpu.bench_slice import build_slice
    model = build_slice(json.loads(config.read_text()), str(config))
    reqs = requests(model.config.text.vocab_size)
    resident = generate(make(model, enforce_eager=False), reqs)
    again = generate(make(model, enforce_eager=False), reqs)
    assert again == resident, "the resident engine is not repeatable on this GPU: exactness cannot be judged"
    for fraction, policy in ((0.3, "copy"), (0.6, "copy"), (0.3, "prefetch"), (0.6, "prefetch")):
        _offload(model, fraction, policy=policy, prefetch_from="both")
        o = model.expert_offload
        assert all(m.experts.w13.device.type == "cpu" and m.experts.w13.is_pinned() for m in model.moe_blocks())
        engine = make(model, enforce_eager=False)
        assert engine.runner.graphs is not None, "capture fell back to eager"
        offloaded = generate(engine, reqs)
        assert 0 < engine.runner.num_graph_steps < engine.runner.num_steps
        assert offloaded == resident, f"{fraction:.0%} offloaded, {policy}: tokens or logprobs differ from resident"
        assert int(o.copies.sum()) > 0 and o.refreshes > 0
        assert (int(o.prefetch_used.sum()) > 0) == (policy == "prefetch")
        print(f"{config.name} {fraction:.0%} {policy}: {o.staging_size} of {o.num_experts} experts a layer in host memory, "
              f"{o.stats()}")
        del engine
        torch.cuda.empty_cache()


def test_offloaded_fp8_experts_graphs_equal_resident():
    """FP8 routed experts (E4M3 codes + channel scales, Kimi-Linear-width slice): 30% / 60% of them in pinned host
    memory, misses copied or prefetched inside the decode graphs, give the resident FP8 engine's tokens and
    logprobs bit for bit (the pool rows carry the codes and scales; the same FP8 kernels with ``slots``)."""
    from benchmarks.gpu.bench_slice import build_slice
    from kimik3.loader.fp8 import quantize_fp8
    model = build_slice(json.loads(KIMI_LINEAR_CONFIG.read_text()), str(KIMI_LINEAR_CONFIG))
    quantize_fp8(model, experts=True)
    assert all(m.experts.fp8 for m in model.moe_blocks())
    reqs = requests(model.config.text.vocab_size)
    resident = generate(make(model, enforce_eager=False), reqs)
    assert generate(make(model, enforce_eager=False), reqs) == resident, "resident FP8 engine not repeatable"
    for fraction, policy in ((0.3, "copy"), (0.6, "prefetch")):
        _offload(model, fraction, policy=policy, prefetch_from="both")
        o = model.expert_offload
        assert o.kinds == ["w13", "w2", "w13_scale", "w2_scale"] and o.pool["w13"].dtype == torch.float8_e4m3fn
        assert all(m.experts.w13_scale.is_pinned() for m in model.moe_blocks())
        engine = make(model, enforce_eager=False)
        assert engine.runner.graphs is not None, "capture fell back to eager"
        assert generate(engine, reqs) == resident, f"FP8 {fraction:.0%} offloaded, {policy}: differs from resident"
        assert 0 < engine.runner.num_graph_steps and int(o.copies.sum()) > 0
        del engine
        torch.cuda.empty_cache()


@pytest.mark.parametrize("arch,quantization", [("kimi_k3", None), ("kimi_linear", None), ("kimi_linear", "fp8")])
def test_tiny_checkpoint_loaded_with_offload_equals_resident(arch, quantization, tmp_path):
    import kimik3
    from kimik3.testing import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path / arch, arch, seed=1)
    resident = kimik3.load_model(path, device="cuda", dtype=torch.bfloat16, quantization=quantization)
    moes = resident.moe_blocks()
    cfg = ExpertOffloadConfig(3 * len(moes) * expert_bytes(moes[0].experts))
    model = kimik3.load_model(path, device="cuda", dtype=torch.bfloat16, expert_offload=cfg, quantization=quantization)
    assert model.moe_blocks()[0].experts.w13.is_pinned()
    assert model.moe_blocks()[0].experts.fp8 == (quantization == "fp8")
    ids = torch.randint(5, 200, (37,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(ids), resident(ids))
    reqs = requests(model.config.text.vocab_size)
    kw = dict(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512, block_size=16,
              enable_prefix_caching=True, kda_checkpoint_interval=2, cache_memory_bytes=1 << 30, enforce_eager=False)
    want = generate(LLMEngine(resident, EngineConfig(**kw)), reqs)
    assert generate(LLMEngine(model, EngineConfig(**kw)), reqs) == want


@pytest.mark.parametrize("config,fp8", [(CONFIG, False), (KIMI_LINEAR_CONFIG, False), (KIMI_LINEAR_CONFIG, True)],
                         ids=["k3-slice-mxfp4", "kimi-linear-slice-bf16", "kimi-linear-slice-fp8"])
def test_host_compute_is_within_rounding_of_resident(config, fp8):
    """Misses computed on the host (eager; the policy forced to it): the pinned weights' rows come back (FP8: codes
    times their scales) and the logits stay within the bf16 rounding of resident (the host's sums round differently
    from the kernels')."""
    from benchmarks.gpu.bench_slice import build_slice
    from kimik3.loader.fp8 import quantize_fp8
    from kimik3.model.offload_policy import MissRates
    model = build_slice(json.loads(config.read_text()), str(config))
    if fp8:
        quantize_fp8(model, experts=True)
    ids = torch.randint(1000, model.config.text.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    want = model(ids[:1]), model(ids)
    _offload(model, 0.6, policy="host", rates=MissRates(copy=1e3, host_sync=0.0))
    o = model.expert_offload
    for w, got in zip(want, (model(ids[:1]), model(ids))):
        assert o.mode == "host"
        scale = w.abs().max().item()
        assert (got - w).abs().max().item() <= 0.02 * scale
        assert (got.argmax(-1) == w.argmax(-1)).float().mean().item() >= 0.9
    assert o.host_pairs > 0 and int(o.copies.sum()) == 0


def test_the_policy_measures_its_rates():
    from benchmarks.gpu.bench_slice import build_slice
    model = build_slice(json.loads(CONFIG.read_text()), str(CONFIG))
    _offload(model, 0.3, policy="auto")
    r = model.expert_offload.policy.rates
    assert r.source == "measured"
    assert 1e9 < r.copy < 1e12 and r.host_bytes > 1e6 and r.host_flops > 1e6 and 0 < r.host_sync < 0.1
    assert 0 < r.layer_seconds < 0.1
    print(model.expert_offload.policy.describe())
