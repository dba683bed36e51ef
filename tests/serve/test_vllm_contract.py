"""vLLM's request fields and ``vllm serve`` flags: each implemented, a documented no-op, or refused naming why;
prefix matching off; a tensor-parallel size the model cannot take refused before any worker starts; the
periodic stats line."""

from __future__ import annotations

import json
import logging
import multiprocessing
import time

import httpx
import openai
import pytest

import kimik3
from kimik3.cli import build_parser
from kimik3.engine.args import EngineArgs
from kimik3.engine.build import build_engine
from kimik3.serve.stats_log import stats_line
from tests.serve.conftest import MODEL, start_fake_server


@pytest.fixture(scope="module")
def server():
    s = start_fake_server(log_stats_interval=0.2)
    yield s
    s.stop()


def msgs():
    return [{"role": "user", "content": "hi"}]


def test_accepted_fields_and_echoed_tier(server):
    c = server.client()
    r = c.chat.completions.create(model=MODEL, messages=msgs(), max_tokens=3, store=False, metadata={"k": "v"},
                                  service_tier="auto", prompt_cache_key="conv-1", n=None)
    assert len(r.choices) == 1 and r.service_tier == "auto"
    raw = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                           "n": None, "service_tier": "default", "store": False})
    assert raw.status_code == 200 and raw.json()["service_tier"] == "default" and len(raw.json()["choices"]) == 1


@pytest.mark.parametrize("field,value,match", [("store", True, "stores no completions"),
                                               ("service_tier", "flex", "one tier"),
                                               ("metadata", {"k": 1}, "metadata")])
def test_refused_fields_name_why(server, field, value, match):
    with pytest.raises(openai.BadRequestError, match=match) as e:
        server.client().chat.completions.create(model=MODEL, messages=msgs(), max_tokens=2, **{field: value})
    assert e.value.body["param"].startswith(field)


def test_continuous_usage_stats(server):
    body = {"model": MODEL, "messages": msgs(), "max_tokens": 5, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    with_choices = [c for c in chunks if c["choices"]]
    generated = [c["usage"]["completion_tokens"] for c in with_choices]
    assert all(c["usage"] is not None for c in chunks)
    assert generated == sorted(generated) and generated[-1] == 5 == chunks[-1]["usage"]["completion_tokens"]
    prompt = chunks[-1]["usage"]["prompt_tokens"]
    assert all(c["usage"]["prompt_tokens"] == prompt and c["usage"]["total_tokens"] == prompt +
               c["usage"]["completion_tokens"] for c in with_choices)
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False})
    assert r.status_code == 400 and "needs stream=true" in r.json()["error"]["message"]


def test_stats_line_is_logged_while_serving(server, caplog):
    with caplog.at_level(logging.INFO, logger="kimik3.serve.stats_log"):
        server.client().chat.completions.create(model=MODEL, messages=msgs(), max_tokens=8,
                                                extra_body={"ignore_eos": True})
        deadline = time.monotonic() + 10
        while not any("Avg generation throughput" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "no stats line"
            time.sleep(0.05)
    line = next(r.getMessage() for r in caplog.records if "Avg generation throughput" in r.getMessage())
    for part in ("Avg prompt throughput", "Running:", "Waiting:", "KV cache usage:", "Prefix cache hit rate:"):
        assert part in line


def test_stats_line_numbers():
    prev = {"time": 0.0, "prompt_tokens": 0.0, "generation_tokens": 0.0, "prefix_queried_tokens": 100.0,
            "prefix_hit_tokens": 10.0, "prefix_hit_rate": 0.1, "running": 0.0, "waiting": 0.0, "cache_usage": 0.0}
    now = {**prev, "time": 10.0, "prompt_tokens": 500.0, "generation_tokens": 250.0, "prefix_queried_tokens": 300.0,
           "prefix_hit_tokens": 160.0, "running": 3.0, "waiting": 1.0, "cache_usage": 0.25}
    assert stats_line(prev, now) == ("Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 25.0 tokens/s, "
                                     "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, "
                                     "Prefix cache hit rate: 75.0%")
    assert stats_line(prev, {**prev, "time": 10.0}) is None       # idle: no line


def serve_args(*flags):
    return build_parser().parse_args(["serve", *flags])


def test_vllm_serve_flags():
    args = serve_args("--load-format", "fastsafetensors", "--moe-backend", "triton", "--max-cudagraph-capture-size",
                      "8", "--disable-custom-all-reduce", "--enable-chunked-prefill", "--disable-log-stats")
    ea = EngineArgs.from_cli(args)
    assert ea.load_format == "fastsafetensors" and ea.moe_backend == "triton" and args.disable_log_stats
    import torch
    cfg = ea.engine_config(4096, torch.device("cpu"))
    assert cfg.max_cudagraph_capture_size == 8 and cfg.graph_max_seqs == 8
    assert EngineArgs(max_num_seqs=4, max_cudagraph_capture_size=8).engine_config(
        4096, torch.device("cpu")).graph_max_seqs == 4
    with pytest.raises(ValueError, match="always chunks"):
        EngineArgs.from_cli(serve_args("--no-enable-chunked-prefill"))
    for flags, match in ((["--load-format", "pt"], "invalid choice"), (["--moe-backend", "marlin"], "invalid choice")):
        with pytest.raises(SystemExit):
            serve_args(*flags)
    with pytest.raises(ValueError, match="kimik3 reads safetensors"):
        EngineArgs(load_format="gguf")
    with pytest.raises(ValueError, match="own Triton expert kernels"):
        EngineArgs(moe_backend="flashinfer_cutlass")


def test_no_prefix_matching_of_flags(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--max-token", "8"])
    assert "unrecognized arguments: --max-token" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-model", "2k"])
    assert build_parser().parse_args(["generate", "hi", "--max-tokens", "8"]).max_tokens == 8


def test_tensor_parallel_size_the_model_cannot_take_is_refused_before_spawning():
    heads = kimik3.load_config(kimik3.DEFAULT_MODEL).text.num_attention_heads
    tp = next(t for t in range(2, 64) if heads % t)
    with pytest.raises(ValueError, match=f"tensor parallel size {tp} must divide"):
        build_engine(EngineArgs(tensor_parallel_size=tp, device="cpu"))
    assert multiprocessing.active_children() == []
