"""Expert offload on the CPU path (a "host" pool and a "device" pool, both CPU memory): logits equal the
fully resident model's bit for bit (MXFP4, dense and FP8 experts, K3 and Kimi-Linear, little to everything
offloaded, before and after the hot set moves), the hot set follows the router's counts, bad budgets are
clear errors."""

from __future__ import annotations

import pytest
import torch

from kimik3.loader import load_model
from kimik3.model.expert_offload import ExpertOffloadConfig, expert_bytes
from kimik3.model.offload_policy import MissRates

CASES = [("kimi_k3", True, torch.float32, None), ("kimi_k3", False, torch.float32, None),
         ("kimi_linear", False, torch.bfloat16, None), ("kimi_linear", False, torch.bfloat16, "fp8")]
IDS = ["k3-mxfp4", "k3-dense", "kimi-linear-bf16", "kimi-linear-fp8"]


def _per_layer_bytes(model) -> int:
    moes = model.moe_blocks()
    return len(moes) * expert_bytes(moes[0].experts)


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def resident(request, tiny_ckpt):
    arch, packed, dtype, quantization = request.param
    path, kw = tiny_ckpt[arch], {"packed_experts": packed, "quantization": quantization}
    model = load_model(path, dtype=dtype, **kw)
    assert all(m.experts.fp8 == (quantization == "fp8") for m in model.moe_blocks())   # FP8 experts: E4M3 + scales
    return path, kw, dtype, model


@pytest.mark.parametrize("experts_offloaded", [1, 3, 8])
def test_offloaded_logits_equal_resident(resident, experts_offloaded):
    path, kw, dtype, model = resident
    cfg = ExpertOffloadConfig(experts_offloaded * _per_layer_bytes(model), refresh_interval=1)
    off = load_model(path, dtype=dtype, **kw, expert_offload=cfg)
    o = off.expert_offload
    assert (o.cache_size, o.staging_size) == (8 - experts_offloaded, experts_offloaded)
    assert all(m.experts.w13.device.type == "cpu" for m in off.moe_blocks())
    ids = torch.randint(5, 200, (19,), generator=torch.Generator().manual_seed(experts_offloaded))
    want = model(ids)
    assert torch.equal(off(ids), want)
    assert int(o.copies.sum()) > 0                          # misses were staged from the host pool
    for _ in range(2):                                      # the hot set moves; still the same bits
        o.refresh()
        assert torch.equal(off(ids), want)
    if 0 < o.cache_size:
        assert o.swapped > 0


def test_hot_set_follows_the_router_counts(resident):
    path, kw, dtype, model = resident
    off = load_model(path, dtype=dtype, **kw,
                     expert_offload=ExpertOffloadConfig(5 * _per_layer_bytes(model), refresh_interval=1, decay=0.5))
    o = off.expert_offload
    assert o.cached[0] == [0, 1, 2]                         # before any routing: experts 0..S-1
    o.counts.zero_()
    o.counts[0, [7, 4, 1]] = torch.tensor([9.0, 5.0, 3.0])  # layer 0 routes to 7, 4, 1; layer 1 to 6, 5, 0
    o.counts[1, [6, 5, 0]] = torch.tensor([1.0, 2.0, 1.0])
    o.refresh()
    assert set(o.cached[0]) == {7, 4, 1} and set(o.cached[1]) == {6, 5, 0}
    assert o.cached[0][1] == 1                              # a cached expert that stays keeps its row
    o.counts[0, 2] = 1.8                                    # 2 against 1 (3 x 0.5 decayed): within the margin
    o.refresh()
    assert set(o.cached[0]) == {7, 4, 1}
    o.counts[0, 2] = 12.0                                   # traffic shifts: 2 (12.9) beats 1 (0.75)
    o.refresh()
    assert set(o.cached[0]) == {7, 4, 2}
    for i, m in enumerate(off.moe_blocks()):                # the pool rows and tables agree with the host
        slots = o.slots[i].tolist()
        for e in range(8):
            for k in o.kinds:
                if e in o.cached[i]:
                    assert slots[e] == i * 3 + o.cached[i].index(e)
                    assert torch.equal(o.pool[k][slots[e]], getattr(m.experts, k)[e])
                else:
                    assert slots[e] == o.num_layers * 3 + o.staged_host[i].index(e)
        assert o.staged[i].tolist() == o.staged_host[i]


def test_bad_budgets_are_clear_errors(tiny_ckpt):
    from kimik3.engine.args import EngineArgs
    with pytest.raises(ValueError, match="cpu_offload_gb must be a number of GiB >= 0"):
        ExpertOffloadConfig.from_gib(-1)
    with pytest.raises(ValueError, match="cpu_offload_gb must be a number of GiB >= 0"):
        EngineArgs(cpu_offload_gb=-0.5)
    with pytest.raises(ValueError, match="more than the model's routed experts here"):
        load_model(tiny_ckpt["kimi_k3"], expert_offload=ExpertOffloadConfig.from_gib(1.0))
    for layout in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}, {"enable_expert_parallel": True}):
        assert EngineArgs(cpu_offload_gb=1, **layout).expert_offload_config().cpu_offload_bytes == 1 << 30   # per GPU
    with pytest.raises(ValueError, match="cpu_offload_gb with --enable-eplb is not supported"):
        EngineArgs(cpu_offload_gb=1, tensor_parallel_size=2, enable_expert_parallel=True,
                   enable_eplb=True).expert_offload_config()
    assert EngineArgs(cpu_offload_gb=0).expert_offload_config() is None
    assert EngineArgs(cpu_offload_gb=1, expert_offload_policy="host").expert_offload_config().policy == "host"
    with pytest.raises(ValueError, match="expert_offload_policy must be one of"):
        EngineArgs(cpu_offload_gb=1, expert_offload_policy="fastest")
    with pytest.raises(ValueError, match="needs cpu_offload_gb > 0"):
        EngineArgs(expert_offload_policy="prefetch")


@pytest.mark.parametrize("policy,source", [("prefetch", "router"), ("prefetch", "previous_step"),
                                           ("prefetch", "both"), ("host", "router")])
def test_prefetch_and_host_compute_equal_resident(resident, policy, source):
    """Prefetch (predicted experts copied before routing, the rest after) and host compute (the uncached
    experts' rows computed from the host pool) give the resident logits bit for bit, at batch sizes whose
    prediction is partial (1-3 tokens of top-2 of 8) and complete (19 tokens: every uncached expert)."""
    path, kw, dtype, model = resident
    slow_copy = MissRates(copy=1e3, host_sync=0.0)      # rates under which the host wins at every batch size
    cfg = ExpertOffloadConfig(5 * _per_layer_bytes(model), refresh_interval=1, policy=policy, prefetch_from=source,
                              rates=slow_copy if policy == "host" else None)
    off = load_model(path, dtype=dtype, **kw, expert_offload=cfg)
    o = off.expert_offload
    g = torch.Generator().manual_seed(3)
    for T in (1, 3, 2, 19, 1):
        ids = torch.randint(5, 200, (T,), generator=g)
        assert torch.equal(off(ids), model(ids)), T
        assert o.mode == policy
        o.refresh()
    s = o.stats()
    if policy == "prefetch":
        assert s["prefetched_experts"] > 0 and 0 < s["prefetched_used"] <= s["prefetched_experts"]
        assert s["host_pairs"] == 0
        if source == "previous_step":      # the first step had nothing to predict from: all copied after routing
            assert s["staged_experts"] > 0
    else:
        assert s["host_pairs"] > 0 and s["staged_experts"] == 0 and s["prefetched_experts"] == 0


def test_prefetch_copies_the_predicted_experts_of_its_layer(resident):
    """A prefetch for layer i copies layer i's predicted uncached experts (host rows) into their staging rows
    and leaves the others alone; only layer i's staging reads it, once."""
    path, kw, dtype, model = resident
    cfg = ExpertOffloadConfig(5 * _per_layer_bytes(model), policy="prefetch", prefetch_from="previous_step")
    off = load_model(path, dtype=dtype, **kw, expert_offload=cfg)
    o, i = off.expert_offload, 1
    for k in o.kinds:
        o.pool[k][o.num_layers * o.cache_size:].zero_()
    o.last_used[i, [0, 3, 6]] = True              # 0 is cached (experts 0..2), 3 and 6 are not
    o.prefetch(i, None, tokens=1)
    assert o.take_prefetch(0) is None             # another layer's staging does not read it
    host = off.moe_blocks()[i].experts
    for e in range(8):
        row = o.num_layers * o.cache_size + o.staged_host[i].index(e) if e >= 3 else None
        for k in o.kinds:
            if row is not None:
                want = getattr(host, k)[e] if e in (3, 6) else torch.zeros_like(getattr(host, k)[e])
                assert torch.equal(o.pool[k][row], want), (e, k)
    assert o.take_prefetch(i).tolist() == [e in (0, 3, 6) for e in range(8)]
    assert o.take_prefetch(i) is None             # read once
    assert int(o.prefetched[i]) == 2


def test_policy_and_predictor_names_are_checked():
    with pytest.raises(ValueError, match="expert_offload_policy must be one of"):
        ExpertOffloadConfig(0, policy="fastest")
    with pytest.raises(ValueError, match="prefetch_from must be one of"):
        ExpertOffloadConfig(0, prefetch_from="oracle")
