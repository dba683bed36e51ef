"""Large JSON bodies rendered off the event loop, in pieces.

``json.dumps`` holds the GIL for the whole call: a 10 MB body (``prompt_logprobs=20`` on an 8k prompt, n x
logprobs) held it ~0.8 s of CPU, on the event loop, so ``/health`` and every stream waited (#52). Here the body is
rendered on the server's CPU pool, and in pieces of about ``PIECE`` scalars each, so the interpreter can hand the
GIL to the event loop and the engine thread between pieces. The bytes are those ``JSONResponse`` renders
(``ensure_ascii=False``, no spaces, no NaN or infinity).
"""

from __future__ import annotations

import json

from fastapi.responses import Response

PIECE = 2048            # scalars a single json.dumps call renders at most (about 0.2-1 ms of CPU)
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


def _render(obj, out: list[str], piece: int) -> None:
    if weight(obj) <= piece:
        out.append(_dumps(obj))
    elif isinstance(obj, dict):
        out.append("{")
        for i, (key, value) in enumerate(obj.items()):
            out.append(("," if i else "") + _dumps(str(key)) + ":")
            _render(value, out, piece)
        out.append("}")
    else:
        out.append("[")
        first = True
        for group in _groups(obj, piece):
            if not first:
                out.append(",")
            first = False
            if len(group) == 1:
                _render(group[0], out, piece)
            else:
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


def render(obj, piece: int = PIECE) -> bytes:
    """``obj`` as JSON bytes, rendered in pieces of about ``piece`` scalars."""
    out: list[str] = []
    _render(obj, out, piece)
    return "".join(out).encode()


class RenderedJSON(Response):
    """A JSON response whose bytes are already rendered."""

    media_type = "application/json"


async def json_response(state, body, status_code: int = 200) -> Response:
    """``body`` as a JSON response: small bodies rendered at once, large ones on the CPU pool in pieces."""
    if weight(body) <= PIECE:
        return RenderedJSON(_dumps(body).encode(), status_code=status_code)
    return RenderedJSON(await state.cpu(render, body), status_code=status_code)
