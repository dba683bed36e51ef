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

DIM, RESET = "\x1b[2m", "\x1b[0m"


class CLIError(Exception):
    """A user error: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:          # one line instead of usage + message
        self.exit(2, f"kimik3: error: {message} (see 'kimik3 {self.prog.split()[-1]} --help')\n"
                  if " " in self.prog else f"kimik3: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny K3)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float64"], default=None,
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--max-model-len", type=_positive_int, default=8192)
    p.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="n-gram draft tokens verified per step (default 0: off)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=_positive_int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-thinking", action="store_true", help="chat format: thinking off")
    p.add_argument("--thinking-effort", choices=["low", "high", "max"], default="max")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kimik3", description="Inference engine for Kimi-K3 and Kimi-Linear.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate a completion for one prompt (streams to stdout)")
    g.add_argument("prompt", nargs="?", help="the prompt; '-' or omitted reads standard input")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat format")
    g.add_argument("--image", action="append", default=[], metavar="PATH", help="an image (implies --chat)")
    _model_args(g)
    _sampling_args(g)

    c = sub.add_parser("chat", help="interactive multi-turn chat (/reset, /image PATH, /exit; Ctrl-C stops an answer)")
    c.add_argument("--system", default=None, help="system prompt")
    _model_args(c)
    _sampling_args(c)
    c.set_defaults(max_tokens=512)

    i = sub.add_parser("inspect", help="architecture, parameters, bytes and cache sizes of a checkpoint")
    i.add_argument("--model", default=None, help="checkpoint directory or config.json (default: the embedded model)")
    i.add_argument("--tensor-parallel-size", type=_positive_int, default=1)
    i.add_argument("--expert-parallel-size", type=_positive_int, default=1)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    try:
        from kimik3.serve import add_serve_arguments
    except ImportError:       # the server package is optional at import time
        add_serve_arguments = None
    if add_serve_arguments is not None:
        add_serve_arguments(s)
    b = sub.add_parser("bench", help="offline throughput: N random requests, tok/s, TTFT/TPOT, batching gain")
    from kimik3.bench import add_bench_arguments
    add_bench_arguments(b)
    return parser


# ---- helpers ------------------------------------------------------------------------------
def _model_path(arg: str | None) -> Path:
    import kimik3

    path = Path(arg) if arg else kimik3.DEFAULT_MODEL
    if not path.exists():
        raise CLIError(f"model path {path} does not exist")
    if path.is_dir() and not (path / "config.json").is_file():
        raise CLIError(f"{path} has no config.json: not a checkpoint directory")
    return path


def _device_dtype(args):
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CLIError(f"--device {device}: CUDA is not available on this machine")
    if device != "cpu" and not device.startswith("cuda"):
        raise CLIError(f"--device must be 'cpu' or 'cuda[:N]', got {device!r}")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    return device, dtype


def _load_llm(args, max_num_seqs: int = 4):
    from kimik3.engine import LLM

    path = _model_path(args.model)
    device, dtype = _device_dtype(args)
    if args.num_speculative_tokens < 0:
        raise CLIError(f"--num-speculative-tokens must be >= 0, got {args.num_speculative_tokens}")
    return LLM(str(path), max_num_seqs=max_num_seqs, max_model_len=args.max_model_len, device=device, dtype=dtype,
               num_speculative_tokens=args.num_speculative_tokens), path


def _sampling(args):
    from kimik3.engine import SamplingParams

    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed)
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
    images = _images(args.image, _model_path(args.model))
    llm, path = _load_llm(args)
    params = _sampling(args)
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
    llm, path = _load_llm(args)
    params = _sampling(args)
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

    path = Path(args.model) if args.model else _model_path(None)
    if not path.exists():
        raise CLIError(f"model path {path} does not exist")
    print(format_summary(summarize(path)))
    if args.tensor_parallel_size > 1 or args.expert_parallel_size > 1:
        from kimik3.parallel.sizing import format_sizing

        print(format_sizing(path, args.tensor_parallel_size, args.expert_parallel_size))
    return 0


def cmd_serve(args) -> int:
    from kimik3.serve import serve_main

    return serve_main(args)


def cmd_bench(args) -> int:
    from kimik3.bench import bench_main

    return bench_main(args)


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "inspect": cmd_inspect, "serve": cmd_serve,
            "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:   # malformed output of the (random) model is shown as text, not warned about
        logging.getLogger("kimik3.chat.parsers").setLevel(logging.ERROR)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:                          # e.g. `kimik3 inspect | head`
        sys.stdout = open(os.devnull, "w")
        return 0
    except (CLIError, ValueError, TypeError, OSError) as e:
        if args.debug:
            raise
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"kimik3: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
