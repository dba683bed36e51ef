"""A client that stops reading costs bounded memory: its generation pauses once ``stream_buffer_steps`` steps wait
unread (and resumes as it reads), and its connection is dropped (the request aborted) after ``stall_timeout``
seconds with a full send buffer. Before, such a stream kept generating into an unbounded queue (n=64 with
top_logprobs 20: +25 MB per 50 s)."""

from __future__ import annotations

import json
import socket
import time

import pytest

from kimik3.engine import SamplingParams
from kimik3.serve.engine_loop import Job, PromptInput
from kimik3.serve.limits import Limits
from tests.serve.conftest import MODEL, start_fake_server


def _wait(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _outputs(engine, job_id: str) -> int:
    group = engine.groups.get(f"{job_id}-0")
    return sum(r.num_output_tokens for r in group.children) if group is not None else -1


def test_generation_pauses_when_the_reader_is_behind_and_resumes():
    s = start_fake_server(limits=Limits(stream_buffer_steps=8))
    try:
        ids = s.engine.get_tokenizer().encode("an unread stream")
        job = Job("unread", [PromptInput(ids)], SamplingParams(n=2, max_tokens=200, ignore_eos=True))
        s.state.loop.submit(job)
        _wait(lambda: job.paused)
        time.sleep(0.5)                                    # paused: nothing more is generated
        held = _outputs(s.engine, "unread")
        assert job.posted <= 8 + 2 and held <= 2 * (8 + 2), (job.posted, held)
        time.sleep(0.5)
        assert _outputs(s.engine, "unread") == held and not s.engine.has_unfinished_requests()
        while not job.done:                                # the reader catches up: it resumes and finishes
            if job.posted > job.taken:
                s.state.loop.taken(job)
            time.sleep(0.001)
        assert job.posted >= 100 and all(len(c.token_ids) == 200 for c in job.choices)
        _wait(lambda: s.engine.kv.blocks.num_free == s.engine.kv.plan.num_usable_blocks)
    finally:
        s.stop()


def test_a_stalled_connection_is_dropped_and_its_request_aborted():
    s = start_fake_server(limits=Limits(stall_timeout=0.5, stream_buffer_steps=8))
    try:
        c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)      # a reader that never reads: small windows
        c.connect(("127.0.0.1", s.port))
        _wait(lambda: len(s.server.server_state.connections) == 1)
        (conn,) = s.server.server_state.connections
        conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        conn.transport.set_write_buffer_limits(high=4096)
        body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 900, "n": 8, "logprobs": 5, "stream": True,
                           "ignore_eos": True}).encode()
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n" % len(body) + body)
        _wait(lambda: s.state.in_flight == 8)
        start = time.monotonic()
        _wait(lambda: s.state.in_flight == 0, timeout=60)         # dropped: the request is aborted
        assert time.monotonic() - start < 30
        _wait(lambda: s.engine.stats().num_running == 0)
        _wait(lambda: s.engine.kv.blocks.num_free == s.engine.kv.plan.num_usable_blocks)
        with pytest.raises((ConnectionResetError, BrokenPipeError, OSError)):
            while c.recv(1 << 16):       # what was buffered, then the reset
                pass
            raise ConnectionResetError
        c.close()
    finally:
        s.stop()


def test_an_abort_reaches_a_long_prefill_within_one_chunk():
    """A client that leaves during a long prefill: its request stops at the next chunk boundary (a 1M-token prompt
    took 20.6 s to go idle on a CPU server)."""
    s = start_fake_server(step_delay=0.05, engine_kw={"max_model_len": 2048, "max_num_batched_tokens": 64})
    try:
        job = Job("long", [PromptInput(list(range(5, 1805)))], SamplingParams(max_tokens=4))
        s.state.loop.submit(job)
        _wait(lambda: s.engine.runner.num_steps >= 3)
        steps = s.engine.runner.num_steps
        s.state.loop.abort(job)
        _wait(lambda: job.done and not s.engine.has_unfinished_requests())
        assert s.engine.runner.num_steps - steps <= 2          # the chunk in flight and at most one more
        assert steps * 64 < 1800
        _wait(lambda: s.engine.kv.blocks.num_free == s.engine.kv.plan.num_usable_blocks)
    finally:
        s.stop()
