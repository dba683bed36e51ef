"""Pipeline micro-batches, EPLB's live rebalance and expert offload on 2 GPUs (NCCL), bf16, tiny K3: PP2 with one
and two micro-batches per step against one GPU; EP2 + EPLB with decode graphs, a live rebalance on a skewed load, the
same requests again (graphs kept: the weights and routing tables change in place); TP2 / EP2 / PP2 with
``--cpu-offload-gb`` (per GPU) and decode graphs against the same layout resident. Skipped with fewer than 2 GPUs; the
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


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, enable_expert_parallel=True),
                                    dict(pipeline_parallel_size=2)], ids=["tp2", "ep2", "pp2"])
def test_expert_offload_per_gpu_keeps_graphs_and_tokens(ckpt, tmp_path, layout):
    """``--cpu-offload-gb`` under TP2 (tiny Kimi-Linear) / EP2 / PP2 (tiny K3), a budget per GPU (30% of the
    experts each rank holds, as the planner counts them), decode graphs on (PP: eager): the same layout's resident
    tokens and logprobs, bit for bit."""
    from kimik3.sizing import compute_sizing
    if layout.get("tensor_parallel_size") and not layout.get("enable_expert_parallel"):
        # TP slices each expert's intermediate: the tiny K3's MXFP4 groups do not split, Kimi-Linear's bf16 do
        ckpt = make_tiny_checkpoint(tmp_path / "kl", "kimi_linear", seed=2, num_heads=4)
    reqs = requests(load_config(ckpt).text.vocab_size)
    tp, ep = layout.get("tensor_parallel_size", 1), 2 if layout.get("enable_expert_parallel") else 1
    pp = layout.get("pipeline_parallel_size", 1)
    gib = 0.3 * compute_sizing(load_config(ckpt), tp, ep).experts_per_gpu / pp / (1 << 30)   # PP: a stage's layers
    graphs = pp == 1                    # pipeline parallelism runs eager (arg_checks)
    with LLM(str(ckpt), enforce_eager=not graphs, **layout, **KW) as llm:
        want = generate(llm.engine, reqs)
    with LLM(str(ckpt), enforce_eager=not graphs, cpu_offload_gb=gib, **layout, **KW) as llm:
        runner = llm.engine.runner
        got = generate(llm.engine, reqs)
        assert (runner.graphs is not None and runner.num_graph_steps > 0) == graphs
        assert llm.engine.model.expert_offload.staging_size > 0
    assert got == want
