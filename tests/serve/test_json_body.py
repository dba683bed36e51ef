"""Large JSON bodies are rendered in pieces (``kimik3.serve.json_body``): the bytes ``JSONResponse`` would send, with
no single ``json.dumps`` call over a bounded share of the body (each call holds the GIL: a 10 MB body held it ~0.8 s,
stalling /health and every stream)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kimik3.serve import json_body

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.text(max_size=8),
                    st.floats(allow_nan=False, allow_infinity=False))
bodies = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=12),
                                                      st.dictionaries(st.text(max_size=4), inner, max_size=6)),
                      max_leaves=300)


def _reference(body) -> bytes:
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


@settings(max_examples=300, deadline=None)
@given(bodies, st.integers(1, 40))
def test_render_is_json_dumps(body, piece):
    assert json_body.render(body, piece) == _reference(body)


def _logprob_body(n: int, tokens: int, top: int) -> dict:
    entry = {"token": "é", "logprob": -0.25, "bytes": [195, 169],
             "top_logprobs": [{"token": f"t{j}", "logprob": -1.5, "bytes": [116]} for j in range(top)]}
    return {"id": "x", "choices": [{"index": i, "message": {"content": "ab"}, "logprobs": {"content": [entry] * tokens},
                                    "finish_reason": "length"} for i in range(n)],
            "prompt_logprobs": [None] + [{str(j): {"logprob": -2.0, "decoded_token": "x"} for j in range(21)}] * 2000,
            "usage": {"prompt_tokens": 1}}


def test_no_call_renders_more_than_a_piece(monkeypatch):
    """A body of ~600k scalars (n=8 x 200 tokens x 20 top logprobs, and 2,000 prompt positions x 21) goes out in
    calls of at most ~2 pieces' worth each, the same bytes as one json.dumps."""
    sizes = []
    dumps = json_body._dumps

    def counted(obj):
        sizes.append(json_body.weight(obj))
        return dumps(obj)
    monkeypatch.setattr(json_body, "_dumps", counted)
    body = _logprob_body(8, 200, 20)
    assert json_body.weight(body) > 100 * json_body.PIECE
    assert json_body.render(body) == _reference(body)
    assert max(sizes) <= 2 * json_body.PIECE and len(sizes) > 50


def test_nan_is_refused_as_jsonresponse_refuses_it():
    with pytest.raises(ValueError):
        json_body.render({"a": [math.nan] * 5000})


def test_large_logprob_responses_are_paced(monkeypatch):
    """Formatting and rendering 8,000 x 21 prompt logprobs (~1 s of Python on the dev box) beside the engine thread
    slowed the innocent stream's overlapping step to 0.66 s (the GIL convoy: the engine thread re-takes the GIL
    after every torch op). The work now sleeps (the GIL free) about as long as it runs: the pauses add up to at
    least a quarter of the work's CPU time (about all of it on a quiet box; collections and the final join are not
    paced), spread over it, and the bytes are unchanged."""
    import time

    from kimik3.serve import responses
    from kimik3.serve.exchange import _final_bytes

    class Formatter(responses._Formatter):
        chunk_object = "text_completion"

        def final(self, usage):
            return {"id": self.id, "choices": [{"index": 0, "text": "x"}], "usage": usage}

    slept = []
    monkeypatch.setattr(json_body.time, "sleep", slept.append)
    rows = [None] + [{1000 + j: -1.25 * j for j in range(21)} for _ in range(8000)]
    params = type("P", (), {"prompt_logprobs": 20, "n": 1})()
    start = time.thread_time()          # CPU time: the pacer counts wall time, which is never less
    out = _final_bytes(Formatter("x", "m", None, False), {"prompt_tokens": 8001}, {0: rows}, params)
    work = time.thread_time() - start
    plain = Formatter("x", "m", None, False)
    assert out == _reference(plain.add_prompt_logprobs(plain.final({"prompt_tokens": 8001}), {0: rows}, 1))
    assert sum(slept) >= 0.25 * work, (sum(slept), work)
    assert len(slept) >= work / (4 * json_body.BURST)
