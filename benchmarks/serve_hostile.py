"""Hostile requests against a real CPU server (#52): while each one runs, does ``/health`` still answer within
100 ms and does an innocent stream keep its inter-token gaps under 250 ms? And the plain latencies: ``GET
/v1/models`` (target: median under 5 ms) and a 1-token completion on the default model (under 40 ms).

Starts ``kimik3 serve`` (the embedded default model, 127.0.0.1, an API key; ``--serve-args`` adds flags) from this
tree, then, in one run:

- ``/v1/models`` and a 1-token ``/v1/completions``, each timed over a kept-alive connection (median, p90);
- ``baseline``: ``/health`` polled every 20 ms and an innocent stream read, with nothing hostile running (the box
  is shared: this row is what the load of the moment costs without any hostile request);
- each hostile case (below) with the same watchers: the watchers' worst ``/health`` answer and worst gap
  between two tokens of the innocent stream while the case runs, the hostile requests' statuses and seconds,
  and the server's resident-memory peak over its resident memory at the case's start.

Cases: ``defs_chain`` (a schema whose ``$defs`` chain 1,000 references), ``rule_chain`` (a 3,000-rule grammar),
``regex_n64`` (``x{1000000}`` with n=64), ``allof22`` (``allOf`` of 22 patterns ``^(.*a.*){i}$``),
``tokenize_57mib`` (a 57 MiB prompt to ``/tokenize``), ``images_chat`` / ``images_responses`` (five 50-megapixel
PNGs in one request), ``images_tokenize`` (eight concurrent ``/tokenize`` requests with ten each, authenticated),
``images_unauth`` (the same without the key), ``prompt_logprobs_8k`` (``prompt_logprobs=20`` on an 8,000-token
prompt), ``n_logprobs`` (n=64 x ``logprobs=20`` x 195 tokens, the most ``--max-response-logprobs`` admits),
``stopped_reader`` (a stream of n=64 with ``logprobs=20`` whose client never reads, held 8 s).

CPU timings on a shared 2-core box are noisy (other sessions' load shows in the baseline row); the load average
is printed beside the table.

    python benchmarks/serve_hostile.py [--cases=a,b] [--port=18473] [--serve-args="--max-num-seqs 64"] [--help]

``--cases=`` with one cheap case (``--cases=rule_chain``) is the quick check that the script still runs: the
latencies, the baseline row and that case.
"""

from __future__ import annotations

import base64
import datetime
import http.client
import io
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import arg, commit_id, log, save_results  # noqa: E402
from kimik3.testing import object_chain, rule_chain  # noqa: E402

MODEL = "default_model"
KEY = "hostile-bench-key"
HEALTH_TARGET, GAP_TARGET, MODELS_TARGET, ONE_TOKEN_TARGET = 0.100, 0.250, 0.005, 0.040
FLAGS = ("--cases=", "--port=", "--serve-args=")


# ---- a client with as little overhead as the standard library allows --------------------------------------------

class Client:
    def __init__(self, port: int, key: str | None = KEY, timeout: float = 300):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        self.headers = {"content-type": "application/json"}
        if key:
            self.headers["authorization"] = f"Bearer {key}"

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        self.conn.request(method, path, body=body, headers=self.headers)
        r = self.conn.getresponse()
        return r.status, r.read()

    def post(self, path: str, body: dict | bytes) -> tuple[int, bytes]:
        return self.request("POST", path, body if isinstance(body, bytes) else json.dumps(body).encode())

    def close(self) -> None:
        self.conn.close()


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


class Watch:
    """``/health`` every 20 ms and an innocent stream (restarted when it ends), beside a hostile case."""

    def __init__(self, port: int):
        self.port = port
        self.health: list[float] = []
        self.gaps: list[float] = []
        self.gap_times: list[float] = []     # when each gap ended
        self.tokens = 0
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._stream, daemon=True),
                        threading.Thread(target=self._poll, daemon=True)]
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + 60
        while self.tokens < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        self.health.clear()
        self.gaps.clear()
        self.gap_times.clear()

    def _stream(self) -> None:
        body = json.dumps({"model": MODEL, "prompt": "An innocent stream", "max_tokens": 4000, "ignore_eos": True,
                           "stream": True}).encode()
        c = Client(self.port)
        try:
            while not self.stop.is_set():
                c.conn.request("POST", "/v1/completions", body=body, headers=c.headers)
                r = c.conn.getresponse()
                last = None
                while not self.stop.is_set():
                    line = r.readline()
                    if not line:
                        break
                    if not line.startswith(b"data: {"):
                        continue
                    now = time.perf_counter()
                    if last is not None:
                        self.gaps.append(now - last)
                        self.gap_times.append(now)
                    last = now
                    self.tokens += 1
                if self.stop.is_set():
                    return
                r.read()
        except OSError as e:
            self.errors.append(f"stream: {e!r}")
        finally:
            c.close()

    def _poll(self) -> None:
        c = Client(self.port, key=None, timeout=60)
        try:
            while not self.stop.is_set():
                t = time.perf_counter()
                status, _ = c.request("GET", "/health")
                self.health.append(time.perf_counter() - t if status == 200 else float("inf"))
                time.sleep(0.02)
        except OSError as e:
            self.errors.append(f"health: {e!r}")
        finally:
            c.close()

    def finish(self, start: float = 0.0, answered: float = 0.0) -> dict:
        """The watchers' figures; ``start``/``answered``: when the hostile requests were sent and the last answered
        (perf_counter), to place the longest gap."""
        self.stop.set()
        for t in self.threads:
            t.join(30)
        worst = max(range(len(self.gaps)), key=self.gaps.__getitem__, default=None)
        h, g = sorted(self.health) or [float("nan")], sorted(self.gaps) or [float("nan")]
        return {"health_max": h[-1], "health_p99": h[int(0.99 * (len(h) - 1))], "health_n": len(self.health),
                "gap_max": g[-1], "gap_p99": g[int(0.99 * (len(g) - 1))], "gap_median": statistics.median(g),
                "tokens": len(self.gaps), "watch_errors": self.errors,
                "gap_max_ended_after_start": None if worst is None else self.gap_times[worst] - start,
                "answered_after_start": answered - start}


# ---- the hostile cases -------------------------------------------------------------------------------------------

def _completion(**kw) -> dict:
    return {"model": MODEL, "prompt": "x", "max_tokens": 4, **kw}


def png_50mp() -> str:
    """A 7071 x 7071 PNG (49.998 megapixels, about 150 KB: a gradient, so it is cheap to send, not to decode)."""
    from PIL import Image
    img = Image.linear_gradient("L").resize((7071, 7071)).convert("RGB")
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image_chat(url: str, k: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}} for _ in range(k)]
             + [{"type": "text", "text": "What is in these pictures?"}]}]


def cases(port: int, vocab: int) -> dict:
    """name -> a list of (route, body bytes, key or None) sent at once, one thread each."""
    import random
    rng = random.Random(0)
    enc = lambda body: json.dumps(body).encode()                     # noqa: E731
    sentence = "The quick brown fox jumps over the lazy dog; a stitch in time saves nine. "
    out = {
        "defs_chain": [("/v1/completions", enc(_completion(response_format={
            "type": "json_schema", "json_schema": {"name": "c", "schema": object_chain(1000)}})), KEY)],
        "rule_chain": [("/v1/completions", enc(_completion(guided_grammar=rule_chain(3000))), KEY)],
        "regex_n64": [("/v1/completions", enc(_completion(n=64, guided_regex="x{1000000}")), KEY)],
        "allof22": [("/v1/completions", enc(_completion(guided_json={"type": "string", "allOf": [
            {"pattern": f"^(.*a.*){{{i}}}$"} for i in range(1, 23)]})), KEY)],
        "tokenize_57mib": [("/tokenize", enc({"model": MODEL, "prompt": sentence * (57 * 2**20 // len(sentence))}),
                            KEY)],
        "prompt_logprobs_8k": [("/v1/completions", enc({"model": MODEL, "max_tokens": 1, "prompt_logprobs": 20,
                                                        "prompt": [rng.randrange(300, vocab) for _ in range(8000)]}),
                                KEY)],
        "n_logprobs": [("/v1/completions", enc(_completion(n=64, logprobs=20, max_tokens=195, ignore_eos=True)), KEY)],
    }
    url = png_50mp()
    out["images_chat"] = [("/v1/chat/completions", enc({"model": MODEL, "max_tokens": 4,
                                                        "messages": _image_chat(url, 5)}), KEY)]
    out["images_responses"] = [("/v1/responses", enc({"model": MODEL, "max_output_tokens": 4, "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": url} for _ in range(5)]}]}), KEY)]
    ten = enc({"model": MODEL, "messages": _image_chat(url, 10)})
    out["images_tokenize"] = [("/tokenize", ten, KEY)] * 8
    out["images_unauth"] = [("/tokenize", ten, None)] * 8
    out["stopped_reader"] = "stopped_reader"
    return out


def stopped_reader(port: int, hold: float = 8.0) -> list[tuple[int, float]]:
    """A stream of n=64 with logprobs=20 whose client never reads (a small receive window), held ``hold`` s."""
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 4000, "n": 64, "logprobs": 20, "stream": True,
                       "ignore_eos": True}).encode()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    t = time.perf_counter()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
              b"authorization: Bearer " + KEY.encode() + b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    time.sleep(hold)
    status = s.recv(12)[9:12]
    s.close()
    return [(int(status) if status.isdigit() else 0, time.perf_counter() - t)]


def run_requests(port: int, reqs) -> list[tuple[int, float]]:
    if reqs == "stopped_reader":
        return stopped_reader(port)
    results: list = [None] * len(reqs)

    def one(i, route, body, key):
        c = Client(port, key=key)
        t = time.perf_counter()
        try:
            status, _ = c.post(route, body)
        except OSError:
            status = 0
        results[i] = (status, time.perf_counter() - t)
        c.close()
    threads = [threading.Thread(target=one, args=(i, *r)) for i, r in enumerate(reqs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


# ---- the server -------------------------------------------------------------------------------------------------

def rss(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak(pid: int) -> None:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")          # VmHWM := VmRSS
    except OSError:
        pass


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kimik3.cli", "serve", "--port", str(port), "--api-key", KEY, "--disable-log-stats",
           "--uvicorn-log-level", "warning", *extra]
    log("$ " + " ".join(cmd))
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(OUT_LOG, "w"))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {OUT_LOG}")
        try:
            c = Client(port, timeout=2)
            if c.request("GET", "/health")[0] == 200:
                c.close()
                return proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("the server did not come up in 300 s")


OUT_LOG = Path(os.environ.get("OUT", ROOT / "bench_out")) / "serve_hostile.server.log"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of the server process so far (what the load of other processes does not inflate)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def latencies(port: int, pid: int) -> dict:
    c = Client(port)
    c.request("GET", "/v1/models")
    cpu = cpu_seconds(pid)
    models = timed(lambda: c.request("GET", "/v1/models"), 200)
    models_cpu = (cpu_seconds(pid) - cpu) / 200
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 1}).encode()
    for _ in range(5):
        c.post("/v1/completions", body)
    cpu = cpu_seconds(pid)
    one = timed(lambda: c.post("/v1/completions", body), 50)
    one_cpu = (cpu_seconds(pid) - cpu) / 50
    c.close()
    fresh = timed(lambda: Client(port).request("GET", "/v1/models"), 50)
    q = lambda xs, p: sorted(xs)[int(p * (len(xs) - 1))]             # noqa: E731
    return {"models_median": statistics.median(models), "models_p90": q(models, 0.9),
            "models_new_connection_median": statistics.median(fresh),
            "one_token_median": statistics.median(one), "one_token_p90": q(one, 0.9), "one_token_min": min(one),
            "models_server_cpu": models_cpu, "one_token_server_cpu": one_cpu}


def main() -> int:
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__.strip())
        return 0
    unknown = [a for a in sys.argv[1:] if not any(a.startswith(f) for f in FLAGS)]
    if unknown:
        raise SystemExit(f"serve_hostile.py: unknown arguments {unknown}; known: {' '.join(FLAGS)}")
    port = int(arg("port", "18473"))
    OUT_LOG.parent.mkdir(parents=True, exist_ok=True)
    proc = start_server(port, shlex.split(arg("serve-args", "")))
    results = {"commit": commit_id(), "date": datetime.date.today().isoformat(), "card": "CPU",
               "cores": os.cpu_count(), "load_before": os.getloadavg(), "rows": []}
    try:
        vocab = json.loads((ROOT / "kimik3/default_model/config.json").read_text())["text_config"]["vocab_size"]
        results["latency"] = latencies(port, proc.pid)
        lat = results["latency"]
        log(f"GET /v1/models median {lat['models_median'] * 1e3:.2f} ms (p90 {lat['models_p90'] * 1e3:.2f}; "
            f"new connection each {lat['models_new_connection_median'] * 1e3:.2f}; server CPU "
            f"{lat['models_server_cpu'] * 1e3:.2f} ms each) [target < 5 ms]")
        log(f"1-token completion median {lat['one_token_median'] * 1e3:.1f} ms (min {lat['one_token_min'] * 1e3:.1f},"
            f" p90 {lat['one_token_p90'] * 1e3:.1f}; server CPU {lat['one_token_server_cpu'] * 1e3:.1f} ms each) "
            f"[target < 40 ms]")
        every = cases(port, vocab)
        chosen = [n for n in (arg("cases") or "").split(",") if n] or list(every)
        bad = [n for n in chosen if n not in every]
        if bad:
            raise SystemExit(f"unknown cases {bad}; known: {', '.join(every)}")
        for name in ["baseline"] + chosen:
            start_rss = rss(proc.pid)
            reset_peak(proc.pid)
            watch = Watch(port)
            t = time.perf_counter()
            if name == "baseline":
                time.sleep(3.0)
                answers = []
            else:
                answers = run_requests(port, every[name])
            answered = time.perf_counter()
            time.sleep(0.3)
            row = {"case": name, "seconds": time.perf_counter() - t, "statuses": sorted({a[0] for a in answers}),
                   "request_seconds_max": max((a[1] for a in answers), default=0.0),
                   "rss_peak_over_start": rss(proc.pid, "VmHWM") - start_rss, "load": os.getloadavg()[0],
                   **watch.finish(t, answered)}
            if proc.poll() is not None:
                row["crashed"] = proc.returncode
            results["rows"].append(row)
            ok = row["health_max"] < HEALTH_TARGET and row["gap_max"] < GAP_TARGET
            log(f"{name:20s} statuses {row['statuses']} in {row['request_seconds_max']:.2f} s | /health max "
                f"{row['health_max'] * 1e3:6.1f} ms | gap max {row['gap_max'] * 1e3:6.1f} ms (p99 "
                f"{row['gap_p99'] * 1e3:.0f}, median {row['gap_median'] * 1e3:.0f}, {row['tokens']} tokens) | rss +"
                f"{row['rss_peak_over_start'] / 2**20:.0f} MiB | load {row['load']:.1f} | longest gap ended "
                f"{row['gap_max_ended_after_start'] or 0:.1f} s in, answered {row['answered_after_start']:.1f} s"
                f"{'' if ok else '  MISSED'}")
            if "crashed" in row:
                raise SystemExit(f"the server died (status {proc.returncode}) during {name}")
            save_results("serve_hostile.json", results)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    table(results)
    return 0


def table(results: dict) -> None:
    lat = results["latency"]
    print(f"\n# serve_hostile, card CPU ({results['cores']} cores, shared; load {results['load_before'][0]:.1f} at "
          f"start), commit {results['commit']}, {results['date']}")
    print(f"GET /v1/models median {lat['models_median'] * 1e3:.2f} ms; 1-token completion median "
          f"{lat['one_token_median'] * 1e3:.1f} ms\n")
    print("| case | status | request s | /health max ms | stream gap max ms (p99) | RSS peak + MiB | load |")
    print("|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        print(f"| {r['case']} | {','.join(map(str, r['statuses'])) or '-'} | {r['request_seconds_max']:.2f} | "
              f"{r['health_max'] * 1e3:.0f} | {r['gap_max'] * 1e3:.0f} ({r['gap_p99'] * 1e3:.0f}) | "
              f"{r['rss_peak_over_start'] / 2**20:.0f} | {r['load']:.1f} |")


if __name__ == "__main__":
    raise SystemExit(main())
