"""``kimik3 serve`` under torchrun (every rank started by the agent, rank 0 serves) with the multi-GPU
layouts on CPU ranks (gloo, float64), on the default model and a tiny Kimi-Linear: the served greedy completion
equals the one-process one (two prompts in one request: a PP2 step runs them as two micro-batches); with EPLB, again
after a live ``/rebalance_experts``; under TP2 a chat with an image (encoded by both ranks' vision towers) too."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

PROMPT = "The capital of France is"
# a prompt the default model continues by repeating it: n-gram drafts are found and accepted
AUSTEN = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
          "of a wife. It is a truth universally acknowledged, that a single man")


def _image_chat() -> list[dict]:
    import base64
    import io

    import numpy as np
    from PIL import Image
    parts = []
    for seed, (h, w) in enumerate([(40, 56), (30, 30)]):      # two images: one on each TP rank
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
        parts.append({"type": "image_url", "image_url": {"url": "data:image/png;base64," +
                                                                base64.b64encode(buf.getvalue()).decode()}})
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is in the pictures?"}]}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def want():
    from kimik3.engine import LLM, SamplingParams
    llm = LLM(None, dtype=torch.float64, device="cpu", max_model_len=256, block_size=4, max_num_seqs=2,
              kv_cache_memory_bytes=1 << 23)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    text = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
    chat = llm.chat(_image_chat(), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0),
                    use_tqdm=False)[0].outputs[0]
    austen = llm.generate([AUSTEN], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    return text, chat.text, [lp[t].logprob for t, lp in zip(chat.token_ids, chat.logprobs)], austen[0].outputs[0].text


@pytest.fixture(scope="module")
def linear(tmp_path_factory):
    """A tiny Kimi-Linear checkpoint (KDA + MLA layers, MoE) with the default model's tokenizer, and its
    one-process greedy text."""
    import kimik3
    from kimik3.engine import LLM, SamplingParams
    from kimik3.testing import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("serve-linear"), "kimi_linear", seed=3, num_heads=4,
                                vocab_size=4352)
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(os.path.join(kimik3.DEFAULT_MODEL, name), path / name)
    llm = LLM(str(path), dtype=torch.float64, device="cpu", max_model_len=256, block_size=4, max_num_seqs=2,
              kv_cache_memory_bytes=1 << 23)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return path, llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text


@pytest.mark.parametrize("nproc,flags", [
    (2, ["--tensor-parallel-size", "2", "--decode-context-parallel-size", "2"]),
    (4, ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--enable-expert-parallel", "--enable-eplb",
         "--num-redundant-experts", "2", "--num-speculative-tokens", "2"]),
    (2, ["kimi_linear", "--tensor-parallel-size", "2", "--decode-context-parallel-size", "2",
         "--enable-expert-parallel", "--enable-eplb", "--num-redundant-experts", "2"]),
], ids=["tp2-dcp2", "pp2xtp2-ep-eplb-ngram", "kimi-linear-tp2-dcp2-ep-eplb"])
def test_served_completion_under_torchrun_matches_one_process(want, request, tmp_path, nproc, flags):
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    if flags[0] == "kimi_linear":     # a Kimi-Linear checkpoint served (no vision tower: completions only)
        path, text = request.getfixturevalue("linear")
        flags = ["--model", str(path), *flags[1:]]
        want = (text, *want[1:])
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", str(nproc), "-m", "kimik3.cli", "serve",
                             "--port", str(port), "--dtype", "float64", "--device", "cpu", "--max-model-len", "256",
                             "--block-size", "4", "--max-num-seqs", "2", "--kv-cache-memory-bytes", str(1 << 23), "--served-model-name", "m",
                             *flags], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"server did not start:\n{log.read()[-4000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "m", "prompt": [PROMPT, PROMPT + " Paris"], "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want[0]
        linear = "kimi-linear" in request.node.name
        if "--pipeline-parallel-size" not in flags and not linear:      # an image chat: each TP rank encodes its share
            r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
                "model": "m", "messages": _image_chat(), "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
                "logprobs": True})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            message = choice["message"]        # the default chat template thinks first
            assert (message.get("reasoning") or "") + (message["content"] or "") == want[1], message
            # the sampled tokens' logprobs (float64) see the images' embeddings: one rank's share wrong moves them
            got = [c["logprob"] for c in choice["logprobs"]["content"]]
            assert got == pytest.approx(want[2], rel=1e-9, abs=1e-9), (got, want[2])
        if "--num-speculative-tokens" in flags:      # n-gram drafts verified through the stages' micro-batches
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": "m", "prompt": AUSTEN, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[3], r.text
            metrics = httpx.get(url + "/metrics", timeout=30).text.splitlines()
            accepted = [ln for ln in metrics if ln.startswith("vllm:spec_decode_num_accepted_tokens_total")]
            assert accepted and float(accepted[0].split()[-1]) > 0, accepted
        if "--enable-eplb" in flags:      # a live rebalance on every rank of both stages, then the same completion
            r = httpx.post(url + "/rebalance_experts", json={}, timeout=120)
            assert r.status_code == 200, r.text
            assert sorted(int(i) for i in r.json()["layers"]) == ([1, 2, 3, 4] if linear else [1, 2, 3, 4, 5])
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": "m", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[0], r.text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(10)
