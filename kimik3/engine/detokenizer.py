"""Output text of one generated sequence: incremental decoding plus stop-string matching.

Decoding is the tokenizer's own streaming detokenizer (``tokenizer.detokenizer(skip_special_tokens)``
with ``feed(ids) -> str``), which never emits half a UTF-8 character; only the text tail is searched
for stop strings, so each step costs O(1) in the output length.
"""

from __future__ import annotations


class OutputText:
    def __init__(self, tokenizer, stop: tuple[str, ...], skip_special_tokens: bool, include_stop: bool = False):
        self.stream = tokenizer.detokenizer(skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop    # keep the stop string at the end of the text (vLLM's include_stop_str_in_output)
        self.text = ""
        self.holdback = max((len(s) for s in stop), default=1) - 1   # chars that may begin a stop string

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append a token; returns the stop string if the text now holds one (the text is cut before it,
        or after it with ``include_stop``). ``check_stop=False`` (before min_tokens) only appends."""
        delta = self.stream.feed([token_id])
        if not delta:
            return None
        if not check_stop:
            self.text += delta
            return None
        start = max(0, len(self.text) - self.holdback)
        self.text += delta
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return None
        i, s = min(hits)
        self.text = self.text[:i + len(s) if self.include_stop else i]
        return s

    def finish(self) -> None:
        """The sequence ended: an incomplete trailing character becomes U+FFFD, as ``decode`` gives."""
        self.text += self.stream.finish()

    def visible(self, finished: bool) -> str:
        """Text safe to stream: while running, withhold a tail that might begin a stop string."""
        if finished or not self.holdback:
            return self.text
        return self.text[:max(0, len(self.text) - self.holdback)]
