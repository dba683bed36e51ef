"""The ``kimik3 serve`` flags: the shared engine flags (``kimik3.engine.args``) plus the HTTP front end's,
named as vLLM names them (``vllm serve``'s ``cli_args``)."""

from __future__ import annotations

import argparse
import json

from kimik3.engine.arg_types import non_negative_int
from kimik3.engine.flags import add_engine_args

# The K3 recipe's parser names. kimik3 always parses K3 output with its own parser (kimik3.chat), so
# these flags name what is always on; any other parser name is refused.
K3_PARSER = "kimi_k3"
UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port lies in 0..65535, got {value}")
    return value


def _parser_name(kind: str):
    def check(text: str) -> str:
        if text != K3_PARSER:
            raise argparse.ArgumentTypeError(
                f"unknown {kind} parser {text!r}: kimik3 parses Kimi-K3 output with its own parser, "
                f"named {K3_PARSER!r}; pass --{kind}-parser {K3_PARSER} or leave the flag out")
        return text
    check.__name__ = f"{kind} parser"
    return check


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as '[\"https://a.example\"]', "
                                         f"got {text!r}")
    return value


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every ``serve`` flag: ``kimik3 serve [MODEL] --port 8000 ...``."""
    add_engine_args(parser, positional_model=True)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind; 0.0.0.0 listens on every interface (default: 127.0.0.1, loopback only)")
    g.add_argument("--port", type=_port, default=8000, help="TCP port, bound before the model loads (default: 8000)")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients send (default: the checkpoint directory's name)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on the /v1 routes (default: none, open)")
    g.add_argument("--allowed-origins", type=_json_list, default=[],
                   help="CORS: origins browsers may call from, as a JSON list such as '[\"https://ui.example\"]' "
                        "(default: none, CORS off: no web page can read this server's answers; vLLM's is [\"*\"])")
    g.add_argument("--allowed-methods", type=_json_list, default=["*"],
                   help="CORS: allowed methods, as a JSON list (default: [\"*\"])")
    g.add_argument("--allowed-headers", type=_json_list, default=["*"],
                   help="CORS: allowed request headers, as a JSON list (default: [\"*\"])")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (default: off)")
    g.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default="info",
                   help="level of uvicorn's own log messages (default: info)")
    g.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="log one line per request (id, prompt tokens, sampling settings) (default: off)")
    g.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                   help="do not log requests (vLLM's older flag; the default)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line (throughput, running/waiting, cache use, prefix hit rate every "
                        "10 s) (default: logged)")
    g.add_argument("--tool-call-parser", type=_parser_name("tool-call"), default=K3_PARSER,
                   help=f"tool-call parser; only {K3_PARSER}, which kimik3 always uses (default: {K3_PARSER})")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for the K3 recipe; a no-op: tool_choice auto is always served, parsed with "
                        f"{K3_PARSER} (default: on)")
    g.add_argument("--reasoning-parser", type=_parser_name("reasoning"), default=K3_PARSER,
                   help=f"reasoning parser; only {K3_PARSER}, which kimik3 always uses: the thinking channel "
                        f"comes back as reasoning / reasoning_content (default: {K3_PARSER})")
    g.add_argument("--max-queue-len", type=non_negative_int, default=256,
                   help="sequences (n x prompts) accepted beyond --max-num-seqs before answering 429 (default: 256)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on shutdown before they are aborted (default: 30)")
    from kimik3.serve.limits import add_limit_arguments
    from kimik3.serve.media import add_media_arguments
    add_limit_arguments(g)
    add_media_arguments(g)
    if not any(a.dest == "log_level" for a in parser._actions):
        parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info",
                            help="level of kimik3's own log messages (default: info)")
    return parser
