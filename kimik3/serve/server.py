"""``kimik3 serve``: bind the port, build the engine from the shared engine flags, run uvicorn.

The port is bound before the model loads, so a taken port fails at once (not after loading a 1.45 TiB
checkpoint); every start-up error propagates to the ``kimik3`` command, which prints one
``kimik3: error: ...`` line and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
from pathlib import Path

from kimik3.engine.args import EngineArgs
from kimik3.engine.flags import merge_model_tag
from kimik3.engine.build import build_engine
from kimik3.serve.app import ServeOptions, create_app
from kimik3.serve.cli_args import add_serve_arguments
from kimik3.serve.limits import limits_from_args
from kimik3.serve.media import media_options_from_args

__all__ = ["add_serve_arguments", "bind_socket", "build_app", "run_server", "serve_main", "serve_options"]

logger = logging.getLogger(__name__)


def serve_options(args: argparse.Namespace, engine_args: EngineArgs | None = None) -> ServeOptions:
    ea = engine_args or EngineArgs.from_cli(args)
    path = ea.model_path()
    processor = None
    if (path / "preprocessor_config.json").is_file() and not ea.language_model_only:
        from kimik3.vision.preprocess import load_media_processor_config
        processor = load_media_processor_config(path)
    name = args.served_model_name or Path(path).resolve().name
    return ServeOptions(served_model_name=name, api_key=args.api_key, max_queue_len=args.max_queue_len,
                        shutdown_timeout=args.shutdown_timeout, processor_config=processor,
                        allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                        allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
                        log_requests=args.enable_log_requests,
                        log_stats_interval=None if args.disable_log_stats else 10.0,
                        generation_defaults=ea.generation_defaults(path),
                        limit_mm_per_prompt=ea.limit_mm_per_prompt, limits=limits_from_args(args),
                        media=media_options_from_args(args))


CPU_PREFILL_CHUNK = 32      # tokens of a prompt one step prefills, serving on a CPU (~100-150 ms of one core)


def serving_defaults(ea: EngineArgs) -> EngineArgs:
    """A server on a CPU keeps each engine step short and a core for its HTTP side, unless told otherwise: a long
    prompt is prefilled ``CPU_PREFILL_CHUNK`` tokens a step (an 8k prompt in one step held every stream beside it
    ~20 s), and torch computes on the cores less one (with every core, its threads and the event loop's fought
    over two cores: a 1-token step took 5-10x its CPU time on a loaded box)."""
    device, _ = ea.resolve_device_dtype()
    if device.type != "cpu" or ea.is_parallel:
        return ea
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return dataclasses.replace(
        ea, long_prefill_token_threshold=(CPU_PREFILL_CHUNK if ea.long_prefill_token_threshold is None
                                          else ea.long_prefill_token_threshold),
        cpu_threads=max(1, cores - 1) if ea.cpu_threads is None else ea.cpu_threads)


def build_app(args: argparse.Namespace):
    merge_model_tag(args)
    ea = serving_defaults(EngineArgs.from_cli(args))
    options = serve_options(args, ea)       # bad options fail before the load
    engine, _ = build_engine(ea)
    return create_app(engine, options)


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), not yet listening; ValueError naming the address if it is taken."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: cannot resolve it ({e})") from None
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only when the listener says TCP (with
    # Nagle on, each small response waited ~40 ms for the client's delayed ACK); the protocol sets it too
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}; pick another --port or stop the "
                         f"process using it") from None
    return sock


def run_server(args: argparse.Namespace) -> None:
    """Bind, build the engine and app from ``args`` and serve until SIGINT/SIGTERM (draining from the
    signal on, ``kimik3.serve.lifecycle``)."""
    from kimik3.serve.lifecycle import Server, server_config
    merge_model_tag(args)
    serving_rank = int(os.environ.get("RANK", "0")) == 0     # under torchrun only rank 0 serves
    sock = bind_socket(args.host, args.port) if serving_rank else None
    try:
        app = build_app(args)                  # ranks > 0 of a torchrun group never return from here
        host, port = sock.getsockname()[:2]
        logger.info("serving %s on http://%s:%d", EngineArgs.from_cli(args).model_path(), host, port)
        config = server_config(app, app.state.kimik3.options.limits, log_level=args.uvicorn_log_level)
        Server(config).run(sockets=[sock])
    finally:
        if sock is not None:
            sock.close()


def serve_main(args: argparse.Namespace) -> int:
    """Entry point for ``kimik3 serve``: 0 on a clean shutdown; start-up errors raise (one line, exit 2)."""
    run_server(args)
    return 0
