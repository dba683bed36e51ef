"""Per-GPU sizing against the spec's tables (parallelism.md §6.2-6.5)."""

import json
from pathlib import Path

import pytest

from kimik3.config import parse_config
from kimik3.sizing import compute_sizing

RELEASE = Path(__file__).resolve().parent / "data" / "kimi-k3-release.config.json"
GIB = 1 << 30


@pytest.fixture(scope="module")
def text_only():
    data = json.loads(RELEASE.read_text())
    del data["vision_config"]             # the spec's tables count the text model only
    return parse_config(data, "release (text only)")


@pytest.mark.parametrize("tp,ep,gib,fits", [(8, 1, 191.0, False), (16, 16, 100.8, True), (32, 32, 55.8, True)])
def test_weights_per_gpu_match_the_spec_table(text_only, tp, ep, gib, fits):
    s = compute_sizing(text_only, tp, ep)
    assert s.weights_per_gpu / GIB == pytest.approx(gib, abs=0.15)
    assert s.fits is fits


def test_cache_budget_and_capacity_at_tp16_ep16(text_only):
    s = compute_sizing(text_only, 16, 16)
    assert s.cache_budget / GIB == pytest.approx(22.4, abs=0.15)
    assert s.kv_bytes_per_token == 27_648 and s.state_bytes_per_seq / (1 << 20) == pytest.approx(26.8, abs=0.05)
    assert (s.sequences(32768), s.sequences(131072), s.sequences(1 << 20)) == (25, 6, 0)


def test_degrees_must_divide_heads_and_experts(text_only):
    with pytest.raises(ValueError, match="must divide the KDA heads"):
        compute_sizing(text_only, 7, 1)
    with pytest.raises(ValueError, match="must divide num_experts"):
        compute_sizing(text_only, 8, 48)


def test_rank_cache_is_planned_with_local_kda_heads(text_only):
    """Under TP a KDA state slot holds only the rank's heads (the MLA latent stays whole): the
    engine plans with the rank's sizes, so K3 at TP16 is not limited by 16x too large states."""
    import torch

    from kimik3.model.batch import HybridCache
    from kimik3.model.kimi_k3 import KimiForCausalLM
    from kimik3.distributed import ParallelContext

    with torch.device("meta"):
        model = KimiForCausalLM(text_only, ParallelContext(tp_rank=3, tp_size=16))
    local = model.cache_text_config
    assert local.kda.num_heads == 6
    dt = torch.bfloat16
    assert HybridCache.bytes_per_slot(local, dt) * 16 == HybridCache.bytes_per_slot(text_only.text, dt)
    assert HybridCache.bytes_per_block(local, 16, dt) == HybridCache.bytes_per_block(text_only.text, 16, dt)
