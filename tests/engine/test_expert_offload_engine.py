"""The engine with routed experts offloaded (the CPU path: host pool -> "device" pool, both CPU memory)
produces the tokens of the same engine with every expert resident, in every engine mode: chunked prefill,
preemption from a tiny cache, prefix hits, an abort, n-gram speculation, for K3's MXFP4 experts and Kimi-Linear's bf16 ones, with
each miss strategy (copy after routing, prefetch, host compute, and the policy mixing host compute for one
token with prefetch for more); the hot set moves between steps (``refresh``) while it runs."""

from __future__ import annotations

import pytest
import torch

from kimik3.loader import load_model
from kimik3.model.expert_offload import ExpertOffloadConfig, expert_bytes
from kimik3.model.offload_policy import MissRates
from kimik3.engine import SamplingParams
from tests.engine.helpers import make_engine, run
from tests.engine.test_real_model import _requests


def mixed_rates(experts) -> MissRates:
    """Rates under which (5 of 8 experts offloaded, top-2) one token's misses are computed on the host and two or
    more tokens' prefetched: a pair on the host costs 0.8 of an expert's copy, a prefetch hides 10% of its copies."""
    c = expert_bytes(experts) / 1e9
    pair_flops = 6 * experts.w2.shape[1] * (experts.w13.shape[1] // 2)
    return MissRates(copy=1e9, host_bytes=1e18, host_flops=pair_flops / (0.8 * c), host_sync=0.0, layer_seconds=1.0,
                     prefetch_accuracy=0.1)


POLICIES = {"copy": {"policy": "copy"}, "prefetch": {"policy": "prefetch", "prefetch_from": "both"},
            "host": {"policy": "host", "rates": MissRates(copy=1e3, host_sync=0.0)}, "auto-mixed": {"policy": "auto"}}


@pytest.fixture(scope="module", params=[(a, p) for a in ("k3-mxfp4", "kimi-linear-bf16") for p in POLICIES],
                ids=lambda v: f"{v[0]}-{v[1]}")
def models(request, tiny_ckpt):
    name, policy = request.param
    arch, packed, dtype = {"k3-mxfp4": ("kimi_k3", True, torch.float32),
                           "kimi-linear-bf16": ("kimi_linear", False, torch.bfloat16)}[name]
    resident = load_model(tiny_ckpt[arch], dtype=dtype, packed_experts=packed)
    moes = resident.moe_blocks()
    kw = dict(POLICIES[policy])
    if policy == "auto-mixed":
        kw["rates"] = mixed_rates(moes[0].experts)
    cfg = ExpertOffloadConfig(5 * len(moes) * expert_bytes(moes[0].experts), refresh_interval=1, **kw)  # 5 of 8 a layer
    offloaded = load_model(tiny_ckpt[arch], dtype=dtype, packed_experts=packed, expert_offload=cfg)
    if policy == "auto-mixed":
        p = offloaded.expert_offload.policy
        assert [p.choose(t) for t in (1, 2, 6)] == ["host", "prefetch", "prefetch"]
    return resident, offloaded, policy


@pytest.mark.parametrize("block_size,budget_tokens,extra_blocks,spec", [(2, 6, 0, 0), (3, 5, 30, 0), (2, 12, 30, 2)],
                         ids=["B2-chunk6-preempt", "B3-chunk5-prefix", "B2-ngram-spec2"])
def test_offload_engine_tokens_equal_resident(models, block_size, budget_tokens, extra_blocks, spec):
    resident, offloaded, policy = models
    reqs = _requests(resident.config.text.vocab_size, seed=block_size)
    kw = dict(max_model_len=20, kda_checkpoint_interval=1)
    if spec:                           # prompts of repeated n-grams, checkpoints far apart: decode steps draft
        reqs = {r: ((p * 3)[:14], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
                for r, (p, _) in reqs.items()}
        kw = dict(max_model_len=48, kda_checkpoint_interval=8, num_speculative_tokens=spec, speculative_ngram_min=1,
                  speculative_ngram_max=3)
    outputs = []
    for model in (resident, offloaded):
        engine = make_engine(model, block_size=block_size, max_num_seqs=4, max_num_batched_tokens=budget_tokens,
                             extra_blocks=extra_blocks, **kw)
        arrivals = {0: ["r0"], 8: ["r1", "r2", "r3", "r4"], 9: ["r5"]}
        outputs.append(run(engine, reqs, arrivals, aborts={12: ["r4"]}))
        if spec:                       # verify steps: several tokens a sequence
            assert engine.num_drafts > 0
            continue
        if extra_blocks == 0:
            assert engine.scheduler.num_preemptions > 0
        else:
            assert engine.kv.num_hit_tokens > 0
    assert outputs[1] == outputs[0]
    o = offloaded.expert_offload
    s = o.stats()
    assert o.refreshes > 0 and o.swapped > 0
    assert (s["staged_experts"] > 0) == (policy != "host")        # copied after routing: all but host compute
    assert (s["prefetched_used"] > 0) == (policy in ("prefetch", "auto-mixed"))
    assert (s["host_pairs"] > 0) == (policy in ("host", "auto-mixed"))


def test_llm_takes_cpu_offload_gb(tiny_ckpt):
    """``LLM(cpu_offload_gb=...)`` (``--cpu-offload-gb``) reaches the loader: the same tokens as without, the
    experts in host memory with a GPU-side cache; a budget larger than the model's experts is an error
    naming the most it can be."""
    from kimik3.engine import LLM, SamplingParams
    path = str(tiny_ckpt["kimi_k3"])
    kw = dict(device="cpu", dtype=torch.float32, block_size=4, max_num_seqs=4, max_model_len=32, seed=0)
    prompts = [{"prompt_token_ids": [11, 12, 13, 14, 15]}, {"prompt_token_ids": [20, 21, 22]}]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, **kw).generate(prompts, params)]
    llm = LLM(path, cpu_offload_gb=1e-4, **kw)               # ~105 KB: a few experts of each layer
    o = llm.engine.model.expert_offload
    assert o is not None and 0 < o.staging_size < o.num_experts
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    llm = LLM(path, cpu_offload_gb=1e-4, expert_offload_policy="prefetch", **kw)
    o = llm.engine.model.expert_offload
    assert o.policy.name == "prefetch"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.model.expert_offload.stats()["prefetched_experts"] > 0
    with pytest.raises(ValueError, match="more than the model's routed experts here"):
        LLM(path, cpu_offload_gb=1.0, **kw)
