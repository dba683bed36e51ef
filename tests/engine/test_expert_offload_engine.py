"""The engine with routed experts offloaded (the CPU path: host pool -> "device" pool, both CPU memory)
produces the tokens of the same engine with every expert resident, in every engine mode: chunked prefill,
preemption from a tiny cache, prefix hits, an abort, for K3's MXFP4 experts and Kimi-Linear's bf16 ones;
the hot set moves between steps (``refresh``) while it runs."""

from __future__ import annotations

import pytest
import torch

from kimik3.loader import load_model
from kimik3.model.expert_offload import ExpertOffloadConfig, expert_bytes
from tests.engine.helpers import make_engine, run
from tests.engine.test_real_model import _requests


@pytest.fixture(scope="module", params=[("kimi_k3", True, torch.float32), ("kimi_linear", False, torch.bfloat16)],
                ids=["k3-mxfp4", "kimi-linear-bf16"])
def models(request, tiny_ckpt):
    arch, packed, dtype = request.param
    resident = load_model(tiny_ckpt[arch], dtype=dtype, packed_experts=packed)
    moes = resident.moe_blocks()
    cfg = ExpertOffloadConfig(5 * len(moes) * expert_bytes(moes[0].experts), refresh_interval=1)   # 5 of 8 a layer
    return resident, load_model(tiny_ckpt[arch], dtype=dtype, packed_experts=packed, expert_offload=cfg)


@pytest.mark.parametrize("block_size,budget_tokens,extra_blocks", [(2, 6, 0), (3, 5, 30)],
                         ids=["B2-chunk6-preempt", "B3-chunk5-prefix"])
def test_offload_engine_tokens_equal_resident(models, block_size, budget_tokens, extra_blocks):
    resident, offloaded = models
    reqs = _requests(resident.config.text.vocab_size, seed=block_size)
    outputs = []
    for model in (resident, offloaded):
        engine = make_engine(model, block_size=block_size, max_num_seqs=4, max_num_batched_tokens=budget_tokens,
                             max_model_len=20, kda_checkpoint_interval=1, extra_blocks=extra_blocks)
        arrivals = {0: ["r0"], 8: ["r1", "r2", "r3", "r4"], 9: ["r5"]}
        outputs.append(run(engine, reqs, arrivals, aborts={12: ["r4"]}))
        if extra_blocks == 0:
            assert engine.scheduler.num_preemptions > 0
        else:
            assert engine.kv.num_hit_tokens > 0
    assert outputs[1] == outputs[0]
    o = offloaded.expert_offload
    assert o.refreshes > 0 and o.swapped > 0 and int(o.copies.sum()) > 0


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
    with pytest.raises(ValueError, match="more than the model's routed experts here"):
        LLM(path, cpu_offload_gb=1.0, **kw)
