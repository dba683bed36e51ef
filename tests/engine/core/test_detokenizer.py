"""OutputText against a direct computation: the whole text searched for the stop strings after each
token, and the pieces handed out while it runs adding up to the final text."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kimik3.engine.core.detokenizer import OutputText


class _Stream:
    """Token t decodes to one letter of "abc" (t < 3) or to nothing yet (t == 3, half a character)."""

    def feed(self, ids):
        return "".join("abc"[t] for t in ids if t < 3)

    def finish(self):
        return ""


class _Tok:
    def detokenizer(self, skip_special_tokens=False):
        return _Stream()


def _reference(tokens, stops, include):
    text = ""
    for n, t in enumerate(tokens):
        text += "abc"[t] if t < 3 else ""
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            i, s = min(hits)
            return text[:i + len(s) if include else i], s, n
    return text, None, len(tokens) - 1


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=60), st.lists(st.text("abc", min_size=1, max_size=4), max_size=3),
       st.booleans())
def test_stop_strings_and_streamed_pieces_match_the_whole_text(tokens, stops, include):
    text, stop, last = _reference(tokens, tuple(stops), include)
    out = OutputText(_Tok(), tuple(stops), False, include)
    pieces, hit = [], None
    for n, t in enumerate(tokens):
        hit = out.add(t)
        if hit is not None:
            break
        pieces.append(out.take(False))
    pieces.append(out.take(True))
    assert hit == stop
    assert out.text == text and "".join(pieces) == text
    assert n == last if tokens else True
