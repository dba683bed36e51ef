"""Expert offload's miss policy (``kimik3.model.offload_policy``): the per-layer costs against hand-computed cases,
the choice per batch size (fixed policies, graphs never on the host, host compute on a GPU only when asked),
the decision table it logs, bad rates as clear errors."""

from __future__ import annotations

import logging

import pytest

from kimik3.model.offload_policy import LayerShape, MissPolicy, MissRates, miss_costs, predicts_all, used_share

# K3's expert (MXFP4, 17,547,264 B) on one GPU with 60% of 896 experts a layer offloaded
K3 = LayerShape(num_experts=896, top_k=16, uncached=538, expert_bytes=17_547_264, pair_flops=6 * 3584 * 3072)
RATES = MissRates(copy=25e9, host_bytes=60e9, host_flops=1e12, host_sync=40e-6, layer_seconds=5e-3,
                  prefetch_accuracy=0.6)


def test_costs_by_hand():
    p = 1 - (1 - 16 / 896) ** 1                         # batch 1: each expert used with probability k/E
    assert used_share(K3, 1) == pytest.approx(16 / 896)
    m, c = 538 * p, 17_547_264 / 25e9                   # 9.61 missed experts, 0.70 ms each
    costs = miss_costs(K3, RATES, 1)
    assert costs["copy"] == pytest.approx(m * c)
    assert costs["prefetch"] == pytest.approx(max(0.0, m * c - 5e-3) + 0.4 * m * c)
    pairs = 16 * 538 / 896
    assert costs["host"] == pytest.approx(40e-6 + m * 17_547_264 / 60e9 + pairs * 6 * 3584 * 3072 / 1e12)
    # 256 tokens cover > 90% of the experts: the prefetch names every uncached expert
    assert not predicts_all(K3, 64) and predicts_all(K3, 256)
    assert miss_costs(K3, RATES, 256)["prefetch"] == pytest.approx(538 * c - 5e-3)
    nothing = LayerShape(896, 16, 0, 17_547_264, 1.0)
    assert miss_costs(nothing, RATES, 8) == {"copy": 0.0, "prefetch": 0.0, "host": 0.0}


def test_choice_per_batch_size():
    fixed = MissPolicy("prefetch", K3, RATES, host_exact=False)
    assert {fixed.choose(t) for t in (1, 8, 512)} == {"prefetch"}
    # the host reads at 60 GB/s vs copies at 25 (a prefetch hides 5 ms of them): the host wins one token's
    # misses when it may; graphs never compute on the host
    auto = MissPolicy("auto", K3, RATES, host_exact=False)
    host = MissPolicy("host", K3, RATES, host_exact=False)
    cpu = MissPolicy("auto", K3, RATES, host_exact=True)
    c1 = miss_costs(K3, RATES, 1)
    assert c1["host"] < c1["prefetch"] < c1["copy"]
    assert auto.choose(1) == "prefetch" and host.choose(1) == "host" and cpu.choose(1) == "host"
    assert host.choose(1, graph=True) == "prefetch" and cpu.choose(1, graph=True) == "prefetch"
    # many tokens: the host's FLOPs grow with the pairs, the copies do not
    assert host.choose(512) != "host"
    # little overlap against the wasted copies of a poor prediction: copying after routing is cheaper
    blind = MissPolicy("auto", K3, MissRates(copy=25e9, layer_seconds=0.4e-3, prefetch_accuracy=0.6), host_exact=False)
    assert blind.choose(1) == "copy" and blind.choose(512) == "prefetch"     # 512 tokens: every expert, ahead


def test_the_decisions_are_logged(caplog):
    text = MissPolicy("host", K3, RATES, host_exact=False).describe(batches=(1, 32))
    assert text.startswith("expert offload policy host (assumed rates: copy 25.0 GB/s")
    assert "1 tokens: prefetch in graphs, host eager" in text and "assumed prefetch accuracy 60%" in text
    assert "32 tokens:" in text and "ms a layer" in text


@pytest.mark.parametrize("field,value,match", [("copy", 0.0, "positive rate"), ("host_flops", float("inf"), "positive"),
                                               ("host_sync", -1e-6, "seconds >= 0"),
                                               ("prefetch_accuracy", 1.5, "lie in \\[0, 1\\]")])
def test_bad_rates_are_clear_errors(field, value, match):
    with pytest.raises(ValueError, match=match):
        MissRates(**{field: value})
    with pytest.raises(ValueError, match="policy must be one of"):
        MissPolicy("fastest", K3, RATES, host_exact=False)


def test_the_offload_logs_its_policy(tiny_ckpt, caplog):
    from kimik3.loader import load_model
    from kimik3.model.expert_offload import ExpertOffloadConfig, expert_bytes
    model = load_model(tiny_ckpt["kimi_linear"])
    per = len(model.moe_blocks()) * expert_bytes(model.moe_blocks()[0].experts)
    with caplog.at_level(logging.INFO, logger="kimik3.model.expert_offload"):
        off = load_model(tiny_ckpt["kimi_linear"], expert_offload=ExpertOffloadConfig(3 * per, policy="auto"))
    assert off.expert_offload.policy.shape == LayerShape(8, 2, 3, per / len(model.moe_blocks()),
                                                         6.0 * 48 * 24)
    assert any("expert offload policy auto (assumed rates" in r.getMessage() for r in caplog.records)
