"""Large bodies validated in a body worker process (#52): the same model or the same refusal as in the server,
a prompt that cannot fit refused without being built in the server, and a failed worker never fails a request."""

from __future__ import annotations

import json
import tracemalloc

import httpx
import pytest

from kimik3.serve.body_worker import BodyWorkers, WorkerFault
from kimik3.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    TokenizeChecks,
    TokenizeRequest,
    validation_error,
)
from tests.serve.conftest import MODEL, start_fake_server


def _chunks(body: bytes) -> list[bytes]:
    return [body[i:i + 65536] for i in range(0, len(body), 65536)]


def _here(model, checks, body: bytes):
    """What the server answers without a worker: the model, or the refusal's fields."""
    try:
        req = model.model_validate_json(body)
        if checks is not None:
            checks(req)
        return req
    except APIError as e:
        return e.status, e.message, e.param, e.code
    except Exception as e:  # noqa: BLE001 - a ValidationError
        err = validation_error(e)
        return err.status, err.message, err.param, err.code


@pytest.fixture(scope="module")
def workers():
    w = BodyWorkers()
    yield w
    w.close()


CHECKS = TokenizeChecks(MODEL, True, 64, 64 * 16)


@pytest.mark.parametrize("model, checks, body", [
    (TokenizeRequest, None, {"prompt": "héllo " * 1000, "return_token_strs": True}),
    (TokenizeRequest, CHECKS, {"model": MODEL, "prompt": "x" * (64 * 16 + 1)}),
    (TokenizeRequest, CHECKS, {"model": "other", "prompt": "x" * (64 * 16 + 1)}),      # the model comes first
    (TokenizeRequest, CHECKS, {"prompt": "x", "messages": []}),
    (TokenizeRequest, None, {"prompt": 5}),
    (TokenizeRequest, None, {"prompt": "x", "colour": "red"}),
    (ChatCompletionRequest, None, {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 4000}}]}]}),
])
def test_the_worker_answers_as_the_server_would(workers, model, checks, body):
    raw = json.dumps(body).encode()
    try:
        got = workers.validate(model, checks, _chunks(raw))
    except APIError as e:
        got = e.status, e.message, e.param, e.code
    assert got == _here(model, checks, raw)


def test_a_prompt_that_cannot_fit_is_never_built_in_the_server(workers):
    """A 57 MiB /tokenize prompt held the server's GIL ~120 ms while pydantic built it, only to be refused for
    its length. In the worker it is refused there: the server allocates nothing of its size (``tracemalloc``;
    validated here, the 8 MiB prompt alone is 8 MiB)."""
    raw = json.dumps({"model": MODEL, "prompt": "y" * (8 << 20)}).encode()
    chunks = _chunks(raw)
    workers.validate(TokenizeRequest, None, [b'{"prompt": "warm"}'])       # the worker's start is not counted
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        with pytest.raises(APIError) as e:
            workers.validate(TokenizeRequest, CHECKS, chunks)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert (e.value.status, e.value.code, e.value.param) == (400, "context_length_exceeded", "prompt")
    assert peak < 1 << 20, peak


def test_a_body_in_many_tiny_chunks_reaches_the_worker(workers):
    """A client may send its body in pieces of a few bytes: more buffers than one writev takes (IOV_MAX, 1024 on
    Linux; more is EINVAL, which faulted the worker and put the body back on the server)."""
    raw = json.dumps({"prompt": "z" * 5000}).encode()
    assert workers.validate(TokenizeRequest, None, [raw[i:i + 2] for i in range(0, len(raw), 2)]).prompt == "z" * 5000


def test_a_dead_worker_is_a_fault_and_is_replaced(workers):
    workers.validate(TokenizeRequest, None, [b'{"prompt": "a"}'])
    workers._pool._idle[0].proc.kill()
    with pytest.raises(WorkerFault):
        workers.validate(TokenizeRequest, None, [b'{"prompt": "b"}'])
    assert workers.validate(TokenizeRequest, None, [b'{"prompt": "c"}']).prompt == "c"


def test_tokenize_refuses_a_large_body_as_a_small_one(monkeypatch):
    """Through the server: a body over WORKER_BODY_BYTES goes to the worker and gets the answer a small body gets
    (an over-long prompt's 400, a wrong model's 404 before it, a fine prompt's tokens); when the worker fails,
    the server validates the body itself."""
    from kimik3.serve import body_worker, exchange
    monkeypatch.setattr(exchange, "WORKER_BODY_BYTES", 1 << 16)
    s = start_fake_server(engine_kw={"max_model_len": 64})
    try:
        asked = []
        validate = s.state.body_workers.validate
        monkeypatch.setattr(s.state.body_workers, "validate", lambda *a: asked.append(a[2]) or validate(*a))
        limit = 64 * s.engine.get_tokenizer().max_token_chars

        def post(body: dict) -> httpx.Response:
            return httpx.post(s.url + "/tokenize", json=body, timeout=60)
        small, large = post({"prompt": "z" * (limit + 1)}), post({"prompt": "z" * max(limit + 1, 1 << 17)})
        assert small.status_code == 400 and large.json() == small.json() and asked, (small.text, asked)
        assert post({"model": "other", "prompt": "z" * (1 << 17)}).status_code == 404
        fine = post({"prompt": "hello world", "add_special_tokens": True, "tools": [{"x": "y" * (1 << 17)}]})
        assert fine.json()["tokens"] == s.engine.get_tokenizer().encode("hello world"), fine.text
        monkeypatch.setattr(s.state.body_workers, "validate", lambda *a: (_ for _ in ()).throw(
            body_worker.WorkerFault("test")))
        assert post({"prompt": "z" * max(limit + 1, 1 << 17)}).json() == small.json()
    finally:
        s.stop()
