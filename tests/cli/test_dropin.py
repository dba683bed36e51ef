"""The K3 recipe's command line as a vLLM user types it: ``kimik3 serve MODEL --trust-remote-code ...``,
start-up order (port before the load) and start-up errors (one ``kimik3: error:`` line, exit 2)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

import kimik3
from tests.cli.test_cli import ENV, run


def one_error_line(r, message: str) -> None:
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("kimik3: error:") and message in lines[0], r.stderr


@pytest.mark.parametrize("args,message", [
    (["serve", "--port", "99999"], "--port: a TCP port lies in 0..65535, got 99999"),
    (["serve", "/no/such/checkpoint"], "model path /no/such/checkpoint does not exist"),
    (["serve", "--model", "/no/such/checkpoint"], "model path /no/such/checkpoint does not exist"),
    (["serve", str(kimik3.DEFAULT_MODEL), "--model", "/elsewhere"], "the model is given twice"),
    (["serve", "--tool-call-parser", "hermes"], "unknown tool-call parser 'hermes'"),
    (["serve", "--reasoning-parser", "deepseek_r1"], "unknown reasoning parser 'deepseek_r1'"),
    (["serve", "--kv-cache-dtype", "int4"], "argument --kv-cache-dtype: invalid choice: 'int4'"),
    (["serve", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["serve", "--max-model-len", "1.5K"], "decimals are not allowed with the binary suffix K"),
    (["serve", "--gpu-memory-utilization", "1.2"], "expected a number in (0, 1]"),
    (["generate", "x", "--max-model-len", "2000000"], "longer than the model's max_position_embeddings"),
])
def test_start_up_errors_are_one_line(args, message):
    one_error_line(run(*args), message)


def test_taken_port_fails_before_the_model_loads():
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        start = time.monotonic()
        r = run("serve", str(kimik3.DEFAULT_MODEL), "--port", str(port), "--log-level", "info")
        one_error_line(r, f"cannot listen on 127.0.0.1:{port}")
        assert "loading" not in r.stderr
        assert time.monotonic() - start < 120
    finally:
        busy.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_k3_recipe_command_line_serves():
    port = free_port()
    cmd = [sys.executable, "-m", "kimik3.cli", "serve", str(kimik3.DEFAULT_MODEL), "--served-model-name", "k3",
           "--trust-remote-code", "--tool-call-parser", "kimi_k3", "--enable-auto-tool-choice",
           "--reasoning-parser", "kimi_k3", "--gpu-memory-utilization", "0.9", "--enforce-eager",
           "--kv-cache-dtype", "auto", "--dtype", "float", "--max-model-len", "4k", "--max-num-seqs", "4",
           "--uvicorn-log-level", "warning", "--disable-log-requests", "--port", str(port), "--api-key", "sk-test",
           "--max-logprobs", "5", "--no-enable-prefix-caching"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0)
        r = client.chat.completions.create(model="k3", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                           temperature=0)
        assert r.usage.completion_tokens <= 3
        card = client.models.list().data[0]
        assert card.id == "k3" and card.max_model_len == 4000
        with pytest.raises(openai.BadRequestError, match="max-logprobs"):
            client.chat.completions.create(model="k3", messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                           logprobs=True, top_logprobs=6)
        assert httpx.get(url + "/metrics").status_code == 200          # open like /health, despite --api-key
        assert httpx.get(url + "/v1/models").status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    assert "loading default_model" in err                     # the load's progress bar, on by default
    assert "INFO kimik3.engine.core.cache_budget: cache plan:" in err  # the cache plan at INFO
    assert "request chatcmpl-" not in err                      # --disable-log-requests
    assert proc.returncode == 0 and "Traceback" not in err, err       # Ctrl-C: drained, then a clean exit 0 (issue 15)


def test_log_level_covers_kimik3_logs():
    quiet = run("generate", "Hi", "--max-tokens", "2", "--max-model-len", "1k", "--log-level", "warning",
                "--no-use-tqdm-on-load")
    assert quiet.returncode == 0, quiet.stderr
    assert "cache plan" not in quiet.stderr and "loading" not in quiet.stderr
    loud = run("generate", "Hi", "--max-tokens", "2", "--max-model-len", "1k", "--dtype", "bfloat16",
               "--no-enable-prefix-caching", "--enforce-eager")
    assert loud.returncode == 0, loud.stderr
    assert "INFO kimik3.engine.core.cache_budget: cache plan:" in loud.stderr and "loading default_model" in loud.stderr
    assert "no KDA checkpoints (prefix caching off)" in loud.stderr


def test_generation_config_flag_on_the_command_line(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"max_new_tokens": 3}')
    r = run("generate", "Hi", "--max-model-len", "1k", "--generation-config", str(tmp_path), "--log-level", "error")
    assert r.returncode == 0, r.stderr
    assert "[3 tokens in" in r.stderr


def test_bench_takes_the_shared_flags():
    r = run("bench", "--arch", "kimi_linear", "--num-requests", "2", "--input-len", "4", "6", "--output-len", "2",
            "3", "--baseline-requests", "1", "--threads", "1", "--no-enable-prefix-caching", "--dtype", "float32",
            "--kv-cache-memory-bytes", "64M", "--log-level", "warning")
    assert r.returncode == 0, r.stderr
    assert "output throughput" in r.stdout and "prefix hit rate 0.0%" in r.stdout
