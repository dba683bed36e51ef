"""Bad requests get the right status and OpenAI error body, and the server keeps serving."""

from __future__ import annotations

import base64
import io
import threading
import time

import httpx
import openai
import pytest
from PIL import Image

from tests.serve.conftest import MODEL, start_fake_server


@pytest.fixture(scope="module")
def server():
    s = start_fake_server(engine_kw={"max_model_len": 256})
    yield s
    s.stop()


def post(server, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, (dict, list)):
        return httpx.post(server.url + path, json=body, timeout=30, **kw)
    return httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=30, **kw)


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def png_data_url(w: int = 30, h: int = 20) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 10, 10)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_msg(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "what is this?"}]}]


def assert_error(r: httpx.Response, status: int, param: str | None = None, contains: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert contains in err["message"], err
    return err


CASES = {
    "malformed-json": ("/v1/chat/completions", b'{"model": "k3-test", "messages": [', 400, None, "not valid JSON"),
    "not-an-object": ("/v1/chat/completions", [1, 2], 400, None, "JSON object"),
    "empty-body": ("/v1/chat/completions", b"", 400, None, "empty"),
    "max-tokens-string": ("/v1/chat/completions", chat(max_tokens="5"), 400, "max_tokens", "integer"),
    "messages-not-list": ("/v1/chat/completions", chat(messages="hi"), 400, "messages", ""),
    "messages-empty": ("/v1/chat/completions", chat(messages=[]), 400, "messages", ""),
    "bad-role": ("/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages", "role"),
    "temperature-negative": ("/v1/chat/completions", chat(temperature=-1.0), 400, "temperature", "temperature"),
    "negative-max-tokens": ("/v1/chat/completions", chat(max_tokens=-3), 400, "max_tokens", "at least 1"),
    "zero-max-completion": ("/v1/chat/completions", chat(max_completion_tokens=0), 400, "max_completion_tokens", ""),
    "too-many-max-tokens": ("/v1/chat/completions", chat(max_tokens=10_000), 400, "max_tokens", "max_model_len"),
    "oversized-prompt": ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "word " * 2000}]),
                         400, "messages", "max_model_len"),
    "unknown-model": ("/v1/chat/completions", chat(model="gpt-9"), 404, "model", "does not exist"),
    "minimal-effort": ("/v1/chat/completions", chat(reasoning_effort="minimal"), 400, "reasoning_effort", "minimal"),
    "named-tool-choice-unknown": ("/v1/chat/completions",
                                  chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                       tool_choice={"type": "function", "function": {"name": "g"}}), 400,
                                  "tool_choice", "not in 'tools'"),
    "bad-response-format": ("/v1/chat/completions", chat(response_format={"type": "yaml"}), 400,
                            "response_format.type", ""),
    "top-logprobs-alone": ("/v1/chat/completions", chat(top_logprobs=3), 400, "top_logprobs", ""),
    "bad-image-data": ("/v1/chat/completions", chat(messages=image_msg("data:image/png;base64,!!notbase64")), 400,
                       "messages[0].content[0]", "base64"),
    "corrupt-image": ("/v1/chat/completions",
                      chat(messages=image_msg("data:image/png;base64," + base64.b64encode(b"garbage").decode())),
                      400, "messages[0].content[0]", "image"),
    "remote-image": ("/v1/chat/completions", chat(messages=image_msg("https://example.com/cat.png")), 400,
                     "messages[0].content[0]", "no network"),
    "file-image": ("/v1/chat/completions", chat(messages=image_msg("/etc/passwd")), 400, "messages[0].content[0]",
                   "file paths"),
    "completion-ids-out-of-vocab": ("/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, 400, "prompt",
                                    "vocabulary"),
    "completion-empty": ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt", "empty"),
    "completion-prompt-type": ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt", ""),
    "completion-n-zero": ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n", ""),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bad_request(server, case):
    path, body, status, param, contains = CASES[case]
    assert_error(post(server, path, body), status, param, contains)
    ok = post(server, "/v1/chat/completions", chat())          # still serving
    assert ok.status_code == 200, ok.text


def test_image_on_text_only_model(server):
    """A good data URL is decoded, then refused because the (fake) model has no vision tower."""
    r = post(server, "/v1/chat/completions", chat(messages=image_msg(png_data_url())))
    assert_error(r, 400, "messages[0].content[0]", "no vision tower")


def test_unknown_route_and_method(server):
    assert_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert_error(httpx.get(server.url + "/v1/chat/completions"), 405)


def test_api_key():
    s = start_fake_server(api_key="sekrit")
    try:
        for path in ("/health", "/metrics", "/ping", "/version"):     # open, as in vLLM: only /v1 needs the key
            assert httpx.get(s.url + path).status_code == 200, path
        for path in ("/v1/models",):
            assert_error(httpx.get(s.url + path), 401)
            assert_error(httpx.get(s.url + path, headers={"Authorization": "Bearer wrong"}), 401)
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").chat.completions.create(model=MODEL, messages=chat()["messages"], max_tokens=2)
        r = s.client(api_key="sekrit").chat.completions.create(model=MODEL, messages=chat()["messages"], max_tokens=2)
        assert r.usage.completion_tokens >= 1
        assert httpx.get(s.url + "/metrics", headers={"Authorization": "Bearer sekrit"}).status_code == 200
    finally:
        s.stop()


def test_queue_full_gets_429():
    s = start_fake_server(step_delay=0.02, engine_kw={"max_num_seqs": 1}, max_queue_len=1)
    stop = threading.Event()

    def long_stream(i: int) -> None:
        body = chat(messages=[{"role": "user", "content": f"long {i}"}], max_tokens=400, stream=True,
                    ignore_eos=True)
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=30) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return
    try:
        threads = [threading.Thread(target=long_stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while s.state.in_flight < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        r = post(s, "/v1/chat/completions", chat())
        err = assert_error(r, 429, None, "capacity")
        assert err["type"] == "rate_limit_error" and r.headers["retry-after"] == "1"
        stop.set()
        for t in threads:
            t.join(30)
        deadline = time.monotonic() + 10
        while s.state.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        assert post(s, "/v1/chat/completions", chat()).status_code == 200
    finally:
        stop.set()
        s.stop()


def test_engine_failure_fails_only_that_request():
    """A request that makes the step raise gets a 500; a request running beside it finishes unharmed,
    with the same tokens as when run alone."""
    s = start_fake_server(step_delay=0.01)
    try:
        c = s.client()
        msgs = [{"role": "user", "content": "innocent"}]
        alone = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0,
                                          extra_body={"ignore_eos": True})
        steps_alone = s.runner.num_steps
        got = {}

        def innocent():
            got["r"] = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0,
                                                 extra_body={"ignore_eos": True})
        t = threading.Thread(target=innocent)
        t.start()
        deadline = time.monotonic() + 30
        while s.runner.num_steps == steps_alone:        # the innocent request is running (it had a step)
            assert time.monotonic() < deadline and t.is_alive(), "the innocent request never ran"
            time.sleep(0.005)
        r = post(s, "/v1/chat/completions", chat(messages=[{"role": "user", "content": "POISON"}]))
        assert_error(r, 500, None, "engine failed")
        assert sorted(map(str, s.runner.failed_steps[0])) == ["None", "POISON"]   # the innocent one ran in that step
        t.join(30)
        assert got["r"].usage.completion_tokens == 40
        assert got["r"].choices[0].message.reasoning_content == alone.choices[0].message.reasoning_content
        assert post(s, "/v1/chat/completions", chat()).status_code == 200
        assert s.engine.kv.blocks.num_free == s.engine.kv.plan.num_usable_blocks
    finally:
        s.stop()


def test_resumed_seeded_samples_continue_as_they_would_have():
    """Seeded samples (2 prompts x n=2, temperature 1) in a step that a poisoned request makes fail are
    re-run from what their clients already got; each choice's text equals the same request run alone
    (the noise is fixed by the seed of the sample and the position, so the resume is seamless)."""
    s = start_fake_server(step_delay=0.01)
    try:
        c = s.client()
        kw = dict(model=MODEL, prompt=["one two three", "four"], max_tokens=60, temperature=1.0, n=2, seed=7,
                  extra_body={"ignore_eos": True})
        alone = c.completions.create(**kw)
        texts = sorted((ch.index, ch.text) for ch in alone.choices)
        assert len({t for _, t in texts}) == 4, texts            # sampled: each choice its own text
        steps_alone, got = s.runner.num_steps, {}
        t = threading.Thread(target=lambda: got.update(r=c.completions.create(**kw)))
        t.start()
        deadline = time.monotonic() + 30
        while s.runner.num_steps < steps_alone + 3:             # the seeded samples are decoding
            assert time.monotonic() < deadline and t.is_alive(), "the seeded request never ran"
            time.sleep(0.005)
        r = post(s, "/v1/chat/completions", chat(messages=[{"role": "user", "content": "POISON"}]))
        assert_error(r, 500, None, "engine failed")
        t.join(30)
        assert len(s.runner.failed_steps[0]) > 1                # the seeded samples were in the failed step
        assert sorted((ch.index, ch.text) for ch in got["r"].choices) == texts
    finally:
        s.stop()
