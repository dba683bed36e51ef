"""Expert offload (``--cpu-offload-gb``, a budget per GPU as vLLM's flag) under tensor, expert and pipeline
parallelism on CPU ranks (gloo, float64): each rank offloads from the experts or expert slices it holds, and the
engine's greedy outputs (chunked prefill, prefix hits, decode) equal the one-process fully resident ones; the
planner's per-GPU figures are what each rank's ``ExpertOffload`` holds."""

import pytest
import torch

from kimik3.config import load_config
from kimik3.distributed import ParallelContext
from kimik3.engine import EngineConfig, LLMEngine
from kimik3.loader.load import load_model
from kimik3.model.expert_offload import ExpertOffloadConfig, expert_bytes
from kimik3.sizing import compute_sizing
from kimik3.testing import make_tiny_checkpoint
from tests.parallel.ranks import ENGINE_CONFIG, engine_prompts, offload_engine_rank, run_engine, spawn

# name: (TP size, EP on/off, MoE mode, pipeline stages, miss policy, rounds of prompts, decode "graphs"); world 2
LAYOUTS = {"tp2": (2, False, "tep", 1, "copy", 2, False), "ep2-graphs": (2, True, "tep", 1, "prefetch", 1, True),
           "ep2-a2a": (2, True, "a2a", 1, "copy", 1, False), "ep2-agrs": (2, True, "agrs", 1, "copy", 1, False),
           "pp2": (1, False, "tep", 2, "host", 1, False)}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Tiny checkpoints with 4 KDA/MLA heads (TP4 divides them)."""
    d = tmp_path_factory.mktemp("offpar")
    return {arch: make_tiny_checkpoint(d / arch, arch, seed=1, num_heads=4) for arch in ("kimi_k3", "kimi_linear")}


def test_offload_under_tp_ep_pp_gives_the_resident_tokens(ckpts, tmp_path):
    """TP2 (every rank offloads slices of the same experts), EP2 (each rank its own experts; prefetch predicts
    from the router's global ids; decode steps through the workers' graph path, eager stand-ins), EP2 all-to-all and all-gather (the exchanges stage what the rank runs) and PP2
    (each stage its layers; host compute): the one-process resident outputs, with misses served on every rank."""
    ckpt = ckpts["kimi_k3"]
    resident = load_model(ckpt, dtype=torch.float64)
    engine = LLMEngine(resident, EngineConfig(**ENGINE_CONFIG))
    first, second = engine_prompts(engine.vocab_size)
    (a, _), (b, hits) = run_engine(engine, first), run_engine(engine, second)
    assert hits > 0
    moes = resident.moe_blocks()
    whole = expert_bytes(moes[0].experts)
    budget = 3 * len(moes) * whole // 2          # TP2: 3 slices a layer; EP2: 2 of a rank's 4 experts a layer
    budgets = {name: whole if name == "pp2" else budget for name in LAYOUTS}      # PP2: 1 expert a stage's layer
    spawn(offload_engine_rank, 2, str(ckpt), LAYOUTS, budgets, str(tmp_path / "out.pt"), timeout=300)
    results = torch.load(tmp_path / "out.pt", weights_only=False)
    want_staging = {"tp2": 3, "ep2-graphs": 2, "ep2-a2a": 2, "ep2-agrs": 2, "pp2": 1}
    for name, (outs, (par_hits, graph_steps), ranks) in results.items():
        rounds, graphs = LAYOUTS[name][-2:]
        assert (graph_steps > 0) == graphs, name
        assert outs == (a + b)[:len(outs)] and len(outs) == 3 * rounds, name
        assert par_hits == (hits if rounds == 2 else 0), name
        for rank, (stats, cache, staging, layers, offloaded) in enumerate(ranks):
            local = 4 if LAYOUTS[name][1] else 8
            assert cache + staging == local, (name, rank)
            if name in want_staging:
                assert staging == want_staging[name], (name, rank, staging)
            share = whole // (2 if name == "tp2" else 1)        # one expert (slice) of this rank
            assert offloaded >= budgets[name] > offloaded - layers * share, (name, rank)
            served = stats["host_pairs"] if stats["policy"] == "host" else stats["staged_experts"]
            assert served > 0, (name, rank, stats)              # every rank served misses from its host pool
            assert stats["refreshes"] > 0, (name, rank, stats)  # workers refresh their hot sets too


@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2), (4, 2)])
def test_planner_per_gpu_figures_are_what_each_rank_offloads(ckpts, tp, ep):
    """``compute_sizing`` (``kimik3 inspect``) against the engine's pools, rank by rank, bf16 as stored (MXFP4 K3
    experts packed under EP, bf16 Kimi-Linear experts, and FP8 Kimi-Linear experts): the experts a layer offloaded, the
    staging area, the bytes in host memory and the GPU's resident routed-expert bytes (cache + staging)."""
    for arch, kw in (("kimi_k3", {"packed_experts": True}), ("kimi_linear", {}), ("kimi_linear", {"quantization": "fp8"})):
        if arch == "kimi_k3" and ep != tp:          # the tiny K3's expert slices would split an MXFP4 group
            continue
        path = ckpts[arch]
        config = load_config(path)
        s0 = compute_sizing(config, tp, ep, quantization=kw.get("quantization"))
        gib = round(0.4 * s0.experts_per_gpu / (1 << 30), 9)
        s = compute_sizing(config, tp, ep, cpu_offload_gb=gib, quantization=kw.get("quantization"))
        for rank in range(tp):
            par = ParallelContext(rank, tp, None, ep)
            model = load_model(path, dtype=torch.bfloat16, parallel=par, expert_offload=ExpertOffloadConfig.from_gib(gib),
                               **kw)
            o = model.expert_offload
            host = sum(t.numel() * t.element_size() for m in model.moe_blocks() for t in m.experts.slot_tensors())
            assert host == s.experts_per_gpu, (arch, kw, rank)
            assert (o.num_experts, o.expert_bytes) == (s.local_experts, s.expert_share), (arch, kw, rank)
            assert o.staging_size == s.uncached_per_layer > 0, (arch, kw, rank)
            assert o.staging_size * o.expert_bytes == s.staging_bytes
            assert o.num_layers * o.staging_size * o.expert_bytes == s.offloaded_bytes
            assert o.pool_bytes == s.experts_per_gpu - s.offloaded_bytes + s.staging_bytes
    with pytest.raises(ValueError, match="more than the routed experts this rank holds"):
        load_model(ckpts["kimi_linear"], dtype=torch.bfloat16, parallel=ParallelContext(0, tp, None, ep),
                   quantization="fp8", expert_offload=ExpertOffloadConfig.from_gib(1.01 * s0.experts_per_gpu / (1 << 30)))


def test_a_pipeline_stage_without_moe_layers_offloads_nothing(ckpts):
    """PP with the first stage holding only K3's dense layer 0: that stage builds no pool (the budget is what the
    other stage offloads), the next one offloads from its MoE layers."""
    from kimik3.distributed import PipelineContext
    path = ckpts["kimi_k3"]
    L = load_config(path).text.num_hidden_layers
    ranges = ((0, 1), (1, L))
    cfg = ExpertOffloadConfig(3 * 1024)
    first = load_model(path, dtype=torch.float64, pipeline=PipelineContext(0, ranges), expert_offload=cfg)
    assert first.moe_blocks() == [] and first.expert_offload is None
    second = load_model(path, dtype=torch.float64, pipeline=PipelineContext(1, ranges), expert_offload=cfg)
    assert second.expert_offload is not None and second.expert_offload.num_layers == len(second.moe_blocks()) > 0
