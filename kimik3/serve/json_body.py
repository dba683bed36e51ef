"""Large JSON bodies rendered off the event loop, in pieces.

``json.dumps`` holds the GIL for the whole call: a 10 MB body (``prompt_logprobs=20`` on an 8k prompt, n x
logprobs) held it ~0.8 s of CPU, on the event loop, so ``/health`` and every stream waited (#52). Here the body is
rendered on the server's CPU pool, and in pieces of about ``PIECE`` scalars each, so the interpreter can hand the
GIL to the event loop and the engine thread between pieces. The bytes are those ``JSONResponse`` renders
(``ensure_ascii=False``, no spaces, no NaN or infinity).
"""

from __future__ import annotations

import json
import time

from fastapi.responses import Response

PIECE = 2048            # scalars a single json.dumps call renders at most (about 0.2-1 ms of CPU)
BURST = 0.002           # seconds of rendering between two pauses
PAUSE = 0.002           # seconds a renderer sleeps (the GIL free) after each burst
_dumps = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


def weight(obj) -> int:
    """About how many scalars ``obj`` holds: a list is taken as ``len`` copies of the largest of its first, middle
    and last items (bodies are lists of like items; prompt_logprobs starts with None), so this costs the depth of
    the body, not its size."""
    if isinstance(obj, dict):
        return 1 + sum(weight(v) for v in obj.values()) if len(obj) <= 64 else 1 + len(obj) * 2
    if isinstance(obj, (list, tuple)):
        return 1 + len(obj) * _item_weight(obj) if obj else 1
    return 1


def _item_weight(items) -> int:
    return max(weight(items[0]), weight(items[len(items) // 2]), weight(items[-1]))


class Pacer:
    """Sleeps ``pause`` seconds after every ``burst`` seconds of work (``__call__`` between pieces of it).

    A CPU-bound Python thread beside the engine thread slows every step it overlaps: the engine thread drops the
    GIL in each torch op and waits up to the switch interval to get it back, hundreds of times a step (the GIL
    convoy). Formatting and rendering an 8k x 20 prompt-logprob body took ~1 s of Python, and the innocent stream's
    step that overlapped it took 0.66 s (0.84 s for n=64 x 195 x 20 logprobs). Paced, the engine thread holds the
    GIL undisturbed half the time; the large body takes about twice its CPU time to render."""

    def __init__(self, burst: float = BURST, pause: float = PAUSE):
        self.burst, self.pause = burst, pause
        self.pauses = 0
        self._since = time.perf_counter()

    def __call__(self) -> None:
        now = time.perf_counter()
        if now - self._since >= self.burst:
            time.sleep(self.pause)
            self.pauses += 1
            self._since = time.perf_counter()


def _no_pace() -> None:
    return None


def _render(obj, out: list[str], piece: int, pace=_no_pace) -> None:
    pace()
    if weight(obj) <= piece:
        out.append(_dumps(obj))
    elif isinstance(obj, dict):
        out.append("{")
        for i, (key, value) in enumerate(obj.items()):
            out.append(("," if i else "") + _dumps(str(key)) + ":")
            _render(value, out, piece, pace)
        out.append("}")
    else:
        out.append("[")
        first = True
        for group in _groups(obj, piece):
            if not first:
                out.append(",")
            first = False
            if len(group) == 1:
                _render(group[0], out, piece, pace)
            else:
                pace()
                out.append(_dumps(group)[1:-1])
        out.append("]")


def _groups(items, piece: int):
    """Consecutive runs of ``items`` of about ``piece`` scalars (an item larger than that alone). A short list
    (choices) has each item weighed; a long one is cut by its first item's weight."""
    if len(items) > 256:
        step = max(1, piece // _item_weight(items))
        for start in range(0, len(items), step):
            yield items[start:start + step]
        return
    group, size = [], 0
    for item in items:
        w = weight(item)
        if group and size + w > piece:
            yield group
            group, size = [], 0
        group.append(item)
        size += w
    if group:
        yield group


def render(obj, piece: int = PIECE, pace=_no_pace) -> bytes:
    """``obj`` as JSON bytes, rendered in pieces of about ``piece`` scalars; ``pace()`` is called between them
    (a ``Pacer``: the CPU pool's renders leave the engine thread room)."""
    out: list[str] = []
    _render(obj, out, piece, pace)
    return "".join(out).encode()


class RenderedJSON(Response):
    """A JSON response whose bytes are already rendered."""

    media_type = "application/json"


async def json_response(state, body, status_code: int = 200) -> Response:
    """``body`` as a JSON response: small bodies rendered at once, large ones on the CPU pool in pieces."""
    if weight(body) <= PIECE:
        return RenderedJSON(_dumps(body).encode(), status_code=status_code)
    return RenderedJSON(await state.cpu(lambda: render(body, pace=Pacer())), status_code=status_code)
