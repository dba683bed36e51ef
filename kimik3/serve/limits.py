"""Bounded cost per request and per connection: the server's limits and where they are enforced.

- Connections (``LimitedH11Protocol``, uvicorn's h11 protocol plus two rules): a connection must
  deliver a complete request head within ``header_timeout`` seconds (else 408 and closed); beyond
  ``max_connections`` open connections a new one is answered 503 (OpenAI body) and closed.
- Bodies (``BodyLimits``, ASGI, before any route): the whole body must arrive within
  ``body_timeout`` seconds (408) and hold at most ``max_body_bytes`` (413); without an API key POST
  bodies must be ``Content-Type: application/json`` (415: a web page cannot send that cross-origin
  without a preflight) and, with ``allowed_hosts``, the ``Host`` header must name one of them (421).
- Work (``check_request_limits``): caps on ``n``, prompts per request, stop strings (count and
  length) and ``stop_token_ids``, each a 400 naming the limit; admission counts sequences
  (``n`` x prompts) against ``max_num_seqs + max_queue_len`` (429 beyond it, in app.py).

Choices where the issue was silent: a foreign Host is a 421 (Misdirected Request); a request with more
sequences than are free is a 429 even when it could never fit (one rule, and its message gives both
numbers); an idle connection at the head deadline is closed without a response; a refused body is read
and dropped (at most 4x the limit, at most 5 s) so that the client sees the error, not a reset.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import resource
import socket
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

from kimik3.serve.protocol import bad_request, context_exceeded, error_body

logger = logging.getLogger(__name__)

MIB = 1 << 20


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 64 * MIB
    header_timeout: float = 10.0        # seconds for a complete request head
    body_timeout: float = 60.0          # seconds for the whole body
    max_connections: int = 1024
    stall_timeout: float = 60.0         # seconds a client may leave a response unread before it is dropped
    stream_buffer_steps: int = 64       # engine steps a stream may have unread before its generation pauses
    max_response_logprobs: int = 1 << 18   # logprob entries (tokens x (1 + top)) one JSON response may carry
    max_n: int = 64
    max_prompts: int = 1024             # prompts in one /v1/completions request
    max_stop_strings: int = 64
    max_stop_chars: int = 1024          # characters in one stop string
    max_stop_token_ids: int = 1024
    allowed_hosts: tuple[str, ...] | None = None   # Host header values accepted (None: any)
    cpu_workers: int = 4                # threads for tokenising, rendering and image decoding

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_connections", "max_n", "max_prompts", "max_stop_strings",
                     "max_stop_chars", "max_stop_token_ids", "cpu_workers", "stream_buffer_steps",
                     "max_response_logprobs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("header_timeout", "body_timeout", "stall_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    d = Limits()
    parser.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                        help="largest request body accepted, in bytes (413 beyond; default: 64 MiB)")
    parser.add_argument("--header-timeout", type=float, default=d.header_timeout,
                        help=f"seconds a connection gets to send a complete request head (408 after; default: {d.header_timeout:g})")
    parser.add_argument("--body-timeout", type=float, default=d.body_timeout,
                        help=f"seconds a request gets to send its whole body (408 after; default: {d.body_timeout:g})")
    parser.add_argument("--max-connections", type=int, default=d.max_connections,
                        help=f"open connections served at once; more are answered 503 (default: {d.max_connections})")
    parser.add_argument("--max-n", type=int, default=d.max_n, help=f"largest n (samples per prompt) accepted (default: {d.max_n})")
    parser.add_argument("--stall-timeout", type=float, default=d.stall_timeout,
                        help="seconds a client may leave a response unread (its connection's send buffer full) "
                             f"before the connection is dropped and its request aborted (default: {d.stall_timeout:g})")
    parser.add_argument("--stream-buffer-steps", type=int, default=d.stream_buffer_steps,
                        help="engine steps a stream may have produced beyond what its client has read before its "
                             f"generation pauses (it resumes as the client reads; default: {d.stream_buffer_steps})")
    parser.add_argument("--max-response-logprobs", type=int, default=d.max_response_logprobs,
                        help="most logprob entries one non-streamed response may carry: prompt tokens x (1 + "
                             "prompt_logprobs) plus n x prompts x max_tokens x (1 + logprobs); beyond it a 400 "
                             f"(default: {d.max_response_logprobs})")
    parser.add_argument("--allowed-hosts", default=None,
                        help="comma-separated Host header names accepted (e.g. llm.example,10.0.0.5:8000; a name "
                             "without a port takes any port; '*' takes any host); others get 421, which stops "
                             "DNS-rebinding pages (default: the bound interface: localhost, 127.0.0.1 and [::1] on "
                             "loopback; any host when bound to every interface, 0.0.0.0 or ::)")


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def default_allowed_hosts(bind_host: str) -> tuple[str, ...] | None:
    """Host names a server bound to ``bind_host`` answers to: the loopback names on loopback, the address itself
    on one interface, None (any) on every interface (the names it is reached by are not known)."""
    import ipaddress
    host = bind_host.strip().lower().strip("[]")
    if host in ("", "0.0.0.0", "::"):
        return None
    if host == "localhost":
        return LOOPBACK_NAMES
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:                    # a name: the name itself
        return (host,)
    if ip.is_loopback:
        return LOOPBACK_NAMES
    return (f"[{ip}]" if ip.version == 6 else str(ip),)


def host_allowed(header: str, hosts: tuple[str, ...]) -> bool:
    """Whether a ``Host`` header (``name``, ``name:port``, ``[v6]:port``) is one of ``hosts`` (an entry without a
    port matches every port)."""
    header = header.strip().lower()
    if header in hosts or "*" in hosts:
        return True
    name = header[:header.index("]") + 1] if header.startswith("[") and "]" in header else header.rsplit(":", 1)[0]
    return name in hosts


def limits_from_args(args: argparse.Namespace) -> Limits:
    given = getattr(args, "allowed_hosts", None)
    hosts = (tuple(h.strip().lower() for h in given.split(",") if h.strip()) if given is not None
             else default_allowed_hosts(getattr(args, "host", "") or ""))
    return Limits(max_body_bytes=args.max_body_bytes, header_timeout=args.header_timeout,
                  body_timeout=args.body_timeout, max_connections=args.max_connections, max_n=args.max_n,
                  stall_timeout=args.stall_timeout, stream_buffer_steps=args.stream_buffer_steps,
                  max_response_logprobs=args.max_response_logprobs,
                  allowed_hosts=None if hosts is None or "*" in hosts else hosts)


class RepeatedErrors:
    """An asyncio exception handler that logs an error once and then, while it repeats, one line a ``window``
    with its count (an accept loop out of file descriptors reports EMFILE for every attempt: 45,055 identical
    tracebacks filled a log)."""

    def __init__(self, window: float = 60.0, clock=None):
        import time
        self.window = window
        self.clock = clock or time.monotonic
        self.seen: dict[tuple, list] = {}      # key -> [first time of this window, repeats since logged]

    def __call__(self, loop, context: dict) -> None:
        exc = context.get("exception")
        key = (context.get("message"), type(exc).__name__, getattr(exc, "errno", None))
        now = self.clock()
        entry = self.seen.get(key)
        if entry is None or now - entry[0] >= self.window:
            if entry is not None and entry[1]:
                logger.error("%s (%s) repeated %d more time(s) in %.0f s", key[0], key[1], entry[1], now - entry[0])
            self.seen[key] = [now, 0]
            loop.default_exception_handler(context)
        else:
            entry[1] += 1


def raise_fd_limit(max_connections: int) -> int:
    """Lift the soft open-file limit so ``max_connections`` sockets fit (plus room for the rest);
    returns the connection cap that fits under it (accept() failing with EMFILE is what must never happen)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError) as e:
            logger.warning("cannot raise the open-file limit to %d: %s", new, e)
    if soft != resource.RLIM_INFINITY and soft - 256 < max_connections:
        cap = max(1, soft - 256)
        logger.warning("--max-connections %d does not fit the open-file limit %d; serving %d", max_connections,
                       soft, cap)
        return cap
    return max_connections


# ---- per-request work --------------------------------------------------------------------------------------

def check_request_limits(limits: Limits, n: int, num_prompts: int, stop, stop_token_ids) -> None:
    """400 naming the limit when a request asks for more than the server bounds."""
    if not 1 <= n <= limits.max_n:
        raise bad_request(f"n must lie in [1, {limits.max_n}] (the server's --max-n), got {n}", "n")
    if num_prompts > limits.max_prompts:
        raise bad_request(f"a request holds at most {limits.max_prompts} prompts, got {num_prompts}", "prompt")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > limits.max_stop_strings:
        raise bad_request(f"stop holds at most {limits.max_stop_strings} strings, got {len(stops)}", "stop")
    long = [k for k, s in enumerate(stops) if isinstance(s, str) and len(s) > limits.max_stop_chars]
    if long:
        raise bad_request(f"stop[{long[0]}] has {len(stops[long[0]])} characters; a stop string has at most "
                          f"{limits.max_stop_chars}", "stop")
    if stop_token_ids is not None and len(stop_token_ids) > limits.max_stop_token_ids:
        raise bad_request(f"stop_token_ids holds at most {limits.max_stop_token_ids} ids, got "
                          f"{len(stop_token_ids)}", "stop_token_ids")


def check_text_fits(tokenizer, chars: int, max_model_len: int, param: str) -> None:
    """400 before any tokenising when ``chars`` characters of text cannot fit the context: no token stands for
    more than ``tokenizer.max_token_chars`` characters (a 57 MiB prompt held a server 127 s before this)."""
    if tokenizer is not None and chars > max_model_len * tokenizer.max_token_chars:
        raise context_exceeded(max_model_len, param)


def message_text_chars(messages) -> int:
    """Characters of the text in chat messages (string contents and text parts; images and the rest are not
    counted, so this never overstates what the rendered prompt holds)."""
    total = 0
    for m in messages if isinstance(messages, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return total


def check_response_logprobs(limits: Limits, prompt_lens: list[int], params, stream: bool,
                            prompt_logprobs_per_choice: bool = False) -> None:
    """400 naming ``--max-response-logprobs`` when a response would carry more logprob entries than the
    budget: ``prompt_logprobs`` (they come in the final body, stream or not; on /v1/completions every choice
    carries its prompt's, so n copies) and, for a JSON body, the output logprobs of every sample. A stream
    sends output logprobs as they come (its buffer is bounded)."""
    entries = 0
    if params.prompt_logprobs is not None:
        copies = params.n if prompt_logprobs_per_choice else 1
        entries += copies * sum(prompt_lens) * (1 + params.prompt_logprobs)
    if params.logprobs is not None and not stream:
        entries += len(prompt_lens) * params.n * params.max_tokens * (1 + params.logprobs)
    if entries > limits.max_response_logprobs:
        raise bad_request(f"this request would return {entries} logprob entries (prompt tokens x (1 + "
                          f"prompt_logprobs), n times on /v1/completions, + n x prompts x max_tokens x (1 + "
                          f"logprobs)), more than this server's --max-response-logprobs "
                          f"{limits.max_response_logprobs}; ask for fewer logprobs, a lower max_tokens or n, or "
                          f"stream the output", "logprobs", "response_too_large")


# ---- bodies (ASGI) ------------------------------------------------------------------------------------------

async def _send_error(send, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
           (b"connection", b"close")] + [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


async def _discard_body(receive, budget: int, timeout: float) -> None:
    """Read and drop what is left of a refused request's body (at most ``budget`` bytes, ``timeout`` seconds),
    so the client, still sending, reads the error instead of a reset connection."""
    try:
        async with asyncio.timeout(timeout):
            while budget > 0:
                message = await receive()
                budget -= len(message.get("body", b""))
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return
    except TimeoutError:
        pass


class BodyLimits:
    """Pure ASGI, outermost: host and content-type checks, then the whole body read under the size and
    time limits before the app runs (the app then reads it from memory)."""

    def __init__(self, app, limits: Limits, require_json: bool):
        self.app = app
        self.limits = limits
        self.require_json = require_json

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        hosts = self.limits.allowed_hosts
        if hosts is not None and not host_allowed(headers.get(b"host", b"").decode("latin-1"), hosts):
            return await _send_error(send, 421, f"the Host header must name one of {', '.join(hosts)} "
                                                "(--allowed-hosts; by default the interface the server is bound to)",
                                     "host_not_allowed")
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        limit = self.limits.max_body_bytes
        ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        declared = headers.get(b"content-length")
        refusal = None
        if self.require_json and ctype != b"application/json":
            refusal = (415, f"POST bodies must be sent as Content-Type: application/json, got "
                            f"{ctype.decode('latin-1') or 'none'!r}", "unsupported_media_type")
        elif declared is not None and declared.isdigit() and int(declared) > limit:
            refusal = (413, f"the request body has {int(declared)} bytes, more than the {limit} this server accepts "
                            f"(--max-body-bytes)", "body_too_large")
        if refusal is not None:
            await _discard_body(receive, 4 * limit, min(self.limits.body_timeout, 5.0))
            return await _send_error(send, *refusal)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.limits.body_timeout):
                more = True
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        if message.get("more_body", False):
                            await _discard_body(receive, 3 * limit, min(self.limits.body_timeout, 5.0))
                        return await _send_error(send, 413, f"the request body is larger than the {limit} bytes "
                                                            f"this server accepts (--max-body-bytes)", "body_too_large")
                    chunks.append(chunk)
                    more = message.get("more_body", False)
        except TimeoutError:
            return await _send_error(send, 408, f"the request body did not arrive within "
                                                f"{self.limits.body_timeout:g} s (--body-timeout)", "body_timeout")
        box = scope[BODY_KEY] = ReadBody(chunks, size)

        async def replay():
            if not box.taken:
                return {"type": "http.request", "body": box.take(), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


BODY_KEY = "kimik3.body"        # the ASGI scope key of the body BodyLimits read


class ReadBody:
    """The body BodyLimits read, as the chunks it arrived in. They are not joined on the event loop: one copy of
    a 57 MiB body held the GIL ~120 ms there, and Starlette's ``request.body()`` made a second (``/health``
    waited for both, #52); ``parse_body`` joins them on the CPU pool. ``take()`` hands the body over once."""

    def __init__(self, chunks: list[bytes], size: int | None = None):
        self.chunks, self.size = chunks, sum(map(len, chunks)) if size is None else size
        self.taken = False

    def take(self) -> bytes:
        """The whole body as one ``bytes`` (a copy when it came in several chunks: call it off the event loop)."""
        chunks = self.take_chunks()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def take_chunks(self) -> list[bytes]:
        self.taken = True
        chunks, self.chunks = self.chunks, []
        return chunks


# ---- connections (uvicorn protocol) -------------------------------------------------------------------------

async def _busy_app(scope, receive, send):
    await _send_error(send, 503, "the server has too many open connections (--max-connections); retry shortly",
                      "too_many_connections", {"Retry-After": "1"})


def _raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps(error_body(status, message, code=code)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


def _no_delay(transport) -> None:
    """TCP_NODELAY on the connection: responses go out when written, not after the peer's delayed ACK (~40 ms
    a response with Nagle's algorithm on; asyncio sets it only for listeners made with IPPROTO_TCP)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:         # the peer is already gone
            pass


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head deadline and a connection cap (``limits`` is set on the
    subclass that ``protocol_class`` makes)."""

    limits: Limits = Limits()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        _no_delay(transport)
        self._head_timer = None
        self._stall_timer = None
        self._head_started = False        # bytes of the next request head have arrived
        self._opened = self.loop.time()
        if len(self.connections) > self.limits.max_connections and not self._evict_idle():
            self.app = _busy_app          # every other connection is busy: this one's request is answered 503
        self._arm_head_timer()

    def _idle(self) -> bool:
        """No request in progress: between requests, or (part of) a head not yet complete."""
        return self.cycle is None or self.cycle.response_complete

    def _evict_idle(self) -> bool:
        """At the cap, close the connection idle longest (fully idle before half-sent heads), so idle connections
        can never lock new clients out; False if every other connection has a request in progress."""
        idle = [c for c in self.connections if c is not self and isinstance(c, LimitedH11Protocol) and c._idle()
                and not c.transport.is_closing()]
        if not idle:
            return False
        victim = min(idle, key=lambda c: (c._head_started, c._opened))
        victim.transport.abort()
        return True

    def pause_writing(self) -> None:
        """The client stopped reading (our send buffer is full): drop the connection if it stays so for
        ``stall_timeout`` seconds (its request is then aborted, as for any disconnect)."""
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.limits.stall_timeout, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _stalled(self) -> None:
        self._stall_timer = None
        logger.info("dropping a connection whose client read nothing for %g s (--stall-timeout)",
                    self.limits.stall_timeout)
        self.transport.abort()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        if self._head_started:             # an idle connection is just closed
            self.transport.write(_raw_response(408, "Request Timeout", f"no complete request head within "
                                               f"{self.limits.header_timeout:g} s (--header-timeout)",
                                               "header_timeout"))
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        self._head_started = True
        super().data_received(data)
        if self.cycle is not before:      # a request head arrived: its body has its own deadline
            self._disarm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._head_started = False
        if not self.transport.is_closing():
            self._arm_head_timer()         # the next request's head (keep-alive)

    def connection_lost(self, exc) -> None:
        self._disarm_head_timer()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        super().connection_lost(exc)


def protocol_class(limits: Limits) -> type[LimitedH11Protocol]:
    return type("KimiH11Protocol", (LimitedH11Protocol,), {"limits": limits})
