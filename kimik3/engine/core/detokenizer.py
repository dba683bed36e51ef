"""Output text of one generated sequence: incremental decoding plus stop-string matching.

Decoding is the tokenizer's own streaming detokenizer (``tokenizer.detokenizer(skip_special_tokens)``
with ``feed(ids) -> str``), which never emits half a UTF-8 character. Text handed out (``take``) moves
to a list of pieces; the tail not yet handed out is the only string that grows, and the only one
searched for stop strings, so each step costs O(1) in the output length (one string grown by ``+=``
is copied whole on each append: 68 us an append at 400k characters, where long reasoning outputs go).
Without stop strings nothing needs the text token by token: ``add`` only queues the id, and the queue is decoded
in one ``feed`` when the text is asked for (``take``, ``text``, ``finish``), once a delta instead of once a token.
"""

from __future__ import annotations


class OutputText:
    def __init__(self, tokenizer, stop: tuple[str, ...], skip_special_tokens: bool, include_stop: bool = False):
        self.stream = tokenizer.detokenizer(skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop    # keep the stop string at the end of the text (vLLM's include_stop_str_in_output)
        self.holdback = max((len(s) for s in stop), default=1) - 1   # chars that may begin a stop string
        self._taken: list[str] = []         # text handed out by ``take``
        self.tail = ""                      # the rest; while running it holds at least the last ``holdback`` chars
        self._queued: list[int] = []        # ids not decoded yet (no stop strings: decoded when the text is read)

    @property
    def text(self) -> str:
        self._decode_queued()
        return "".join(self._taken) + self.tail

    def _decode_queued(self) -> None:
        if self._queued:
            self.tail += self.stream.feed(self._queued)
            self._queued = []

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append a token; returns the stop string if the text now holds one (the text is cut before it,
        or after it with ``include_stop``). ``check_stop=False`` (before min_tokens) only appends."""
        if not self.stop:
            self._queued.append(token_id)
            return None
        delta = self.stream.feed([token_id])
        if not delta:
            return None
        start = max(0, len(self.tail) - self.holdback)
        self.tail += delta
        if not check_stop:
            return None
        hits = [(i, s) for s in self.stop if (i := self.tail.find(s, start)) >= 0]
        if not hits:
            return None
        i, s = min(hits)
        self.tail = self.tail[:i + len(s) if self.include_stop else i]
        return s

    def finish(self) -> None:
        """The sequence ended: an incomplete trailing character becomes U+FFFD, as ``decode`` gives."""
        self._decode_queued()
        self.tail += self.stream.finish()

    def take(self, finished: bool) -> str:
        """The text not handed out yet that is safe to stream: while running, a tail that might begin a
        stop string is withheld."""
        self._decode_queued()
        end = len(self.tail) if finished or not self.holdback else max(0, len(self.tail) - self.holdback)
        out, self.tail = self.tail[:end], self.tail[end:]
        self._taken.append(out)
        return out
