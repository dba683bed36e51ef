"""The kimik3 command, run as a subprocess: generate, chat, inspect, and argument errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kimik3

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
RELEASE = Path(__file__).resolve().parents[2] / "tests" / "data" / "kimi-k3-release.config.json"


def run(*args, stdin=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "kimik3.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=ENV)


def test_generate_on_the_embedded_model_streams_text_and_reports_timing():
    r = run("generate", "Hello world", "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()                                     # some generated text
    assert "[12 tokens in" in r.stderr and "first token" in r.stderr


def test_generate_is_deterministic_greedy_and_matches_the_offline_api():
    a = run("generate", "The sky is", "--max-tokens", "8")
    b = run("generate", "-", "--max-tokens", "8", stdin="The sky is")
    assert a.returncode == b.returncode == 0
    assert a.stdout == b.stdout
    from kimik3.engine import LLM, SamplingParams
    llm = LLM(str(kimik3.DEFAULT_MODEL), max_num_seqs=2, max_model_len=256)
    out = llm.generate("The sky is", SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    assert a.stdout == out + "\n"
    c = run("generate", "The sky is", "--max-tokens", "8", "--num-speculative-tokens", "3")
    assert c.returncode == 0 and c.stdout == a.stdout            # speculation changes no greedy token


def test_generate_chat_and_sampling_flags(tiny_tokenizer_ckpt):
    r = run("generate", "hi", "--chat", "--max-tokens", "6", "--temperature", "0.8", "--top-p", "0.9",
            "--top-k", "20", "--seed", "3", "--model", str(tiny_tokenizer_ckpt))
    assert r.returncode == 0, r.stderr
    r2 = run("generate", "hi", "--chat", "--max-tokens", "6", "--temperature", "0.8", "--top-p", "0.9",
             "--top-k", "20", "--seed", "3", "--model", str(tiny_tokenizer_ckpt))
    assert r.stdout == r2.stdout                                # same seed, same sample


def test_chat_repl_with_scripted_stdin():
    r = run("chat", "--max-tokens", "5", "--no-thinking", stdin="hello\n/reset\nsecond turn\nthird\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "[conversation cleared]" in r.stderr
    assert len([line for line in r.stdout.splitlines() if line.strip()]) >= 1


def test_inspect_embedded_and_release_config():
    r = run("inspect")
    assert r.returncode == 0, r.stderr
    assert "6 = 4 KDA + 2 MLA" in r.stdout and "read from the safetensors headers" in r.stdout
    r = run("inspect", "--model", str(RELEASE))
    assert r.returncode == 0, r.stderr
    assert "93 = 69 KDA + 24 MLA" in r.stdout
    assert "2,722,740,830,208" in r.stdout                      # routed experts: 92*896*3*3584*3072
    assert "27,648 B/token" in r.stdout                         # 24 MLA layers x 576 x 2 bytes


@pytest.mark.parametrize("args,message", [
    (["generate", "x", "--max-tokens", "0"], "--max-tokens: expected a positive integer"),
    (["generate", "x", "--model", "/no/such/dir"], "model path /no/such/dir does not exist"),
    (["generate", "x", "--temperature", "-1"], "temperature must be >= 0"),
    (["generate", "x", "--device", "tpu"], "device must be 'cpu' or 'cuda[:N]'"),
    (["generate", "x", "--image", "/no/image.png"], "image file /no/image.png does not exist"),
    (["generate", "   "], "the prompt is empty"),
    (["inspect", "--model", "/nope"], "model path /nope does not exist"),
    (["frobnicate"], "invalid choice"),
    (["generate", "x", "--thinking-effort", "medium"], "invalid choice"),
    (["generate", "x", "--num-speculative-tokens", "-2"], "--num-speculative-tokens: expected an integer >= 0"),
])
def test_bad_arguments_exit_2_with_one_line(args, message):
    r = run(*args)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kimik3: error:") and message in lines[0], r.stderr


def test_not_a_checkpoint_directory(tmp_path):
    r = run("generate", "x", "--model", str(tmp_path))
    assert r.returncode == 2 and "has no config.json" in r.stderr
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    r = run("generate", "x", "--model", str(tmp_path))
    assert r.returncode == 2 and "model_type" in r.stderr and "Traceback" not in r.stderr


def test_inspect_parallel_sizing_of_the_release():
    r = run("inspect", "--model", str(RELEASE), "--tensor-parallel-size", "8")
    assert r.returncode == 0, r.stderr
    assert "layout TP8" in r.stdout and "fits: no" in r.stdout
    r = run("inspect", "--model", str(RELEASE), "--tensor-parallel-size", "16", "--expert-parallel-size", "16")
    assert "layout TP16/EP16" in r.stdout and "fits: yes" in r.stdout
    r = run("inspect", "--model", str(RELEASE), "--tensor-parallel-size", "5")
    assert r.returncode == 2 and "must divide the KDA heads" in r.stderr


def test_inspect_plans_offload_fp8_and_rejects_bad_budgets():
    r = run("inspect", "--model", str(RELEASE), "-tp", "8", "--cpu-offload-gb", "80", "--kv-cache-dtype", "fp8",
            "--quantization", "fp8", "--pcie-gbps", "25")
    assert r.returncode == 0, r.stderr
    assert "fits: yes" in r.stdout and "offloaded to pinned host memory 80.1 GiB per GPU" in r.stdout
    assert "PCIe 25 GB/s per GPU" in r.stdout and "batch 32" in r.stdout
    r = run("inspect", "--model", str(RELEASE), "-tp", "8", "--cpu-offload-gb", "80", "--expert-offload-policy",
            "prefetch", "--prefetch-accuracy", "0.8")
    assert r.returncode == 0, r.stderr
    assert "prefetch accuracy 80%" in r.stdout and "misses by --expert-offload-policy prefetch" in r.stdout
    assert r.stdout.count("by prefetch") == 3
    r = run("inspect", "--model", str(RELEASE), "-tp", "8", "--cpu-offload-gb", "80", "--prefetch-accuracy", "2")
    assert r.returncode == 2 and "--prefetch-accuracy must lie in [0, 1]" in r.stderr
    r = run("inspect", "--model", str(RELEASE), "-tp", "8", "--cpu-offload-gb", "-1")
    assert r.returncode == 2 and "expected a number of GiB >= 0" in r.stderr and "Traceback" not in r.stderr
    r = run("inspect", "--model", str(RELEASE), "-tp", "8", "--cpu-offload-gb", "200")
    assert r.returncode == 2 and "more than the 168.4 GiB of routed experts each GPU holds" in r.stderr


def test_bench_reports_throughput_and_batching_gain():
    r = run("bench", "--arch", "kimi_linear", "--num-requests", "4", "--input-len", "4", "8", "--output-len",
            "2", "4", "--baseline-requests", "2", "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert "output throughput" in r.stdout and "batching gain" in r.stdout and "TTFT" in r.stdout
    r = run("bench", "--arch", "kimi_k3", "--num-requests", "3", "--input-len", "4", "8", "--output-len",
            "6", "8", "--baseline-requests", "1", "--threads", "1", "--greedy", "--num-speculative-tokens", "2")
    assert r.returncode == 0, r.stderr
    assert "speculative drafts" in r.stdout


def test_generate_and_inspect_on_a_test_checkpoint(tiny_tokenizer_ckpt):
    r = run("generate", "plain completion", "--max-tokens", "5", "--model", str(tiny_tokenizer_ckpt))
    assert r.returncode == 0, r.stderr
    assert "[5 tokens in" in r.stderr and r.stdout.strip()
    r = run("inspect", "--model", str(tiny_tokenizer_ckpt))
    assert r.returncode == 0, r.stderr
    assert "6 = 4 KDA + 2 MLA" in r.stdout and "vision tower: no" in r.stdout and "U8 (MXFP4)" in r.stdout


def test_inspect_says_whether_kimi_linear_fits_one_h200():
    """Kimi-Linear-48B's release config: bf16 weights (from the parameter count), the engine's default
    cache (gpu_memory_utilization 0.9 of an H200's memory, less the weights), and how many
    1M-token sequences it holds: MLA 7 layers x 576 x 2 B per token, KDA 20 layers x (32 x 128 x 128
    fp32 state + 3 x 32 x 128 x 3 bf16 conv window) per sequence."""
    r = run("inspect", "--model", str(RELEASE.with_name("kimi-linear-48b-a3b.config.json")))
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("one H200"))
    weights = 49_122_681_728 * 2           # bf16 (a few small F32 tensors add 4 MiB: no count changes)
    cache = int(0.9 * (143771 << 20)) - weights
    per_token, per_seq = 7 * 576 * 2, 20 * (32 * 128 * 128 * 4 + 3 * 32 * 128 * 3 * 2)
    assert "fits" in line
    assert f"{cache // (per_seq + per_token * 1048576)} sequences of 1048576" in line
    assert f"{cache // (per_seq + per_token * 131072)} sequences of 131072" in line
    assert "one H100 (79.6 GiB): does not fit" in r.stdout


def test_chat_ctrl_c_stops_the_answer_and_keeps_the_conversation(monkeypatch, capsys):
    """Ctrl-C while an answer streams (KeyboardInterrupt in the engine step) stops that answer; the
    REPL goes on, and the next turn's prompt holds the first question and the partial answer."""
    import io

    from kimik3 import cli
    from kimik3.engine import LLM

    llm = LLM(str(kimik3.DEFAULT_MODEL), max_num_seqs=2, max_model_len=1024)
    real_step = llm.engine.step
    steps = {"n": 0}

    def step():
        steps["n"] += 1
        if steps["n"] == 4:
            raise KeyboardInterrupt
        return real_step()
    llm.engine.step = step
    monkeypatch.setattr(cli, "_load_llm", lambda args, max_num_seqs=4: (llm, kimik3.DEFAULT_MODEL))
    seen = []
    real_prompt = cli._prompt_with_images
    monkeypatch.setattr(cli, "_prompt_with_images",
                        lambda llm_, path, conv, args, images: (seen.append([dict(m) for m in conv]),
                                                                real_prompt(llm_, path, conv, args, images))[1])
    monkeypatch.setattr(sys, "stdin", io.StringIO("first question\nsecond question\n/exit\n"))
    assert cli.main(["chat", "--max-tokens", "30", "--no-thinking"]) == 0
    assert "[answer stopped" in capsys.readouterr().err
    assert [m["role"] for m in seen[1]] == ["user", "assistant", "user"]
    assert seen[1][0]["content"] == "first question" and seen[1][2]["content"] == "second question"
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.blocks.num_free == llm.engine.kv.plan.num_usable_blocks
