"""Grammar compilation in a separate process, under a time and a memory budget.

llguidance compiles grammars in native code: a JSON schema whose ``$defs`` chain 1,000 objects or a Lark
grammar of 3,000 chained rules overflows its stack (signal 11), and some small grammars take seconds and
gigabytes (``x{1000000}``, an ``allOf`` of ``^(.*a.*){i}$`` patterns). So every grammar is first compiled
here, by a worker process that runs this file as a script (no torch, no kimik3 package: it starts in well
under a second and holds only the tokenizer): the worker builds the matcher and its first token mask, the
work the server will repeat, under ``RLIMIT_AS`` (its start-up address space plus ``memory_bytes``) while
the caller waits at most ``timeout`` seconds. A grammar that compiles there compiles in the server
(the same deterministic code, tokenizer and limits), within about the same time and memory; one that fails,
overruns or kills the worker is a ValueError for its request alone, and the worker is replaced.

Wire format on the worker's stdin / stdout: 4-byte big-endian length + a pickle (both ends are this file).
The first message is the tokenizer; each later one a grammar text, answered ``("ok", "")`` or
``("error", message)``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time

_HEADER = struct.Struct(">I")
START_TIMEOUT = 120.0       # seconds a fresh worker gets to import llguidance and build the tokenizer


def _write(fd: int, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    chunks, left = [], n
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read(fd: int, deadline: float | None = None):
    (n,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    return pickle.loads(_read_exact(fd, n, deadline))


# ---- the worker process (this file run as a script) --------------------------------------------------------

def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _worker_main() -> None:
    import resource

    import llguidance
    rfd, wfd = sys.stdin.fileno(), sys.stdout.fileno()
    spec = _read(rfd)
    tok = llguidance.LLTokenizer.from_tiktoken(encoder=spec["ranks"], special_tokens=spec["special"],
                                               pattern=spec["pattern"], eos_token=spec["eos"],
                                               n_vocab=spec["n_vocab"])
    limits = llguidance.LLParserLimits(**spec["limits"])
    try:
        cap = _address_space() + spec["memory_bytes"]
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    except (OSError, ValueError):   # pragma: no cover - no /proc or no RLIMIT_AS: the time budget still holds
        pass
    _write(wfd, ("ready", ""))
    while True:
        try:
            grammar = _read(rfd)
        except EOFError:
            return
        try:
            m = llguidance.LLMatcher(tok, grammar, log_level=0, limits=limits)
            if not m.is_error():
                m.compute_bitmask()
            reply = ("error", m.get_error()) if m.is_error() else ("ok", "")
        except MemoryError:
            reply = ("error", "it needs more memory than the grammar compiler's budget")
        except Exception as e:  # noqa: BLE001 - any failure is the grammar's: report it
            reply = ("error", f"{type(e).__name__}: {e}")
        _write(wfd, reply)


# ---- the server side -------------------------------------------------------------------------------------

class _Worker:
    def __init__(self, spec: dict):
        self.proc = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        self.wfd, self.rfd = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        _write(self.wfd, spec)
        self.ready = False

    def ask(self, grammar: str, timeout: float):
        if not self.ready:       # the start-up does not count against the grammar's budget
            _read(self.rfd, time.monotonic() + START_TIMEOUT)
            self.ready = True
        _write(self.wfd, grammar)
        return _read(self.rfd, time.monotonic() + timeout)

    def kill(self) -> int | None:
        """End the process; its exit status (negative: the signal that ended it)."""
        if self.proc.poll() is None:
            self.proc.kill()
        status = self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        return status


def _describe(status: int | None) -> str:
    if status is not None and status < 0:
        try:
            return f"signal {-status} ({signal.Signals(-status).name})"
        except ValueError:
            return f"signal {-status}"
    return f"exit status {status}"


class IdlePool:
    """Worker processes kept for reuse (this file's and ``kimik3/serve/body_worker.py``'s): at most
    ``num_workers`` leased at once, each started on first need; thread-safe. A worker whose lease ends in an
    exception is killed (its process may be mid-message), the others wait idle for the next lease."""

    def __init__(self, num_workers: int):
        self._idle: list = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(num_workers)
        self._closed = False

    @contextlib.contextmanager
    def lease(self, start, closed_error: Exception):
        """An idle worker, or ``start()``'s; ``closed_error`` is raised once ``close`` was called."""
        with self._slots:
            with self._lock:
                if self._closed:
                    raise closed_error
                worker = self._idle.pop() if self._idle else None
            if worker is None:
                worker = start()
            try:
                yield worker
            except BaseException:
                worker.kill()
                raise
            with self._lock:
                if self._closed:
                    worker.kill()
                else:
                    self._idle.append(worker)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()


class GrammarWorkers:
    """A small pool of compile workers (started on first use, at most ``num_workers``); thread-safe.

    ``validate(grammar)`` returns once the grammar compiled in a worker, or raises ValueError naming why
    not (an llguidance error, the time budget, or the worker's death: a crash or the memory budget)."""

    def __init__(self, encoding, n_vocab: int, eos: list[int], *, timeout: float, memory_bytes: int,
                 limits: dict, num_workers: int = 2):
        self.spec = {"ranks": encoding._mergeable_ranks, "special": encoding._special_tokens,
                     "pattern": encoding._pat_str, "eos": eos, "n_vocab": n_vocab, "limits": limits,
                     "memory_bytes": memory_bytes}
        self.timeout = timeout
        self.memory_bytes = memory_bytes
        self._pool = IdlePool(num_workers)

    def validate(self, grammar: str) -> None:
        closed = ValueError("structured_outputs: the engine is shutting down")
        with self._pool.lease(lambda: _Worker(self.spec), closed) as worker:
            try:
                kind, message = worker.ask(grammar, self.timeout)
            except TimeoutError:        # the lease kills the worker (as every worker whose lease ends in an error)
                raise ValueError(f"structured_outputs: the constraint did not compile within the {self.timeout:g} s "
                                 f"budget (--grammar-compile-timeout); simplify it") from None
            except (EOFError, OSError):
                status = worker.kill()
                raise ValueError(f"structured_outputs: the grammar compiler failed on this constraint "
                                 f"({_describe(status)}: it crashed or needed more than its "
                                 f"{self.memory_bytes >> 20} MiB budget, --grammar-compile-memory); simplify "
                                 f"it") from None
        if kind != "ok":
            raise ValueError(f"structured_outputs: the constraint does not compile: {message}")

    def close(self) -> None:
        self._pool.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


if __name__ == "__main__":
    _worker_main()
