"""Served throughput against the offline engine on the same workload (#18 item 5).

``--requests`` streaming completions (random ``--prompt``-token prompts, ``--output`` tokens each,
greedy, ``ignore_eos``) sent ``--concurrency`` at a time from a client in another process (the
standard library's ``http.client``, so nothing but the server competes for this process's GIL)
to ``create_app`` + uvicorn in this process, for ``--passes`` identical passes in a row; then the
same requests through ``LLMEngine`` directly with ``max_num_seqs`` = the concurrency, after emptying the
prefix cache (so offline does the work of pass 1; later passes hit the cache), twice (the ratio uses the second,
warm run). Reports output
tok/s and time to first token (p50 / p99) per pass, and each pass's ratio to offline.

    python benchmarks/serve_vs_offline.py                              # the embedded tiny model, CPU
    python benchmarks/serve_vs_offline.py --slice --device cuda        # the K3-width GPU slice, graphs
    python benchmarks/serve_vs_offline.py --null --async-scheduling    # a model that costs nothing: host work only

``--slice`` builds the K3-width 4-layer slice of ``benchmarks/gpu/bench_slice.py`` with the synthetic
163,840-token tokenizer of ``structured.py``. The engine is warmed up first as ``build_engine`` does on
a GPU (``--no-warmup``: not). ``--null``: ``host_step.py``'s model whose forward costs nothing (its decode steps
on the CUDA-graph path's host work), with the embedded model's tokenizer: the figures are then the server's and
the engine's host work alone (the CPU time a step of each thread is the measure; on a 2-core box the client
competes for the cores, so the output rates understate both). ``--switch-interval S``: the interpreter's thread switch interval
(``sys.setswitchinterval``; Python's default is 5 ms) for the whole run: how long the event loop's thread may hold
the GIL while the engine thread waits to launch the next step.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import http.client
import json
import multiprocessing
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def one_request(port: int, ids: list[int], max_tokens: int) -> tuple[float, float, int]:
    """One streaming completion: (seconds to the first token, seconds in all, completion tokens)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    body = json.dumps({"model": "bench", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    first, tokens = None, 0
    for line in resp:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
            first = time.perf_counter() - t0
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    conn.close()
    return first if first is not None else float("nan"), time.perf_counter() - t0, tokens


def client(port: int, prompts: list[list[int]], max_tokens: int, concurrency: int, passes: int, out) -> None:
    """(In the client process.) ``passes`` passes over ``prompts``; one dict per pass into ``out``."""
    done = 0
    try:
        for done in range(passes):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                rows = list(pool.map(lambda p: one_request(port, p, max_tokens), prompts))
            wall = time.perf_counter() - t0
            ttft = sorted(r[0] for r in rows)
            out.put({"wall_s": wall, "output_tok_s": sum(r[2] for r in rows) / wall,
                     "completion_tokens": sum(r[2] for r in rows), "ttft_p50_s": ttft[len(ttft) // 2],
                     "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], "ttft_max_s": ttft[-1]})
    except Exception as e:                       # the parent prints it (once per pass it waits for)
        for _ in range(done, passes):
            out.put({"error": f"{type(e).__name__}: {e}"})


class StackSampler:
    """Every ``interval`` s, the Python stack of each other thread of this process: counts (thread, the
    innermost frame in kimik3 / fla / triton / torch code, the kimik3 calls above it), to tell where the
    engine thread's time went in a pass (a stall: compiling, autotuning, waiting)."""

    ROOTS = ("kimik3", "fla", "triton", "torch")

    def __init__(self, interval: float = 0.02):
        self.interval, self.counts, self._stop = interval, collections.Counter(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = threading.get_ident()
        names = {}
        while not self._stop.wait(self.interval):
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                inner, calls = None, []
                while frame is not None:
                    path = frame.f_code.co_filename.replace("\\", "/")
                    parts = path.split("/")
                    root = next((r for r in self.ROOTS if r in parts), None)
                    if root is not None:
                        at = f"{'/'.join(parts[parts.index(root):])}:{frame.f_lineno} {frame.f_code.co_name}"
                        inner = inner or at
                        if root == "kimik3" and len(calls) < 4:
                            calls.append(frame.f_code.co_name)
                    frame = frame.f_back
                if inner is not None:
                    if ident not in names:
                        names = {t.ident: t.name for t in threading.enumerate()}
                    self.counts[(names.get(ident, str(ident)), inner, " < ".join(calls))] += 1

    def start(self) -> None:
        self._thread.start()

    def take(self) -> collections.Counter:
        counts, self.counts = self.counts, collections.Counter()
        return counts

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class GcClock:
    """Wall time spent in the interpreter's garbage collections (any thread) and the number of full ones."""

    def __init__(self):
        self.seconds, self.full, self._t0 = 0.0, 0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.full += info["generation"] == 2

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)


def thread_cpu(ident: int) -> float:
    """CPU seconds a thread of this process has used so far (Linux)."""
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


def offline(engine, prompts: list[list[int]], max_tokens: int) -> float:
    from benchmarks.common import drain
    from kimik3.engine import SamplingParams
    t0 = time.perf_counter()
    tokens = drain(engine, [(f"offline-{i}", p) for i, p in enumerate(prompts)],
                   SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slice", action="store_true", help="the K3-width GPU slice (else the embedded tiny model)")
    ap.add_argument("--null", action="store_true", help="host_step.py's null model (host work alone)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--async-scheduling", action="store_true", help="the engine's async scheduling")
    ap.add_argument("--switch-interval", type=float, default=None, metavar="S",
                    help="sys.setswitchinterval(S) for the run (Python's default: 0.005)")
    ap.add_argument("--sample-stacks", type=int, default=0, metavar="N",
                    help="sample this process's thread stacks every 20 ms; print each pass's N commonest")
    ap.add_argument("--log-compiles", action="store_true",
                    help="count the Triton kernels compiled in the warm-up, each pass and the offline runs (and name them)")
    args = ap.parse_args()
    compiles: list[tuple[str, str]] = []          # (phase, kernel), from Triton's pre-compile hook
    phase = ["warm-up"]
    if args.log_compiles:
        import triton

        def on_compile(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002
            compiles.append((phase[0], repr))
            return False                     # compile it (True would skip the compile)
        triton.knobs.runtime.jit_cache_hook = on_compile
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)

    import torch
    import uvicorn

    import kimik3
    from benchmarks.common import commit_id
    from kimik3.engine import EngineConfig, LLMEngine
    from kimik3.engine.warmup import warm_up
    from kimik3.serve.app import ServeOptions, create_app
    if args.null:
        from benchmarks.host_step import HostGraphs, NullModel
        model, tok, name = NullModel(), kimik3.load_tokenizer(kimik3.DEFAULT_MODEL), "null (host work only)"
    elif args.slice:
        from benchmarks.gpu.bench_slice import CONFIG, build_slice
        from benchmarks.structured import synthetic_tokenizer
        model, tok, name = build_slice(json.loads(CONFIG.read_text())), synthetic_tokenizer(), "K3-width 4-layer slice"
    else:
        dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
        model = kimik3.load_model(kimik3.DEFAULT_MODEL, device=args.device, dtype=dtype)
        tok, name = kimik3.load_tokenizer(kimik3.DEFAULT_MODEL), "embedded tiny K3"
    extra = {"cache_memory_bytes": 64 << 20, "kda_checkpoint_interval": 353} if args.null else {}
    engine = LLMEngine(model, EngineConfig(max_num_seqs=args.concurrency, max_model_len=args.prompt + args.output + 16,
                                           async_scheduling=args.async_scheduling, **extra), tokenizer=tok)
    if args.null:
        engine.runner.graphs = HostGraphs(model, args.concurrency)
        torch.set_num_threads(1)
    warm = warm_up(engine) if args.warmup and not args.null else 0.0
    rng = random.Random(0)
    vocab = model.config.text.vocab_size
    pad = model.config.media_placeholder_token_id
    ids = [t for t in range(10 if args.null else 0, vocab) if t != pad]
    prompts = [rng.choices(ids, k=args.prompt) for _ in range(args.requests)]

    app = create_app(engine, ServeOptions(served_model_name="bench", max_queue_len=4 * args.requests))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=client, args=(port, prompts, args.output, args.concurrency, args.passes, out))
    proc.start()
    sampler = StackSampler() if args.sample_stacks else None
    if sampler is not None:
        sampler.start()
    engine_thread = next(t for t in threading.enumerate() if t.name == "kimik3-engine")
    clocks = {"engine thread": engine_thread.ident, "event loop": thread.ident}

    gc_clock = GcClock()

    def sample() -> dict:  # wall s, engine steps, CPU s of each thread in clocks, GC s and full collections, so far
        return {"wall": time.perf_counter(), "steps": engine.runner.num_steps,
                **{k: thread_cpu(v) for k, v in clocks.items()}, "gc": gc_clock.seconds, "gc full": gc_clock.full}
    passes, stacks, cpu = [], [], []
    before = sample()
    for i in range(args.passes):
        phase[0] = f"pass {i + 1}"
        passes.append(out.get())
        stacks.append(sampler.take() if sampler is not None else None)
        now = sample()
        cpu.append({k: now[k] - before[k] for k in now})
        before = now
    if sampler is not None:
        sampler.stop()
    gc_clock.stop()
    proc.join()
    server.should_exit = True
    thread.join(timeout=60)
    # Offline runs the pass-1 workload twice, the prefix cache emptied before each (no hits from the passes or the
    # first run); the ratio uses the second: the first run's steps (all 128 prompts at once) may take shapes the
    # served passes never did and compile them (H100, ef77c20: one MLA prefill variant, 4,306 tok/s against ~6,900).
    offline_runs = []
    for run in range(2):
        if not engine.kv.reset_prefix_cache():
            raise RuntimeError("the server left cache blocks held; cannot empty the prefix cache for the offline run")
        phase[0] = f"offline {run + 1}"
        offline_runs.append(offline(engine, prompts, args.output))
    off = offline_runs[-1]

    print(f"# served vs offline, model {name}, device {args.device}, {args.requests} requests x {args.prompt} prompt + "
          f"{args.output} output tokens, {args.concurrency} at a time, async scheduling {args.async_scheduling}, "
          f"warm-up {'%.1f s' % warm if args.warmup else 'off'}, switch interval {sys.getswitchinterval() * 1e3:g} ms, "
          f"commit {commit_id()}, {datetime.date.today()}")
    print(f"offline (prefix cache emptied first): {off:.0f} output tok/s (first run {offline_runs[0]:.0f})")
    print("| pass | output tok/s | / offline | TTFT p50 s | TTFT p99 s | TTFT max s |")
    print("|---|---|---|---|---|---|")
    for i, p in enumerate(passes, 1):
        if "error" in p:
            print(f"| {i} | error: {p['error']} | | | | |")
            continue
        print(f"| {i} | {p['output_tok_s']:.0f} | {p['output_tok_s'] / off:.2f} | {p['ttft_p50_s']:.3f} | "
              f"{p['ttft_p99_s']:.3f} | {p['ttft_max_s']:.3f} |")
    print("# where each pass's wall time went: engine steps, and the CPU time of the engine thread and of the event "
          "loop's thread (they share the GIL: their sum near the wall time means the host is the bound)")
    print("| pass | steps | wall ms a step | engine thread CPU ms a step | event loop CPU ms a step | sum / wall "
          "| garbage collection ms in the pass (full collections) |")
    print("|---|---|---|---|---|---|---|")
    for i, d in enumerate(cpu, 1):
        n = max(d["steps"], 1)
        print(f"| {i} | {d['steps']} | {d['wall'] / n * 1e3:.2f} | {d['engine thread'] / n * 1e3:.2f} | "
              f"{d['event loop'] / n * 1e3:.2f} | {sum(d[k] for k in clocks) / d['wall']:.2f} | "
              f"{d['gc'] * 1e3:.1f} ({d['gc full']}) |")
    for i, counts in enumerate(stacks, 1):
        if counts:
            total = sum(counts.values())
            print(f"# pass {i}: {total} stack samples (20 ms apart, all threads); the commonest:")
            for (thread, inner, calls), n in counts.most_common(args.sample_stacks):
                print(f"#   {n:5d} {100 * n / total:5.1f}% [{thread}] {inner}  ({calls})")
    if args.log_compiles:
        for name in ["warm-up"] + [f"pass {i}" for i in range(1, args.passes + 1)] + ["offline 1", "offline 2"]:
            kernels = collections.Counter(r.split("[", 1)[0] for ph, r in compiles if ph == name)
            print(f"# Triton compiles in {name}: {sum(kernels.values())}"
                  + "".join(f"; {k} x{n}" for k, n in kernels.most_common()))
            if name != "warm-up":
                for ph, r in compiles:
                    if ph == name:
                        print(f"#   {r[:1500]}")
    ok = [p for p in passes if "error" not in p]
    if ok:
        print(f"# steady (passes 2..): {statistics.mean(p['output_tok_s'] for p in ok[1:] or ok):.0f} tok/s")


if __name__ == "__main__":
    main()
