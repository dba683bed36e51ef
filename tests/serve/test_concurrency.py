"""Many clients at once, determinism under batching, disconnects, shutdown."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx

from tests.serve.conftest import MODEL, start_fake_server


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def disconnect_mid_stream(server, body: dict, while_streaming=lambda: None) -> None:
    """Open a streamed chat completion, read 5 lines, call ``while_streaming``, then hang up."""
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(5):
            next(lines)
        while_streaming()


def test_64_concurrent_streams(server):
    async def one(client, i: int):
        n_tokens = 5 + i % 7
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"client {i} says hi"}], max_tokens=n_tokens,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage, finish, chunks = None, None, 0
        async for chunk in stream:
            chunks += 1
            usage = chunk.usage or usage
            for ch in chunk.choices:
                finish = ch.finish_reason or finish
        return n_tokens, usage.completion_tokens, finish, chunks

    async def main():
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert len(results) == 64
    for wanted, got, finish, chunks in results:
        assert got == wanted and finish == "length" and chunks >= 2
    assert metric(server, "vllm:num_requests_running") == 0


def test_greedy_same_alone_and_concurrent(server):
    prompts = [f"determinism {i} " * (1 + i % 5) for i in range(12)]

    async def ask(client, p):
        r = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                                 max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        return r.choices[0].message.reasoning_content, r.usage.completion_tokens

    async def main():
        async with server.async_client() as client:
            alone = [await ask(client, p) for p in prompts]
            together = await asyncio.gather(*(ask(client, p) for p in prompts))
            return alone, list(together)

    alone, together = asyncio.run(main())
    assert alone == together
    assert all(n == 12 for _, n in alone)


def test_disconnect_mid_stream_frees_cache():
    s = start_fake_server(step_delay=0.01)
    try:
        usable = s.engine.kv.plan.num_usable_blocks
        aborts = metric(s, 'vllm:request_success_total{finished_reason="abort",model_name="k3-test"}') if "abort" in \
            httpx.get(s.url + "/metrics").text else 0.0
        body = {"model": MODEL, "messages": [{"role": "user", "content": "a long story " * 30}], "max_tokens": 700,
                "stream": True, "ignore_eos": True}

        def while_streaming():
            assert metric(s, "vllm:num_requests_running") == 1
            assert metric(s, "vllm:kv_cache_usage_perc") > 0
        disconnect_mid_stream(s, body, while_streaming)
        deadline = time.monotonic() + 10
        while metric(s, "vllm:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert metric(s, "vllm:kv_cache_usage_perc") == 0
        assert metric(s, "vllm:num_requests_running") == 0
        assert metric(s, 'vllm:request_success_total{finished_reason="abort",model_name="k3-test"}') == aborts + 1
        assert s.engine.kv.blocks.num_free == usable and not s.engine.has_unfinished_requests()
        assert s.state.in_flight == 0
        ok = httpx.post(s.url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 3}, timeout=30)
        assert ok.status_code == 200
    finally:
        s.stop()


def test_disconnect_while_waiting_non_streaming():
    """A non-streamed request whose client gives up is aborted too."""
    s = start_fake_server(step_delay=0.01)
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "wait"}], "max_tokens": 800,
                "ignore_eos": True}
        try:
            httpx.post(s.url + "/v1/chat/completions", json=body, timeout=0.3)
            raise AssertionError("the request should still be running")
        except httpx.ReadTimeout:
            pass
        deadline = time.monotonic() + 10
        while (s.state.in_flight or s.engine.has_unfinished_requests()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert s.state.in_flight == 0 and s.engine.kv.blocks.num_free == s.engine.kv.plan.num_usable_blocks
        assert metric(s, 'vllm:request_success_total{finished_reason="abort",model_name="k3-test"}') == 1
    finally:
        s.stop()


def test_graceful_shutdown_finishes_in_flight():
    s = start_fake_server(step_delay=0.01)
    result = {}

    def client():
        body = {"model": MODEL, "messages": [{"role": "user", "content": "finish me"}], "max_tokens": 60,
                "ignore_eos": True}
        result["r"] = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=30)

    t = threading.Thread(target=client)
    t.start()
    deadline = time.monotonic() + 10
    while not s.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.005)
    s.stop()
    t.join(30)
    assert result["r"].status_code == 200
    assert result["r"].json()["usage"]["completion_tokens"] == 60
    assert not s.state.loop.alive and not s.engine.has_unfinished_requests()


def test_async_scheduling_server_matches_the_synchronous_one(server):
    """The server over an async-scheduling engine: 32 concurrent greedy streams give the synchronous
    server's texts and token counts, a client that disconnects mid-stream frees its cache, and the
    engine ends idle with every block free."""
    s = start_fake_server(step_delay=0.002, engine_kw={"async_scheduling": True})
    try:
        async def one(client, i: int):
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"async client {i}"}], max_tokens=4 + i % 9,
                temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            text, usage = [], None
            async for chunk in stream:
                usage = chunk.usage or usage
                text += [getattr(ch.delta, "reasoning_content", None) or ch.delta.content or "" for ch in chunk.choices]
            return "".join(text), usage.completion_tokens

        async def run_all(srv):
            async with srv.async_client() as client:
                return await asyncio.gather(*(one(client, i) for i in range(32)))

        got = asyncio.run(run_all(s))
        assert got == asyncio.run(run_all(server)) and all(text and n == 4 + i % 9 for i, (text, n) in enumerate(got))
        disconnect_mid_stream(s, {"model": MODEL, "messages": [{"role": "user", "content": "a long story " * 30}],
                                  "max_tokens": 700, "stream": True, "ignore_eos": True})
        deadline = time.monotonic() + 10
        while s.engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not s.engine.has_unfinished_requests()
        assert s.engine.kv.blocks.num_free == s.engine.kv.plan.num_usable_blocks
        assert s.engine.runner.num_steps > 0
    finally:
        s.stop()
