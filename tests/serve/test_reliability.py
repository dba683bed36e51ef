"""One bad request never hurts another: hostile and careless clients beside well-behaved ones."""

from __future__ import annotations

import threading
import time

import httpx

from tests.serve.conftest import MODEL, start_fake_server
from tests.serve.test_errors import assert_error


def _chat(content: str, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 30,
            "ignore_eos": True, **kw}


def _answers(r: httpx.Response) -> list:
    assert r.status_code == 200, r.text
    return [c["message"]["reasoning_content"] for c in r.json()["choices"]]


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_seed_overflow_beside_running_requests():
    """n=2, seed=2^64-1 overflows at sample 1: a 400 naming seed, and the running requests (greedy
    and seeded sampling) finish exactly as they do alone."""
    s = start_fake_server(step_delay=0.01)
    bodies = [_chat("greedy one", temperature=0), _chat("seeded two", temperature=1.0, seed=5, n=2)]
    try:
        url = s.url + "/v1/chat/completions"
        alone = [_answers(httpx.post(url, json=b, timeout=30)) for b in bodies]
        got = {}

        def client(i):
            got[i] = _answers(httpx.post(url, json=bodies[i], timeout=30))
        threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        _wait(lambda: len(s.engine.scheduler.running) == 3)
        r = httpx.post(url, json=_chat("bad seed", n=2, seed=2**64 - 1), timeout=30)
        err = assert_error(r, 400, "seed", "seed must lie in [0, 2^64 - n]")
        assert "torch" not in err["message"] and "overflow" not in err["message"].lower()
        for t in threads:
            t.join(30)
        assert [got[0], got[1]] == alone
        assert s.state.loop.num_step_failures == 0
        assert httpx.post(url, json=_chat("after"), timeout=30).status_code == 200
        _wait(lambda: s.engine.kv.blocks.num_free == s.engine.kv.plan.num_usable_blocks)
    finally:
        s.stop()


def _rss() -> int:
    import os
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_soak_load_disconnects_and_bad_input():
    """~20 s of mixed traffic on loopback: good requests (streamed or not, checked for their token
    counts), clients that vanish mid-stream, malformed and hostile bodies, a seed overflow and a
    request that makes the model fail. Every good request completes, the cache returns to idle and
    RSS stays flat between the warm-up round and the end."""
    import asyncio
    import json
    import random

    from kimik3.serve.limits import Limits
    s = start_fake_server(step_delay=0.002, limits=Limits(max_stop_strings=4, max_body_bytes=1 << 20))
    url = s.url + "/v1/chat/completions"
    bad = [
        (b'{"model": "k3-test", "messages": [', 400),
        (json.dumps(_chat("x", n=2, seed=2**64 - 1)).encode(), 400),
        (json.dumps(_chat("x", n=1000)).encode(), 400),
        (json.dumps(_chat("x", stop=["a"] * 10)).encode(), 400),
        (json.dumps(_chat("x" * (2 << 20))).encode(), 413),
        (json.dumps(_chat("x", max_tokens=10**9)).encode(), 400),
        (json.dumps(_chat("POISON here", max_tokens=5)).encode(), 500),
    ]

    async def good(client, rng):
        n_tok = rng.randint(1, 40)
        body = _chat(f"good {rng.random()}", max_tokens=n_tok, temperature=rng.choice([0, 1.0]),
                     seed=rng.randint(0, 2**63))
        if rng.random() < 0.5:
            r = await client.post(url, json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == n_tok
            return
        async with client.stream("POST", url, json={**body, "stream": True,
                                                    "stream_options": {"include_usage": True}}) as r:
            lines = [ln async for ln in r.aiter_lines() if ln]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == n_tok

    async def vanish(client, rng):
        body = _chat("leaving soon", max_tokens=500, stream=True)
        async with client.stream("POST", url, json=body) as r:
            k = 0
            async for ln in r.aiter_lines():
                k += bool(ln)
                if k >= rng.randint(1, 5):
                    break

    async def hostile(client, rng):
        body, status = rng.choice(bad)
        r = await client.post(url, content=body, headers={"content-type": rng.choice(["application/json",
                                                                                     "text/plain"])})
        assert r.status_code in (status, 415), r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    async def worker(seed: int, until: float):
        rng = random.Random(seed)
        async with httpx.AsyncClient(timeout=60) as client:
            while time.monotonic() < until:
                await rng.choices([good, vanish, hostile], [6, 2, 2])[0](client, rng)

    async def round_(seconds: float):
        until = time.monotonic() + seconds
        await asyncio.gather(*(worker(i, until) for i in range(16)))

    def idle():
        return (not s.engine.has_unfinished_requests() and s.state.in_flight == 0
                and s.engine.kv.blocks.num_free == s.engine.kv.plan.num_usable_blocks)
    try:
        asyncio.run(round_(4))
        _wait(idle)
        before = _rss()
        asyncio.run(round_(16))
        _wait(idle)
        grown = _rss() - before
        assert grown < 64 << 20, f"RSS grew by {grown >> 20} MiB"
        assert httpx.post(url, json=_chat("still fine", max_tokens=3), timeout=30).json()["usage"][
            "completion_tokens"] == 3
    finally:
        s.stop()


def test_500_bodies_echo_no_internal_text():
    """A request that makes the model fail gets a 500 whose body names neither the exception nor any
    request id (the server log has them)."""
    s = start_fake_server()
    try:
        r = httpx.post(s.url + "/v1/chat/completions", json=_chat("POISON", max_tokens=3), timeout=30)
        err = assert_error(r, 500)
        assert err["code"] == "engine_error"
        for leak in ("scripted", "RuntimeError", "POISON", "chatcmpl-", "cmpl-"):
            assert leak not in err["message"], err
    finally:
        s.stop()


def test_startup_objects_are_frozen_while_serving():
    """The objects alive when the app starts (engine, tokenizer, modules) sit out the collector's full passes
    while it serves, and are handed back to it at shutdown."""
    import gc
    s = start_fake_server()
    try:
        assert gc.get_freeze_count() > 10_000
        with s.client() as c:
            assert c.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
    finally:
        s.stop()
    assert gc.get_freeze_count() == 0
