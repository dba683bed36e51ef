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
