"""Decode graphs through the parallel runner on one GPU: expert parallelism over a one-rank NCCL group.
At one rank the model's collectives are no-ops, so this checks the parallel capture path (rank 0's
``ParallelRunner.capture_graphs``, the ranks' agreement, graph steps through the lock-step runner) on
CUDA, not collectives inside a graph: those need a second GPU (tests/parallel runs them with gloo on
CPU ranks, the graphs as eager stand-ins)."""

from __future__ import annotations

import pytest
import torch

from kimik3.config import load_config
from kimik3.engine import LLM
from kimik3.testing import make_tiny_checkpoint
from tests.gpu.test_engine_graphs import assert_same_greedy, generate, requests

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _generate(path, reqs, **kwargs):
    with LLM(str(path), dtype=torch.bfloat16, device="cuda", max_model_len=512, max_num_seqs=8,
             max_num_batched_tokens=256, kv_cache_memory_bytes=1 << 28, **kwargs) as llm:
        out = generate(llm.engine, reqs)
        runner = llm.engine.runner
        return out, runner.graphs is not None, runner.num_graph_steps


def test_one_rank_expert_parallel_graphs_match_eager(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "k3", "kimi_k3", seed=2, num_heads=4, vision=False)
    reqs = requests(load_config(path).text.vocab_size)
    graphed, captured, steps = _generate(path, reqs, enable_expert_parallel=True, enforce_eager=False)
    eager, _, eager_steps = _generate(path, reqs, enable_expert_parallel=True, enforce_eager=True)
    plain, _, _ = _generate(path, reqs, enforce_eager=True)
    assert captured and steps > 0 and eager_steps == 0
    assert_same_greedy(eager, graphed, reqs)
    assert_same_greedy(plain, eager, reqs)
