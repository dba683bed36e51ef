"""`kimik3 serve` shutdown on SIGTERM: draining starts at the signal (new and queued requests 503 at
once), running streams get until --shutdown-timeout and then an SSE error event and [DONE], a running
non-streamed request a 503 JSON body; the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_and_exits_zero(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "kimik3.cli", "serve", "--port", str(port), "--max-num-seqs", "2",
                             "--max-model-len", "4096", "--shutdown-timeout", "2", "--served-model-name", "m"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        long = {"model": "m", "prompt": "tell me", "max_tokens": 4000, "ignore_eos": True}
        streams: dict[int, list[str]] = {}
        done: dict[str, tuple[float, httpx.Response]] = {}

        def stream(i: int) -> None:
            lines = streams.setdefault(i, [])
            with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": True}, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)

        def plain(name: str) -> None:
            r = httpx.post(url + "/v1/completions", json=long, timeout=60)
            done[name] = (time.monotonic(), r)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        while sum(len(v) for v in streams.values()) < 4 or len(streams) < 2:
            time.sleep(0.02)
        queued = threading.Thread(target=plain, args=("queued",))    # max_num_seqs=2: it waits
        queued.start()
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        queued.join(30)
        at, r = done["queued"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        assert at - sent < 1.5, f"the queued request waited {at - sent:.1f} s"
        r = httpx.post(url + "/v1/completions", json=long, timeout=10)     # arrives while draining
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert httpx.get(url + "/health", timeout=10).status_code == 503       # load balancers look elsewhere
        for t in threads:
            t.join(30)
        for i, lines in streams.items():
            assert lines[-1] == "data: [DONE]", (i, lines[-3:])
            err = json.loads(lines[-2][len("data: "):])
            assert err["error"]["code"] == "shutting_down" and err["error"]["type"] == "server_unavailable"
        assert proc.wait(30) == 0
        log.seek(0)
        text = log.read()
        assert "Traceback" not in text, text[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
