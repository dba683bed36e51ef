"""Large request bodies validated in a separate process, so the server's interpreter never holds its lock for them.

pydantic validates a body in one native call that holds the GIL throughout: a 57 MiB ``/tokenize`` prompt took
~120 ms, and for that long ``/health`` and every stream waited (#52), on top of joining the body's chunks (as long
again). A body over ``WORKER_BODY_BYTES`` is instead written, chunk by chunk, to a worker process (``os.write``
releases the GIL) that validates it against the same model in ``kimik3/serve/protocol.py``, runs the route's
body-only refusals there (``TokenizeChecks``: a prompt too long for any context is refused without being built in
the server) and sends back the model, pickled, or the refusal. The reply is read into an anonymous ``mmap`` (the
kernel fills its pages with the GIL free) and unpickled in one call: the only part that holds the server's GIL,
as long as building the strings the route will use anyway.

The worker runs this file as a script (``python -P``: no kimik3 package, no torch; it loads ``protocol.py`` by
path under its own name, so the models pickle by reference both ways). Wire format, both ways: 4-byte big-endian
length + payload. To the worker: a pickle ``(model name, checks or None)``, then the body. Back: a pickle
``("ok", model)``, ``("refused", (status, message, param, code))`` or ``("error", text)`` (a worker fault).
A worker that fails, overruns ``TIMEOUT`` or dies is replaced, and that body is validated in the server as before.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import mmap
import os
import pickle
import select
import struct
import subprocess
import sys
import time
import types

_HEADER = struct.Struct(">I")
WORKER_BODY_BYTES = 4 << 20     # bodies larger than this are validated in a worker (smaller ones: ~10 ms or less)
PIPE_BYTES = 1 << 20           # the pipes' capacity asked for (Linux's default limit for an unprivileged process)
IOV_MAX = os.sysconf("SC_IOV_MAX")   # buffers one writev takes (1024 on Linux; more is EINVAL)
TIMEOUT = 60.0                  # seconds a worker gets to start and answer one body (64 MiB validate in ~0.5 s)
_PROTOCOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "protocol.py")

logger = logging.getLogger(__name__)


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _send(fd: int, parts: list) -> None:
    """One message made of ``parts`` (bytes-like: a pickle, or a body's chunks); nothing is joined."""
    _write_chunks(fd, [_HEADER.pack(sum(map(len, parts))), *parts])


def _write_chunks(fd: int, chunks: list) -> None:
    """``chunks`` written ``PIPE_BYTES`` at a time: each call releases the GIL for its whole write (one call per
    64 KiB chunk re-took it 900 times for a 57 MiB body, each time waiting out the engine thread's slice)."""
    i = 0
    while i < len(chunks):
        group, size = [], 0
        while i < len(chunks) and len(group) < IOV_MAX and (not group or size + len(chunks[i]) <= PIPE_BYTES):
            group.append(chunks[i])
            size += len(chunks[i])
            i += 1
        done = os.writev(fd, group)
        if done < size:         # a partial write (a signal): the rest one by one
            _write_all(fd, b"".join(group)[done:])


def _wait(fd: int, deadline: float | None) -> None:
    if deadline is not None:
        wait = deadline - time.monotonic()
        if wait <= 0 or not select.select([fd], [], [], wait)[0]:
            raise TimeoutError


def _read_into(fd: int, buf, deadline: float | None) -> None:
    view, done = memoryview(buf), 0
    while done < len(view):
        _wait(fd, deadline)
        got = os.readv(fd, [view[done:]])
        if not got:
            raise EOFError
        done += got


def _receive(fd: int, deadline: float | None = None):
    """One message's payload: small ones as bytes, large ones in an anonymous mmap (pages filled by the kernel)."""
    head = bytearray(_HEADER.size)
    _read_into(fd, head, deadline)
    (n,) = _HEADER.unpack(head)
    buf = bytearray(n) if n <= 1 << 20 else mmap.mmap(-1, n)
    _read_into(fd, buf, deadline)
    return buf


# ---- the worker process (this file run as a script) --------------------------------------------------------

def _load_protocol():
    """``kimik3/serve/protocol.py`` as ``kimik3.serve.protocol`` without importing the package (or torch)."""
    for name in ("kimik3", "kimik3.serve"):
        pkg = types.ModuleType(name)
        pkg.__path__ = []
        sys.modules[name] = pkg
    spec = importlib.util.spec_from_file_location("kimik3.serve.protocol", _PROTOCOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _answer(protocol, name: str, checks, body) -> tuple:
    try:
        req = getattr(protocol, name).model_validate_json(body)
        if checks is not None:
            checks(req)
        return "ok", req
    except protocol.ValidationError as e:
        err = protocol.validation_error(e)
    except protocol.APIError as e:
        err = e
    return "refused", (err.status, err.message, err.param, err.code)


def _worker_main() -> None:
    protocol = _load_protocol()
    rfd, wfd = sys.stdin.fileno(), sys.stdout.fileno()
    _send(wfd, [pickle.dumps(("ready", None))])
    while True:
        try:
            name, checks = pickle.loads(_receive(rfd))
            body = bytes(_receive(rfd))
        except EOFError:
            return
        try:
            reply = _answer(protocol, name, checks, body)
        except Exception as e:  # noqa: BLE001 - reported; the server validates this body itself
            reply = "error", f"{type(e).__name__}: {e}"
        del body
        _send(wfd, [pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)])


# ---- the server side -------------------------------------------------------------------------------------

class WorkerFault(Exception):
    """The worker could not answer (it failed, overran ``TIMEOUT`` or died): validate the body in the server."""


class _Worker:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        self.wfd, self.rfd = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        for fd in (self.wfd, self.rfd):
            try:
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
            except (OSError, AttributeError):     # pragma: no cover - not Linux, or a lower limit: 64 KiB pipes
                pass
        self.ready = False

    def ask(self, name: str, checks, chunks: list[bytes]) -> tuple:
        deadline = time.monotonic() + TIMEOUT
        if not self.ready:
            pickle.loads(_receive(self.rfd, deadline))
            self.ready = True
        _send(self.wfd, [pickle.dumps((name, checks))])
        _send(self.wfd, chunks)
        reply = _receive(self.rfd, deadline)
        try:
            return pickle.loads(reply)
        finally:
            if isinstance(reply, mmap.mmap):
                reply.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class BodyWorkers:
    """At most ``num_workers`` body workers (started on first use, then kept); thread-safe: call ``validate`` from
    the server's CPU pool."""

    def __init__(self, num_workers: int = 1):
        from kimik3.engine.sample.grammar_worker import IdlePool    # not at the top: the worker has no kimik3
        self._pool = IdlePool(num_workers)

    @staticmethod
    def handles(model: type) -> bool:
        """Whether a worker can validate ``model``: the models of protocol.py (the one file a worker loads)."""
        return model.__module__ == "kimik3.serve.protocol"

    def validate(self, model: type, checks, chunks: list[bytes]):
        """``model`` validated from the body ``chunks`` and passed through ``checks``; raises the
        ``APIError`` the server would (the refusal), or ``WorkerFault``."""
        from kimik3.serve.protocol import APIError
        closed = WorkerFault("the server is shutting down")
        try:
            with self._pool.lease(_Worker, closed) as worker:
                kind, value = worker.ask(model.__name__, checks, chunks)
        except WorkerFault:
            raise
        except Exception as e:      # the worker failed, overran or died: it was killed
            raise WorkerFault(f"{type(e).__name__}: {e}") from None
        if kind == "ok":
            return value
        if kind == "refused":
            raise APIError(*value)
        raise WorkerFault(value)

    def close(self) -> None:
        self._pool.close()


if __name__ == "__main__":
    _worker_main()
