"""Pipeline parallelism on CPU ranks (gloo, float64): stages of contiguous decoder layers, the residual
stream (AttnRes blocks and partial, or the plain residual and its pending output) sent between stages;
PP2 and PP2 x TP2 (with EP) give the one-process logits, each stage caching only its layers; the stage
planner balances bytes and prefers attention-residual block starts. Rank bodies live in ``ranks.py``."""

import glob

import pytest
import torch

from kimik3.distributed import plan_stages
from kimik3.loader.load import load_model
from kimik3.testing import make_tiny_checkpoint
from tests.helpers import rel_err
from tests.parallel.ranks import pipeline_rank, run_steps, spawn

ARCHS = ("kimi_k3", "kimi_linear")
# name: (stages, expert parallel, the cut layer of two stages or None = planned); TP = world / stages
LAYOUTS = {
    2: {"pp2": (2, False, None), "pp2-cut1": (2, False, 1)},
    4: {"pp2xtp2": (2, False, None), "pp2xep2-cut4": (2, True, 4)},
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("pp")
    return {arch: make_tiny_checkpoint(d / arch, arch, seed=1, num_heads=4, **({"vision": False} if arch == "kimi_k3" else {}))
            for arch in ARCHS}


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_layouts_match_one_process(ckpts, tmp_path, world):
    reference = {arch: run_steps(load_model(path, dtype=torch.float64))[0] for arch, path in ckpts.items()}
    spawn(pipeline_rank, world, {a: str(p) for a, p in ckpts.items()}, LAYOUTS[world], str(tmp_path / "out.pt"),
          timeout=300)
    results = {}
    for f in glob.glob(str(tmp_path / "out.pt.rank*")):
        results.update(torch.load(f, weights_only=False))
    for arch in ARCHS:
        L = load_model(ckpts[arch], dtype=torch.float64).config.text.num_hidden_layers
        for name, (pp, _, cut) in LAYOUTS[world].items():
            logits, per_rank = results[arch, name]
            for step, (a, b) in enumerate(zip(logits, reference[arch])):
                assert rel_err(a, b) <= 1e-12, f"{arch} {name} step {step}: rel err {rel_err(a, b):.2e}"
            ranges = per_rank[0][1]
            assert ranges[0][0] == 0 and ranges[-1][1] == L and len(ranges) == pp
            if cut:
                assert ranges == ((0, cut), (cut, L))
            tp = world // pp
            for r, (layers, _) in enumerate(per_rank):      # each stage caches its own layers only
                lo, hi = ranges[r // tp]
                assert layers and all(lo <= i < hi for i in layers), (arch, name, r, layers)


def test_stage_planner_balances_bytes_and_prefers_block_starts():
    assert plan_stages([10] * 8, 2) == ((0, 4), (4, 8))
    assert plan_stages([30, 10, 10, 10, 10, 10, 10, 10], 2) == ((0, 3), (3, 8))
    # block size 3: the even cut (before layer 4) sends 2 blocks + the partial; before layer 3, one layer's
    # bytes off balance, 1 block + the partial. Block size 4: both send 1 block, the balanced cut stays
    assert plan_stages([10] * 8, 2, block_size=3) == ((0, 3), (3, 8))
    assert plan_stages([10] * 8, 2, block_size=4) == ((0, 4), (4, 8))
    assert plan_stages([10] * 9, 3) == ((0, 3), (3, 6), (6, 9))
    with pytest.raises(ValueError, match="pipeline parallel size 9"):
        plan_stages([10] * 8, 9)
