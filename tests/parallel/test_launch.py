"""The offline API under TP (spawned worker, rank 0 = the calling process) and failure handling:
a worker that dies takes the group down with a clear error instead of hanging."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kimik3.testing import make_tiny_checkpoint

SCRIPT = textwrap.dedent("""
    import json, logging, os, sys, torch
    from kimik3.engine import LLM, SamplingParams
    eplb = dict(enable_eplb=True, num_redundant_experts=2) if sys.argv[2] == "ep" else {}
    # --cpu-offload-gb per GPU: ~107 KB of each rank's expert slices (2 of 8 a layer); workers log their pools
    offload = dict(cpu_offload_gb=1e-4, expert_offload_policy="copy") if sys.argv[2] == "offload" else {}
    if offload:
        logging.basicConfig(level=logging.INFO)
    layout = {"pp": dict(tensor_parallel_size=1, pipeline_parallel_size=2),
              "pptp": dict(tensor_parallel_size=2, pipeline_parallel_size=2)}.get(sys.argv[2],
                                                                                   dict(tensor_parallel_size=2))
    llm = LLM(sys.argv[1], **layout, enable_expert_parallel=sys.argv[2] == "ep", **eplb, **offload,
              decode_context_parallel_size=2 if sys.argv[2] == "dcp" else 1, language_model_only=sys.argv[2] == "dcp",
              dtype=torch.float64, device="cpu",
              max_model_len=64, max_num_batched_tokens=8, block_size=4, kv_cache_memory_bytes=1 << 22)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    if sys.argv[3] == "kill":
        llm.parallel_group.processes[0].kill()
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]}], params)
    print("TOKENS", json.dumps(outs[0].outputs[0].token_ids), flush=True)
    print("VISION", hasattr(llm.engine.model, "vision"), flush=True)
    if offload:
        print("OFFLOAD", json.dumps(llm.engine.model.expert_offload.stats()), flush=True)
    if eplb:
        report = llm.save_expert_loads(os.path.join(os.path.dirname(sys.argv[1]), "loads.json"))
        print("EPLB", json.dumps({k: list(v) for k, v in report.items()}), flush=True)
        moved = llm.rebalance_experts()
        print("MOVED", json.dumps({k: list(v) for k, v in moved.items()}), flush=True)
        outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]}], params)
        print("AGAIN", json.dumps(outs[0].outputs[0].token_ids), flush=True)
    llm.close()
    if eplb:                # a new group placed at start-up from the recorded load file
        llm = LLM(sys.argv[1], **layout, enable_expert_parallel=True, **eplb, dtype=torch.float64, device="cpu",
                  eplb_load_file=os.path.join(os.path.dirname(sys.argv[1]), "loads.json"),
                  max_model_len=64, max_num_batched_tokens=8, block_size=4, kv_cache_memory_bytes=1 << 22)
        outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]}], params)
        print("FILE", json.dumps(outs[0].outputs[0].token_ids), flush=True)
        print("SLOTS", json.dumps({i: m.placement.slots for i, m in llm.engine.model.moe_layers().items()}), flush=True)
        llm.close()
    if len(sys.argv) > 4:   # the same layout on the Kimi-Linear checkpoint in this spawn (KDA + MLA layers)
        llm = LLM(sys.argv[4], **layout, enable_expert_parallel=sys.argv[2] == "ep", **eplb,
                  decode_context_parallel_size=2 if sys.argv[2] == "dcp" else 1, dtype=torch.float64, device="cpu",
                  max_model_len=64, max_num_batched_tokens=8, block_size=4, kv_cache_memory_bytes=1 << 22)
        outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]}], params)
        print("LINEAR", json.dumps(outs[0].outputs[0].token_ids), flush=True)
        llm.close()
""")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("launch"), "kimi_k3", seed=2, num_heads=4)


@pytest.fixture(scope="module")
def linear_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("launch-linear"), "kimi_linear", seed=2, num_heads=4)


def _run(ckpt, layout, action, timeout=120, linear=None):
    return subprocess.run([sys.executable, "-c", SCRIPT, str(ckpt), layout, action, *([str(linear)] if linear else [])],
                          capture_output=True, text=True, timeout=timeout)


def _greedy(ckpt):
    from kimik3.engine import LLM, SamplingParams
    llm = LLM(str(ckpt), dtype=torch.float64, device="cpu", max_model_len=64, max_num_batched_tokens=8,
              block_size=4, kv_cache_memory_bytes=1 << 22)
    return llm, llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]}],
                             SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0].outputs[0].token_ids


# "+kimi-linear": the same layout on the Kimi-Linear checkpoint too, a second LLM in the same spawn. Plain TP2
# through LLM: test_two_tensor_parallel_llms_one_after_the_other (its tokens) and tp2-cpu-offload (rank 0's vision)
@pytest.mark.parametrize("layout,arch", [("ep", "kimi_k3+kimi_linear"), ("dcp", "kimi_k3+kimi_linear"),
                                         ("pp", "kimi_k3"), ("pptp", "kimi_linear"), ("offload", "kimi_k3")],
                         ids=["ep2-eplb+kimi-linear", "tp2-dcp2+kimi-linear", "pp2", "kimi-linear-pp2xtp2",
                              "tp2-cpu-offload"])
def test_llm_with_tensor_parallel_matches_one_process(ckpt, linear_ckpt, layout, arch):
    if "+" in arch:
        _, want_linear = _greedy(linear_ckpt)
    ckpt = linear_ckpt if arch == "kimi_linear" else ckpt
    llm, want = _greedy(ckpt)
    res = _run(ckpt, layout, "run", timeout=240, linear=linear_ckpt if "+" in arch else None)
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("TOKENS"))
    assert json.loads(line.split(" ", 1)[1]) == want
    if "+" in arch:     # the Kimi-Linear LLM of this layout: the one-process tokens of its checkpoint
        line = next(ln for ln in res.stdout.splitlines() if ln.startswith("LINEAR"))
        assert json.loads(line.split(" ", 1)[1]) == want_linear
    # the checkpoint has a vision tower: rank 0 (stage 0) holds it, but for language_model_only (with DCP)
    assert f"VISION {layout != 'dcp' and arch.startswith('kimi_k3')}" in res.stdout
    if layout == "offload":     # LLM -> build_engine -> every rank's loader: each offloads 2 of its 8 slices a layer
        stats = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("OFFLOAD")).split(" ", 1)[1])
        assert stats["host_experts_per_layer"] == 2 and stats["staged_experts"] > 0 and stats["refreshes"] > 0
        assert "[rank 1] kimik3.model.expert_offload: expert offload: 6 of 8 experts a layer cached" in res.stderr
    if layout == "ep":          # with EPLB: the recorded loads of every MoE layer, and the balance they give
        from kimik3.model.eplb import read_loads
        report = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("EPLB")).split(" ", 1)[1])
        text = llm.engine.model.config.text
        layers = [i for i in range(text.num_hidden_layers) if text.is_moe_layer(i)]
        loads = read_loads(ckpt.parent / "loads.json", text.num_experts, layers)
        assert sorted(loads) == layers and all(sum(v) > 0 for v in loads.values())
        # the placement planned from the recorded loads evens the ranks out (the greedy plan, on average)
        assert sum(a for _, a in report.values()) < sum(n for n, _ in report.values()), report
        # a live rebalance to that placement: the loads measured so far fall as planned, the tokens stay
        moved = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("MOVED")).split(" ", 1)[1])
        assert sorted(int(i) for i in moved) == layers
        assert [v[1] for v in moved.values()] == pytest.approx([v[1] for v in report.values()])
        again = next(ln for ln in res.stdout.splitlines() if ln.startswith("AGAIN"))
        assert json.loads(again.split(" ", 1)[1]) == want
        # --eplb-load-file: a new group places every layer's slots from the file at start-up, same tokens
        from kimik3.model.eplb import identity_slots, plan_slots
        line = next(ln for ln in res.stdout.splitlines() if ln.startswith("FILE"))
        assert json.loads(line.split(" ", 1)[1]) == want
        slots = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("SLOTS")).split(" ", 1)[1])
        slots = {int(i): s for i, s in slots.items()}
        assert slots == {i: plan_slots(loads[i], text.num_experts + 2, 2) for i in layers}
        assert any(s != identity_slots(text.num_experts, text.num_experts + 2, 2) for s in slots.values())


def test_dead_worker_takes_the_group_down_with_a_clear_error(ckpt):
    res = _run(ckpt, "tp", "kill", timeout=90)
    assert res.returncode == 1
    assert "tensor-parallel worker rank 1" in res.stderr and "stopping all ranks" in res.stderr


STDIN_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from kimik3.engine import LLM
    start = time.monotonic()
    try:
        LLM(sys.argv[1], tensor_parallel_size=2, dtype=torch.float64, device="cpu", max_model_len=64,
            block_size=4, kv_cache_memory_bytes=1 << 22)
    except RuntimeError as e:
        print(f"FAILED after {time.monotonic() - start:.1f} s: {e}", flush=True)
        sys.exit(3)
""")


def test_worker_that_dies_before_the_rendezvous_fails_within_seconds(ckpt):
    """A script read from standard input: the spawned worker cannot re-import it and exits at once.
    Rank 0 used to wait in the rendezvous until its timeout."""
    res = subprocess.run([sys.executable, "-", str(ckpt)], input=STDIN_SCRIPT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 3, res.stdout + res.stderr[-3000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("FAILED"))
    assert "worker rank 1" in line and "exited with code 1" in line
    assert float(line.split()[2]) < 10


TWO_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from kimik3.engine import LLM, SamplingParams

    def main():
        kw = dict(tensor_parallel_size=2, dtype=torch.float64, device="cpu", max_model_len=64,
                  max_num_batched_tokens=8, block_size=4, kv_cache_memory_bytes=1 << 22)
        prompt = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]}]
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        out = []
        with LLM(sys.argv[1], **kw) as llm:
            out.append(llm.generate(prompt, params)[0].outputs[0].token_ids)
            try:
                LLM(sys.argv[1], **kw)
            except RuntimeError as e:
                print("SECOND", e, flush=True)
        llm = LLM(sys.argv[1], **kw)
        out.append(llm.generate(prompt, params)[0].outputs[0].token_ids)
        llm.shutdown()
        print("TOKENS", json.dumps(out), flush=True)

    if __name__ == "__main__":
        main()
""")


def test_two_tensor_parallel_llms_one_after_the_other(ckpt, tmp_path):
    """``with LLM(...)`` / ``shutdown()`` stop the workers and destroy the group, so the next LLM starts;
    one started while another runs is refused with a clear error."""
    from kimik3.engine import LLM, SamplingParams
    script = tmp_path / "two.py"
    script.write_text(TWO_SCRIPT)
    llm = LLM(str(ckpt), dtype=torch.float64, device="cpu", max_model_len=64, max_num_batched_tokens=8,
              block_size=4, kv_cache_memory_bytes=1 << 22)
    want = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]}],
                        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0].outputs[0].token_ids
    res = subprocess.run([sys.executable, str(script), str(ckpt)], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "SECOND" in res.stdout and "shut down" in res.stdout
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("TOKENS"))
    assert json.loads(line.split(" ", 1)[1]) == [want, want]


@pytest.mark.parametrize("kwargs,match", [
    (dict(pipeline_parallel_size=7), r"pipeline parallel size 7 must lie in \[1, 6\]"),
    (dict(pipeline_parallel_size=2, pp_layer_partition="2,3"), "sum to the model's 6 decoder layers"),
    (dict(tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True, num_redundant_experts=1),
     "use num_redundant_experts 2"),
    (dict(tensor_parallel_size=4, enable_expert_parallel=True, enable_eplb=True, num_redundant_experts=1),
     "use num_redundant_experts 4"),
    (dict(tensor_parallel_size=2, decode_context_parallel_size=2, block_size=5), "block_size 5 must be a multiple"),
    (dict(tensor_parallel_size=3), "must divide the KDA heads"),
])
def test_a_layout_the_model_cannot_take_is_refused_before_any_rank_starts(ckpt, monkeypatch, kwargs, match):
    """The stages, EPLB's slots and DCP's stripes are checked against the checkpoint's config before a worker is
    spawned (they were refused after every rank had loaded its weights: 60 s for PP 9 on this box)."""
    from kimik3.engine import LLM
    from kimik3.parallel import launch
    monkeypatch.setattr(launch, "start_group", lambda *a, **k: pytest.fail("a worker was started"))
    with pytest.raises(ValueError, match=match):
        LLM(str(ckpt), dtype=torch.float64, device="cpu", max_model_len=64, kv_cache_memory_bytes=1 << 22, **kwargs)
