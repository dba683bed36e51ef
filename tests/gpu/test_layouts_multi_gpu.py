"""Pipeline micro-batches and EPLB's live rebalance on 2 GPUs (NCCL), bf16, tiny K3: PP2 with one and two
micro-batches per step against one GPU; EP2 + EPLB with decode graphs, a live rebalance on a skewed load, the same
requests again (graphs kept: the weights and routing tables change in place). Skipped with fewer than 2 GPUs; the
same layouts run in float64 on CPU ranks in tests/parallel."""

from __future__ import annotations

import pytest
import torch

from kimik3.config import load_config
from kimik3.engine import LLM
from kimik3.testing import make_tiny_checkpoint
from tests.gpu.test_engine_graphs import assert_same_greedy, generate, requests
from tests.parallel.ranks import skew_router

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs 2 GPUs")]
KW = dict(dtype=torch.bfloat16, device="cuda", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256,
          kv_cache_memory_bytes=1 << 28)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("layouts") / "k3", "kimi_k3", seed=2, num_heads=4, vision=False)
    skew_router(path)
    return path


def test_pp2_micro_batches_match_one_gpu(ckpt):
    reqs = requests(load_config(ckpt).text.vocab_size)
    with LLM(str(ckpt), enforce_eager=True, **KW) as llm:
        want = generate(llm.engine, reqs)
    for micro in (1, 2):
        with LLM(str(ckpt), pipeline_parallel_size=2, pp_micro_batches=micro, **KW) as llm:
            assert_same_greedy(want, generate(llm.engine, reqs), reqs)


def test_eplb_live_rebalance_keeps_graphs_and_tokens(ckpt):
    reqs = requests(load_config(ckpt).text.vocab_size)
    with LLM(str(ckpt), tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
             num_redundant_experts=2, enforce_eager=False, **KW) as llm:
        runner = llm.engine.runner
        before = generate(llm.engine, reqs)
        steps = runner.num_graph_steps
        report = llm.rebalance_experts()
        after = generate(llm.engine, reqs)
        print({i: f"{a:.3f} -> {b:.3f}" for i, (a, b) in report.items()})
        assert runner.graphs is not None and runner.num_graph_steps > steps > 0
    assert sum(b for _, b in report.values()) < sum(a for a, _ in report.values())
    assert_same_greedy(before, after, reqs)
