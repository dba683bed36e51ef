"""Cost of constrained decoding: grammar mask time per step, and the engine's decode step with a JSON-schema
constraint vs without, at batch 1 / 32 / 128.

    python benchmarks/structured.py mask [--backends llguidance,xgrammar]      # host mask time, K3-size vocab
    python benchmarks/structured.py engine [--model DIR] [--device cuda]       # engine step, constrained vs not
    python benchmarks/structured.py engine --slice --device cuda --no-enforce-eager   # the GPU slice, graphs

``mask``: a synthetic 163,840-token vocabulary (163,584 byte-level tokens + 256 specials, K3's size; the
release tokenizer is not shipped here) and one JSON schema; each step fills the bitmask of every matcher in
the batch (llguidance: one parallel ``LLExecutor`` call; xgrammar: one ``fill_next_token_bitmask`` per
matcher), then advances each matcher by a random allowed token. ``engine``: every request decodes
``--steps`` tokens (the schema never completes sooner), and the mean time of the decode steps after the
first is reported. Without ``--model`` it uses the embedded random K3 (a CPU-size model: the numbers then
measure host overhead, not a GPU); ``--slice`` builds the K3-width 4-layer GPU slice of
``benchmarks/gpu/bench_slice.py`` in memory, with the synthetic 163,840-token tokenizer.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import commit_id  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0}, "name": {"type": "string", "maxLength": 40},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8},
    "score": {"type": "number"}, "kind": {"enum": ["user", "bot", "system"]},
    "meta": {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": ["integer", "null"]}},
             "required": ["a"], "additionalProperties": False}},
    "required": ["id", "name", "kind"], "additionalProperties": False}
# decode never ends before --steps tokens: a long array of such objects
ENGINE_SCHEMA = {"type": "array", "items": SCHEMA, "minItems": 10_000}
BATCHES = (1, 32, 128)


def synthetic_vocab(n_base: int = 163_584, seed: int = 0) -> list[bytes]:
    """256 single bytes, then unique word-like byte strings (letters with or without a leading space or
    capital, digit runs, punctuation runs, whitespace runs, CJK characters), like a large BPE vocabulary."""
    rng = random.Random(seed)
    vocab = [bytes([b]) for b in range(256)]
    seen = set(vocab)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    weights = [12, 9, 8, 8, 7, 7, 6, 6, 6, 4, 4, 3, 3, 2, 2, 2, 2, 2, 2, 1.5, 1, 0.8, 0.2, 0.2, 0.1, 0.1]
    while len(vocab) < n_base:
        r = rng.random()
        if r < 0.70:
            w = "".join(rng.choices(letters, weights, k=rng.randint(2, 11)))
            w = w.capitalize() if rng.random() < 0.2 else w
            w = (" " + w) if rng.random() < 0.55 else w
        elif r < 0.78:
            w = "".join(rng.choices("0123456789", k=rng.randint(1, 3)))
        elif r < 0.86:
            w = "".join(rng.choices(" .,;:!?\"'()[]{}<>-_=+*/\\|#@$%&^~`", k=rng.randint(1, 4)))
        elif r < 0.90:
            w = rng.choice([" ", "\n", "\t"]) * rng.randint(2, 16)
        else:
            w = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(1, 3)))
        b = w.encode()
        if b not in seen:
            seen.add(b)
            vocab.append(b)
    return vocab


def synthetic_tokenizer():
    """A KimiTokenizer over ``synthetic_vocab`` (163,584 base tokens + 256 specials = K3's vocabulary size)."""
    from kimik3.tokenizer import AddedToken, KimiTokenizer
    vocab = synthetic_vocab()
    n = len(vocab)
    names = ["[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"]
    return KimiTokenizer({b: i for i, b in enumerate(vocab)},
                         [AddedToken(n + i, name, True) for i, name in enumerate(names)], chat_format="k3")


def bench_llguidance(vocab: list[bytes], batch: int, steps: int, rng: random.Random) -> float:
    import tiktoken

    import llguidance
    from llguidance.tiktoken import lltokenizer_from_encoding
    from kimik3.engine.sample.structured import json_schema_for_llguidance
    n = len(vocab)
    specials = {f"<|reserved_{i}|>": n + i for i in range(256)}
    enc = tiktoken.Encoding(name="synthetic", pat_str=r"\S+|\s+", mergeable_ranks={b: i for i, b in enumerate(vocab)},
                            special_tokens=specials)
    tok = lltokenizer_from_encoding(enc, n_vocab=n + 256, eos_token=n)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json_schema_for_llguidance(SCHEMA))
    matchers = [llguidance.LLMatcher(tok, grammar, log_level=0) for _ in range(batch)]
    executor = llguidance.LLExecutor()
    words = (n + 256 + 31) // 32
    mask = torch.full((batch, words), -1, dtype=torch.int32)
    fill = lambda: executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], mask.data_ptr(),  # noqa: E731
                                                    words * 4, batch)
    return _time_steps(fill, mask, matchers, steps, rng, lambda m: m.is_stopped(), lambda m, t: m.consume_token(t))


def _time_steps(fill, mask: torch.Tensor, matchers, steps: int, rng: random.Random, done, accept) -> float:
    """Mean seconds of ``fill()`` (all masks of a step) over ``steps`` steps after the first; between
    steps each matcher takes a random allowed token (a finished one starts over)."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t0)
        bits = ((mask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).reshape(len(matchers), -1)
        for i, m in enumerate(matchers):
            if done(m):
                m.reset()
            else:
                accept(m, rng.choice(bits[i].nonzero().flatten().tolist()))
    return statistics.mean(times[1:])


def bench_xgrammar(vocab: list[bytes], batch: int, steps: int, rng: random.Random) -> float:
    import xgrammar as xgr
    n = len(vocab) + 256
    encoded = list(vocab) + [b""] * 256        # xgrammar treats empty tokens as special
    info = xgr.TokenizerInfo(encoded, vocab_type=xgr.VocabType.RAW, vocab_size=n, stop_token_ids=[len(vocab)])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    mask = xgr.allocate_token_bitmask(batch, n)

    def fill():
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)
    return _time_steps(fill, mask, matchers, steps, rng, lambda m: m.is_terminated(), lambda m, t: m.accept_token(t))


def bench_apply(batch: int, vocab: int, device: str, reps: int = 20) -> float:
    """The device side: unpack a bitmask and mask the logits (``structured.unpack_bitmask`` + masked_fill)."""
    from kimik3.engine.sample.structured import unpack_bitmask
    logits = torch.randn(batch, vocab, device=device)
    mask = torch.randint(-2**31, 2**31 - 1, (batch, (vocab + 31) // 32), dtype=torch.int32)
    times = []
    for _ in range(reps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = logits.masked_fill(~unpack_bitmask(mask, vocab, torch.device(device)), float("-inf"))
        out.argmax(-1).tolist()
        times.append(time.perf_counter() - t0)
    return statistics.mean(times[2:])


def cmd_mask(args) -> None:
    vocab = synthetic_vocab()
    print(f"# mask time per step, vocabulary {len(vocab) + 256} tokens, schema {len(json.dumps(SCHEMA))} chars, "
          f"commit {commit_id()}, {datetime.date.today()}, {torch.get_num_threads()} torch threads")
    print("| backend | batch | mask fill ms/step | apply on " + args.device + " ms/step |")
    print("|---|---|---|---|")
    for backend in args.backends.split(","):
        fn = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar}[backend]
        for b in BATCHES:
            try:
                ms = fn(vocab, b, args.steps, random.Random(b)) * 1e3
            except ImportError as e:
                print(f"| {backend} | {b} | not installed ({e}) | |")
                break
            print(f"| {backend} | {b} | {ms:.3f} | {bench_apply(b, len(vocab) + 256, args.device) * 1e3:.3f} |",
                  flush=True)


def _profile(clock: dict[str, float]) -> None:
    """Host seconds per engine part, summed into ``clock`` (wrappers on the classes and modules the
    engine calls through; the device step shows as device_wait, PendingOutput.result)."""
    from kimik3.engine.core import llm_engine, logit_controls, runner, sampler, scheduler, structured

    def timed(owner, name, label):
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                clock[label] = clock.get(label, 0.0) + time.perf_counter() - t0
        setattr(owner, name, wrapper)
    timed(structured.GrammarCompiler, "fill_bitmasks", "mask_fill")
    timed(logit_controls, "apply_controls", "apply_controls")
    timed(structured.Matcher, "consume", "consume")
    timed(sampler.Sampler, "sample_rows", "sample")
    timed(sampler.PendingOutput, "result", "device_wait")
    timed(runner.ModelRunner, "execute", "execute")
    timed(runner.BatchBuilder, "build_decode", "build_decode")
    timed(runner.ModelRunner, "run_graph", "graph_launch")
    timed(scheduler.Scheduler, "schedule", "schedule")
    timed(llm_engine, "append_output", "append_output")
    timed(llm_engine, "deltas", "deltas")


def _trace_start():
    from torch.profiler import ProfilerActivity, profile
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    prof.start()
    return prof


def _trace_report(prof, steps: int, label: str) -> None:
    """Device time per step (kernels and copies summed) and the device ops that take most of it."""
    torch.cuda.synchronize()
    prof.stop()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    busy = sum(e.self_device_time_total for e in events) / 1e3 / steps
    print(f"#   trace {label}: device busy {busy:.2f} ms/step over {steps} steps", flush=True)
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]:
        print(f"#     {e.self_device_time_total / 1e3 / steps:7.3f} ms/step  {e.count / steps:6.1f}/step  {e.key[:90]}")


def cmd_engine(args) -> None:
    import kimik3
    from kimik3.engine import EngineConfig, LLMEngine, SamplingParams
    from kimik3.engine.sample.sampling_params import StructuredOutputsParams
    if args.slice:
        from benchmarks.gpu.bench_slice import CONFIG, build_slice
        model, tok, name = build_slice(json.loads(CONFIG.read_text())), synthetic_tokenizer(), "K3-width 4-layer slice"
    else:
        path = args.model or kimik3.DEFAULT_MODEL
        dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
        model, tok = kimik3.load_model(path, device=args.device, dtype=dtype), kimik3.load_tokenizer(path)
        name = args.model or "embedded tiny K3"
    engine = LLMEngine(model, EngineConfig(max_num_seqs=max(BATCHES), max_model_len=args.steps + 64,
                                           enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling),
                       tokenizer=tok)
    clock: dict[str, float] = {}
    if args.profile:
        _profile(clock)
    if args.grammar_threads:
        import llguidance
        compiler = engine.inputs.grammar_compiler()
        compiler.ll_tokenizer                                   # builds the default executor first
        compiler._executor = llguidance.LLExecutor(num_threads=args.grammar_threads)
    print(f"# engine decode step, constrained (JSON schema) vs unconstrained, model {name}, "
          f"device {args.device}, {args.steps} steps, async scheduling {'on' if args.async_scheduling else 'off'}, "
          f"commit {commit_id()}, {datetime.date.today()}")
    print("| batch | unconstrained ms/step | constrained ms/step | ratio |")
    print("|---|---|---|---|")
    for b in BATCHES:
        row = []
        for constrained in (False, True):
            so = StructuredOutputsParams(json=ENGINE_SCHEMA) if constrained else None
            params = SamplingParams(max_tokens=args.steps, temperature=1.0, seed=1, structured_outputs=so,
                                    ignore_eos=not constrained)
            for i in range(b):
                engine.add_request(f"{constrained}-{b}-{i}", {"prompt_token_ids": [5 + i % 50, 6, 7, 8]}, params)
            times = []
            clock.clear()
            prof = _trace_start() if args.trace == b else None
            host = cProfile.Profile() if args.host_profile == b and constrained else None
            if host is not None:
                host.enable()
            while engine.has_unfinished_requests():
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            row.append(statistics.mean(times[2:]) * 1e3)
            if prof is not None:
                _trace_report(prof, len(times), "constrained" if constrained else "plain")
            if host is not None:
                host.disable()
                text = io.StringIO()
                pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(25)
                print("\n".join("#   " + line for line in text.getvalue().splitlines() if line.strip()), flush=True)
            if args.profile:
                parts = ", ".join(f"{k} {v / len(times) * 1e3:.2f}" for k, v in sorted(clock.items()))
                print(f"#   batch {b} {'constrained' if constrained else 'plain'}: ms/step {parts}", flush=True)
        print(f"| {b} | {row[0]:.2f} | {row[1]:.2f} | {row[1] / row[0]:.3f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("mask")
    m.add_argument("--backends", default="llguidance,xgrammar")
    m.add_argument("--steps", type=int, default=40)
    m.add_argument("--device", default="cpu")
    e = sub.add_parser("engine")
    e.add_argument("--model", help="checkpoint directory (default: the embedded tiny K3)")
    e.add_argument("--slice", action="store_true", help="the GPU slice of benchmarks/gpu/bench_slice.py (CUDA)")
    e.add_argument("--device", default="cpu")
    e.add_argument("--steps", type=int, default=32)
    e.add_argument("--profile", action="store_true", help="host ms per step in each engine part")
    e.add_argument("--async-scheduling", action="store_true", help="the engine's async scheduling")
    e.add_argument("--host-profile", type=int, metavar="BATCH", help="cProfile of the constrained run at this batch")
    e.add_argument("--trace", type=int, metavar="BATCH", help="torch.profiler at this batch: device ms/step, top ops")
    e.add_argument("--grammar-threads", type=int, help="llguidance executor threads (default: the engine's)")
    e.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                   help="--no-enforce-eager runs decode steps as CUDA graphs")
    args = ap.parse_args()
    if getattr(args, "trace", None) and not args.device.startswith("cuda"):
        ap.error("--trace measures device time: it needs --device cuda")
    (cmd_mask if args.cmd == "mask" else cmd_engine)(args)


if __name__ == "__main__":
    main()
