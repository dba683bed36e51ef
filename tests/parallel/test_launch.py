"""The offline API under TP (spawned worker, rank 0 = the calling process) and failure handling:
a worker that dies takes the group down with a clear error instead of hanging."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from kimik3.testing import make_tiny_checkpoint

SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    from kimik3.engine import LLM, SamplingParams
    llm = LLM(sys.argv[1], tensor_parallel_size=2, enable_expert_parallel=sys.argv[2] == "ep",
              dtype=torch.float64, device="cpu", max_model_len=64, max_num_batched_tokens=8, block_size=4,
              kv_cache_memory_bytes=1 << 22)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    if sys.argv[3] == "kill":
        llm.parallel_group.processes[0].kill()
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]}], params)
    print("TOKENS", json.dumps(outs[0].outputs[0].token_ids), flush=True)
    llm.close()
""")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("launch"), "kimi_k3", seed=2, num_heads=4, vision=False)


def _run(ckpt, layout, action, timeout=120):
    return subprocess.run([sys.executable, "-c", SCRIPT, str(ckpt), layout, action], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_llm_with_tensor_parallel_matches_one_process(ckpt, layout):
    from kimik3.engine import LLM, SamplingParams
    llm = LLM(str(ckpt), dtype=torch.float64, device="cpu", max_model_len=64, max_num_batched_tokens=8,
              block_size=4, kv_cache_memory_bytes=1 << 22)
    want = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]}],
                        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0].outputs[0].token_ids
    res = _run(ckpt, layout, "run")
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("TOKENS"))
    assert json.loads(line.split(" ", 1)[1]) == want


def test_dead_worker_takes_the_group_down_with_a_clear_error(ckpt):
    res = _run(ckpt, "tp", "kill", timeout=90)
    assert res.returncode == 1
    assert "tensor-parallel worker rank 1" in res.stderr and "stopping all ranks" in res.stderr
