"""A real server on a free loopback port, driven by the official ``openai`` client.

Most tests serve the exact fake model of tests/engine (vocabulary of the embedded tokenizer) behind a
``ScriptedRunner``, so outputs are fast and known; ``real_server`` serves the embedded tiny K3.
"""

from __future__ import annotations

import socket
import threading
import time

import openai
import pytest

import kimik3
from kimik3.engine import EngineConfig, LLMEngine
from kimik3.serve import ServeOptions, create_app
from kimik3.serve.lifecycle import Server, server_config
from tests.engine.fake_model import FakeModel
from tests.serve.scripted import ScriptedRunner

MODEL = "k3-test"
END_OF_MSG = kimik3.load_tokenizer(kimik3.DEFAULT_MODEL).convert_tokens_to_ids("<|end_of_msg|>")


class LiveServer:
    def __init__(self, app, engine=None, runner=None):
        self.app = app
        self.engine = engine
        self.runner = runner
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = server_config(app, app.state.kimik3.options.limits, log_level="warning",
                               timeout_graceful_shutdown=5)
        self.server = Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)

    @property
    def state(self):
        return self.app.state.kimik3

    def client(self, api_key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, **kw)

    def async_client(self, api_key: str = "none", **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def fake_engine(max_num_seqs: int = 64, max_model_len: int = 1024, tokenizer=None, **kw) -> LLMEngine:
    tok = tokenizer or kimik3.load_tokenizer(kimik3.DEFAULT_MODEL)
    model = FakeModel(vocab_size=tok.vocab_size, eos_token_id=END_OF_MSG)
    config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=16,
                          max_num_batched_tokens=kw.pop("max_num_batched_tokens", 4096), **kw)
    return LLMEngine(model, config, tokenizer=tok)


def start_fake_server(scripts=None, step_delay: float = 0.0, engine_kw=None, **options) -> LiveServer:
    engine = fake_engine(**(engine_kw or {}))
    runner = ScriptedRunner(engine.runner, engine.get_tokenizer(), scripts, step_delay)
    engine.runner = runner
    options.setdefault("served_model_name", MODEL)
    app = create_app(engine, ServeOptions(**options))
    return LiveServer(app, engine, runner)


@pytest.fixture(scope="module")
def server():
    s = start_fake_server()
    yield s
    s.stop()

