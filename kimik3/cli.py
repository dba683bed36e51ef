"""The ``kimik3`` command: generate, chat, inspect, serve, bench.

Every bad argument or path ends in one line ``kimik3: error: ...`` on stderr and exit code 2;
tracebacks are shown only with ``--debug``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from kimik3.engine.arg_types import positive_int

DIM, RESET = "\x1b[2m", "\x1b[0m"


class CLIError(Exception):
    """A user error: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)      # --max-token is not --max-tokens
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:          # one line instead of usage + message
        self.exit(2, f"kimik3: error: {message} (see 'kimik3 {self.prog.split()[-1]} --help')\n"
                  if " " in self.prog else f"kimik3: error: {message}\n")


LOG_LEVELS = ["debug", "info", "warning", "error"]
# generate/chat run one request at a time: their cache is planned for one sequence
ONE_AT_A_TIME = {"max_num_seqs": 1}
# sampling flags of generate/chat: None = the model's generation_config.json, else these
SAMPLING_DEFAULTS = {"max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": -1}


def _log_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="level of kimik3's own log messages, on stderr (default: info)")


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling (defaults: the model's generation_config.json, else the values named)")
    g.add_argument("--max-tokens", type=positive_int, default=None, help=f"tokens to generate (default: {max_tokens})")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: 1.0, off)")
    g.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (default: -1, off)")
    g.add_argument("--no-thinking", action="store_true", help="chat format: thinking off (default: thinking on)")
    g.add_argument("--thinking-effort", choices=["low", "high", "max"], default="max",
                   help="chat format: thinking effort (default: max)")


def build_parser() -> argparse.ArgumentParser:
    from kimik3.engine.flags import add_engine_args

    parser = _Parser(prog="kimik3", description="Inference engine for Kimi-K3 and Kimi-Linear.")
    parser.add_argument("-v", "--verbose", action="store_true", help="same as --log-level info (default: off)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks (default: off)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate a completion for one prompt (streams to stdout)")
    g.add_argument("prompt", nargs="?", help="the prompt; '-' or omitted reads standard input")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat format (default: off)")
    g.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image (implies --chat; repeatable) (default: none)")
    _log_args(g)
    add_engine_args(g, overrides=ONE_AT_A_TIME)
    _sampling_args(g, 64)

    c = sub.add_parser("chat", help="interactive multi-turn chat (/reset, /image PATH, /exit; Ctrl-C stops an answer)")
    c.add_argument("--system", default=None, help="system prompt (default: none)")
    _log_args(c)
    add_engine_args(c, overrides=ONE_AT_A_TIME)
    _sampling_args(c, 512)
    c.set_defaults(default_max_tokens=512)

    i = sub.add_parser("inspect", help="architecture, parameters, bytes and cache sizes of a checkpoint")
    i.add_argument("--model", default=None,
                   help="checkpoint directory or config.json (default: the embedded model)")
    i.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                   help="ranks to size the model for (default: 1)")
    i.add_argument("--expert-parallel-size", type=positive_int, default=1,
                   help="expert-parallel ranks to size the model for (default: 1)")
    i.add_argument("--layouts", action="store_true",
                   help="propose TP / PP / EP / DCP layouts for 16 x H200, 32 x H100 and 8 x B300 with 1M-token "
                        "sequences (default: off)")
    _plan_args(i)
    _log_args(i)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _log_args(s)
    from kimik3.serve.cli_args import add_serve_arguments
    add_serve_arguments(s)
    b = sub.add_parser("bench", help="offline throughput: N random requests, tok/s, TTFT/TPOT, batching gain")
    _log_args(b)
    from kimik3.bench import add_bench_arguments
    add_bench_arguments(b)
    _build_kernels_parser(sub)
    return parser


def _build_kernels_parser(sub) -> None:
    from kimik3.kernels import LIBRARIES

    k = sub.add_parser("build-kernels", help="build the optional Hopper libraries (FlashMLA decode, FlashKDA prefill) "
                       "into kimik3's cache, where the engine finds them (needs nvcc 12.9+ and git)")
    k.add_argument("libraries", nargs="*", metavar="LIBRARY",
                   help=f"which to build: {', '.join(LIBRARIES)} (default: all)")
    for name in LIBRARIES:
        k.add_argument(f"--{name.replace('_', '-')}-source", default=None, metavar="DIR",
                       help=f"an existing {LIBRARIES[name].repo} checkout at {LIBRARIES[name].commit[:12]} with its "
                            "submodule (default: clone the pinned sources into the cache)")
    k.add_argument("--cache-dir", default=None, help="where the libraries go (default: $KIMIK3_CACHE_DIR/kernels, "
                   "else $XDG_CACHE_HOME/kimik3/kernels, else ~/.cache/kimik3/kernels)")
    k.add_argument("--nvcc", default="nvcc", help="CUDA's compiler (default: nvcc on the PATH)")
    _log_args(k)


# ---- helpers ------------------------------------------------------------------------------
def _plan_args(p) -> None:
    """``kimik3 inspect``'s deployment options: the engine's flags (same names and choices) and the rates."""
    from kimik3.sizing import GPUS, KV_CACHE_DTYPES, Rates

    p.add_argument("--gpu", choices=list(GPUS), default="H200", help="the GPU to plan for (default: H200)")
    from kimik3.engine.arg_types import non_negative_gib
    p.add_argument("--cpu-offload-gb", type=non_negative_gib, default=0,
                   help="GiB of routed experts per GPU kept in pinned host memory, as vLLM's flag (each GPU offloads "
                        "from the experts or expert slices it holds) (default: 0)")
    p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                   help="MLA latent cache dtype: auto (the model dtype) or fp8 / fp8_e4m3 (default: auto)")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="fp8: projection weights in e4m3 with 128x128 block scales (default: as stored)")
    r = Rates()
    p.add_argument("--pcie-gbps", type=float, default=r.pcie / 1e9,
                   help=f"pinned host-to-GPU copy rate per GPU, GB/s (default: {r.pcie / 1e9:g}, assumed)")
    p.add_argument("--host-memory-gbps", type=float, default=r.host_memory / 1e9,
                   help=f"host DRAM read rate of the node, GB/s (default: {r.host_memory / 1e9:g}, assumed)")
    p.add_argument("--host-tflops", type=float, default=r.host_flops / 1e12,
                   help=f"host matmul rate of the node, TFLOP/s (default: {r.host_flops / 1e12:g}, assumed)")
    from kimik3.model.offload_policy import POLICIES
    p.add_argument("--expert-offload-policy", choices=list(POLICIES), default="auto",
                   help="how decode steps serve offloaded experts they miss, as the engine's flag (default: auto)")
    p.add_argument("--prefetch-accuracy", type=float, default=r.prefetch_accuracy,
                   help=f"share of a layer's misses a prefetch predicts (default: {r.prefetch_accuracy:g}, assumed; "
                        "benchmarks/gpu/bench_offload.py measures it)")


def _engine_args(args):
    from kimik3.engine.args import EngineArgs

    return EngineArgs.from_cli(args)


def _load_llm(args):
    from kimik3.engine import LLM

    ea = _engine_args(args)
    kwargs = {f: getattr(ea, f) for f in vars(ea) if f != "model"}
    llm = LLM(ea.model, **kwargs)
    return llm, llm.model_path


def _sampling(args):
    """The request's SamplingParams (checked before any model loads): flags, else the model's
    generation_config.json, else SAMPLING_DEFAULTS."""
    from kimik3.engine import SamplingParams

    ea = _engine_args(args)
    defaults = {**SAMPLING_DEFAULTS, "max_tokens": getattr(args, "default_max_tokens", 64),
                **ea.generation_defaults(ea.model_path())}
    kw = {k: getattr(args, k) if getattr(args, k) is not None else defaults[k] for k in SAMPLING_DEFAULTS}
    for k in ("min_p", "repetition_penalty"):
        if k in defaults:
            kw[k] = defaults[k]
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise CLIError(str(e)) from None


class _Printer:
    """Writes reasoning (dimmed on a terminal) and content as they stream."""

    def __init__(self, stream, thinking: bool, tools=None):
        from kimik3.chat import K3OutputParser

        self.out = stream
        self.dim = stream.isatty()
        self.parser = K3OutputParser(thinking=thinking, tools=tools)

    def _emit(self, delta) -> None:
        if delta.reasoning:
            self.out.write(f"{DIM}{delta.reasoning}{RESET}" if self.dim else delta.reasoning)
        if delta.content:
            self.out.write(delta.content)
        for call in delta.tool_calls:
            self.out.write(f"\n[tool call] {call.name}({call.arguments})\n")
        self.out.flush()

    def feed(self, text: str) -> None:
        self._emit(self.parser.feed(text))

    def finish(self) -> None:
        self._emit(self.parser.finish())


def _images(paths: list[str], model_path: Path):
    """Decode image files and check that the model's processor can take them (before any model loads)."""
    from kimik3.vision.preprocess import load_image, load_media_processor_config, plan_resize

    cfg = load_media_processor_config(model_path) if paths else None
    out = []
    for p in paths:
        if not Path(p).is_file():
            raise CLIError(f"image file {p} does not exist")
        try:
            img = load_image(Path(p))
            plan_resize(img.width, img.height, cfg)
        except ValueError as e:   # load_image names the file already; plan_resize does not
            raise CLIError(str(e) if p in str(e) else f"image {p}: {e}") from None
        out.append(img)
    return out


def _stream(llm, prompt, params, on_text) -> tuple[int, float, float]:
    """Run one request, calling on_text for each text delta; returns (tokens, ttft, total)."""
    engine = llm.engine
    start = time.perf_counter()
    first = None
    n = 0
    engine.add_request("cli", prompt, params)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            for c in delta.outputs:
                if c.token_ids and first is None:
                    first = time.perf_counter() - start
                n += len(c.token_ids)
                if c.text:
                    on_text(c.text)
    return n, first or 0.0, time.perf_counter() - start


def _stop(engine, request_id: str) -> None:
    """Abort a request and run the engine until it has let go of it (Ctrl-C again is ignored meanwhile)."""
    import signal
    import threading
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        engine.abort_request(request_id)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)


def _prompt_with_images(llm, path, conversation, args, images):
    """Token ids for a chat conversation (images rendered as media tokens), or the text."""
    tok = llm.get_tokenizer()
    kw = dict(thinking=not args.no_thinking, thinking_effort=args.thinking_effort)
    if not images:
        return {"prompt_token_ids": tok.apply_chat_template(conversation, tokenize=True, **kw)}
    from kimik3.chat import ImagePrompt
    from kimik3.vision.preprocess import load_media_processor_config, preprocess_images

    vis = preprocess_images(images, load_media_processor_config(path))
    prompts = [ImagePrompt(w, h, n) for (w, h), n in zip(vis.sizes, vis.num_tokens)]
    ids = tok.apply_chat_template(conversation, tokenize=True, images=prompts, **kw)
    return {"prompt_token_ids": ids, "multi_modal_data": vis}


# ---- commands -----------------------------------------------------------------------------
def cmd_generate(args) -> int:
    prompt = args.prompt
    if prompt is None or prompt == "-":
        if sys.stdin.isatty() and prompt is None:
            raise CLIError("no prompt: give one as an argument or on standard input")
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise CLIError("the prompt is empty")
    images = _images(args.image, _engine_args(args).model_path())
    params = _sampling(args)
    llm, path = _load_llm(args)
    if args.chat or images:
        content = ([{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]) if images else prompt
        request = _prompt_with_images(llm, path, [{"role": "user", "content": content}], args, images)
        printer = _Printer(sys.stdout, thinking=not args.no_thinking)
        n, ttft, total = _stream(llm, request, params, printer.feed)
        printer.finish()
    else:
        n, ttft, total = _stream(llm, prompt, params, lambda t: (sys.stdout.write(t), sys.stdout.flush()))
    sys.stdout.write("\n")
    rate = n / (total - ttft) if total > ttft and n > 1 else 0.0
    print(f"[{n} tokens in {total:.2f} s; first token {ttft * 1000:.0f} ms; {rate:.1f} tok/s after it]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    params = _sampling(args)
    llm, path = _load_llm(args)
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    pending_images: list = []  # decoded images for the next message
    images: list = []          # every image of the conversation, in order (each turn renders them all)
    interactive = sys.stdin.isatty()
    print("kimik3 chat: /reset clears the conversation, /image PATH attaches an image, /exit quits; "
          "Ctrl-C stops an answer", file=sys.stderr)
    while True:
        if interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            return 0
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.strip() in ("/exit", "/quit"):
            return 0
        if text.strip() == "/reset":
            history = history[:1] if args.system else []
            pending_images, images = [], []
            print("[conversation cleared]", file=sys.stderr)
            continue
        if text.startswith("/image "):
            try:
                pending_images += _images([text[7:].strip()], path)
            except CLIError as e:
                print(f"kimik3: error: {e}", file=sys.stderr)
            continue
        new = pending_images
        content = ([{"type": "image"} for _ in new] + [{"type": "text", "text": text}]) if new else text
        history.append({"role": "user", "content": content})
        images, pending_images = images + new, []
        printer = _Printer(sys.stdout, thinking=not args.no_thinking)
        collected: list[str] = []

        def on_text(t: str) -> None:
            collected.append(t)
            printer.feed(t)
        stopped = False
        try:
            request = _prompt_with_images(llm, path, history, args, images)
            _stream(llm, request, params, on_text)
        except ValueError as e:                      # e.g. the conversation outgrew max_model_len
            history.pop()
            images = images[:len(images) - len(new)]
            print(f"kimik3: error: {e}", file=sys.stderr)
            continue
        except KeyboardInterrupt:                    # Ctrl-C: stop this answer, keep what was shown
            _stop(llm.engine, "cli")
            stopped = True
        printer.finish()
        sys.stdout.write("\n")
        sys.stdout.flush()
        if stopped:
            print("[answer stopped; the conversation goes on]", file=sys.stderr)
        from kimik3.chat import parse_k3_output

        parsed = parse_k3_output("".join(collected), thinking=not args.no_thinking)
        history.append({"role": "assistant", "content": parsed.content,
                        "reasoning_content": parsed.reasoning_content})


def cmd_inspect(args) -> int:
    from kimik3.inspect import format_summary, summarize
    from kimik3.loader import DEFAULT_MODEL

    path = Path(args.model) if args.model else DEFAULT_MODEL
    if not path.exists():
        raise CLIError(f"model path {path} does not exist")
    print(format_summary(summarize(path)))
    if args.layouts:
        from kimik3.config import load_config
        from kimik3.layouts import format_layouts
        print(format_layouts(load_config(path)))
    planning = (args.cpu_offload_gb, args.kv_cache_dtype, args.quantization, args.gpu, args.expert_offload_policy) != \
        (0, "auto", None, "H200", "auto")
    if args.tensor_parallel_size > 1 or args.expert_parallel_size > 1 or planning:
        from kimik3.sizing import PlanOptions, Rates, format_sizing

        try:
            rates = Rates(pcie=args.pcie_gbps * 1e9, host_memory=args.host_memory_gbps * 1e9,
                          host_flops=args.host_tflops * 1e12, prefetch_accuracy=args.prefetch_accuracy)
            options = PlanOptions(args.tensor_parallel_size, args.expert_parallel_size, args.gpu, args.cpu_offload_gb,
                                  args.kv_cache_dtype, args.quantization, rates, args.expert_offload_policy)
            print(format_sizing(path, args.tensor_parallel_size, args.expert_parallel_size, options))
        except ValueError as e:
            raise CLIError(str(e)) from None
    return 0


def cmd_serve(args) -> int:
    from kimik3.serve import serve_main

    return serve_main(args)


def cmd_bench(args) -> int:
    from kimik3.bench import bench_main

    return bench_main(args)


def cmd_build_kernels(args) -> int:
    from kimik3.kernels import LIBRARIES, build

    unknown = [n for n in args.libraries if n not in LIBRARIES]
    if unknown:
        raise CLIError(f"unknown kernel librar{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                       f"known: {', '.join(LIBRARIES)}")
    for name in args.libraries or list(LIBRARIES):
        print(build(name, source=getattr(args, f"{name}_source"), cache=args.cache_dir, nvcc=args.nvcc))
    return 0


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "inspect": cmd_inspect, "serve": cmd_serve,
            "bench": cmd_bench, "build-kernels": cmd_build_kernels}


def setup_logging(level: str) -> None:
    """kimik3's log messages at ``level`` on stderr (malformed output of a random model is shown as text,
    not warned about, unless at debug)."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("kimik3").setLevel(level.upper())
    if level != "debug":
        logging.getLogger("kimik3.chat.parsers").setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging("info" if args.verbose and args.log_level not in ("debug", "info") else args.log_level)
    try:
        from kimik3.engine.flags import merge_model_tag
        merge_model_tag(args)
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:                          # e.g. `kimik3 inspect | head`
        sys.stdout = open(os.devnull, "w")
        return 0
    except Exception as e:   # every user-facing failure: one line, exit 2 (--debug shows the traceback)
        if args.debug:
            raise
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"kimik3: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
