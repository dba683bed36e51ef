"""EPLB rebalanced live on CPU ranks (gloo, float64): on a checkpoint whose routers favour two experts that the
even placement puts on one EP rank, ``rebalance_experts`` re-places every MoE layer from the loads recorded so far
and moves the expert weights between the ranks (point-to-point) between two steps. The logits before and after
equal the one-process ones, every slot then holds its expert's exact weights, and the max/mean of the ranks'
measured loads falls; under PP2 x TP2 the loads and the rebalance cover both stages' layers. Rank bodies live in
``ranks.py``."""

import pytest
import torch

from kimik3.engine import EngineConfig, LLMEngine
from kimik3.loader.load import load_model
from kimik3.model.eplb import identity_slots
from kimik3.testing import make_tiny_checkpoint
from tests.helpers import rel_err
from tests.parallel.ranks import (ENGINE_CONFIG, engine_prompts, pipeline_eplb_rank, rebalance_rank, run_engine, run_steps,
                                  skew_router, spawn)

ARCHS = ("kimi_k3", "kimi_linear")
LAYOUTS = {"ep2-eplb2": ("tep", 2), "ep2-a2a-eplb2": ("a2a", 2)}       # name: (MoE mode, redundant slots)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("eplb")
    out = {}
    for arch in ARCHS:
        out[arch] = make_tiny_checkpoint(d / arch, arch, seed=1, num_heads=4, **({"vision": False} if arch == "kimi_k3" else {}))
        skew_router(out[arch])
    return out


def test_live_rebalance_moves_experts_and_keeps_the_logits(ckpts, tmp_path, capsys):
    ones = {arch: load_model(path, dtype=torch.float64) for arch, path in ckpts.items()}
    reference = {arch: run_steps(model)[0] for arch, model in ones.items()}
    spawn(rebalance_rank, 2, {a: str(p) for a, p in ckpts.items()}, LAYOUTS, str(tmp_path / "out.pt"), timeout=300)
    results = torch.load(tmp_path / "out.pt", weights_only=False)
    lines = []
    for arch in ARCHS:
        E = ones[arch].config.text.num_experts
        whole = {i: moe.experts for i, moe in ones[arch].moe_layers().items()}
        for name in LAYOUTS:
            before, after, report, measured, per_rank = results[arch, name]
            for step, (a, b, ref) in enumerate(zip(before, after, reference[arch])):
                assert rel_err(a, ref) <= 1e-12 and rel_err(b, ref) <= 1e-12, (arch, name, step)
            assert sorted(report) == sorted(whole)
            moved = 0
            for i, experts in whole.items():
                slots = [x for held in per_rank for x in held[i][0]]
                assert sorted(set(slots)) == list(range(E)) and len(slots) == E + 2
                moved += sum(a != b for a, b in zip(slots, identity_slots(E, E + 2, 2)))
                for held in per_rank:                     # each slot holds its logical expert's weights, exactly
                    xs, w13, w2 = held[i]
                    for j, x in enumerate(xs):
                        assert torch.equal(w13[j], experts.w13[x]) and torch.equal(w2[j], experts.w2[x]), (arch, i, j, x)
                now = max(measured[i]) * 2 / sum(measured[i])
                lines.append(f"{arch} {name} layer {i}: max/mean {report[i][0]:.3f} -> planned {report[i][1]:.3f}, "
                             f"measured {now:.3f}")
            assert moved > 0
            assert sum(max(m) * 2 / sum(m) for m in measured.values()) < sum(r[0] for r in report.values()) - 0.2, \
                (arch, name, report, measured)
    with capsys.disabled():
        print("\n" + "\n".join(lines))


def test_rebalance_and_loads_cover_every_pipeline_stage(ckpts, tmp_path):
    """PP2 x TP2 x EP with EPLB through the engine: the recorded loads of both stages' MoE layers reach rank 0 (what
    ``LLM.save_expert_loads`` writes), a live rebalance re-places every stage's layers, and the greedy tokens before
    and after equal the one-process engine's."""
    path = ckpts["kimi_k3"]
    model = load_model(path, dtype=torch.float64)
    want = run_engine(LLMEngine(model, EngineConfig(**ENGINE_CONFIG)), engine_prompts(model.config.text.vocab_size)[0])[0]
    spawn(pipeline_eplb_rank, 4, str(path), str(tmp_path / "out.pt"), timeout=300)
    before, loads, report, after = torch.load(tmp_path / "out.pt", weights_only=False)
    assert before == want and after == want
    moe = sorted(model.moe_layers())
    assert sorted(loads) == moe and sorted(report) == moe
    E, k = model.config.text.num_experts, model.config.text.num_experts_per_token
    totals = {sum(load) for load, _ in loads.values()}
    assert len(totals) == 1 and totals.pop() % k == 0                  # every layer saw the same tokens, k each
    assert all(len(slots) == E + 2 and sorted(set(slots)) == list(range(E)) for _, slots in loads.values())
