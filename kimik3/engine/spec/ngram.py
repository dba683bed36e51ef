"""N-gram (prompt lookup) drafts: no draft model, no extra weights.

Each decode step, a request may carry up to ``k`` draft tokens (k: the room the scheduler computed): the
tokens that followed the most recent earlier occurrence of its last ``n`` tokens (n from ``max_n`` down to
``min_n``). ``verify.py`` checks them against the target. Drafts that keep failing stop costing verify
rows: a request whose verify step accepted none watches its predictions on the host instead (``WATCH_HITS``)
and drafts again once they come true; a rejected draft limits the next step's drafts (``NgramState.limit``).
The per-request state (``NgramState``, in ``Request.spec``) is this module's alone.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from kimik3.engine.spec.drafter import Drafter, watch_pause


def token_bytes(token_ids: list[int], buf: bytearray) -> bytearray:
    """``token_ids`` as int64 bytes for ``propose_ngram``: ``buf`` (kept per request, ``NgramState``) extended
    by the tokens appended since the last call (converting a 1M-token list each step took 59 ms)."""
    width = array("q").itemsize
    if len(buf) // width < len(token_ids):
        buf.extend(array("q", token_ids[len(buf) // width:]).tobytes())
    return buf


def _rfind_tokens(data: bytes, n: int, end: int) -> int:
    """Token index of the latest occurrence of the last ``n`` tokens of ``data`` (int64 bytes) that
    ends by byte ``end``; -1 when there is none."""
    width = array("q").itemsize
    suffix = data[-n * width:]
    while True:
        pos = data.rfind(suffix, 0, end)
        if pos < 0:
            return -1
        if pos % width == 0:                # token-aligned match
            return pos // width
        end = pos + len(suffix) - 1


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int, data: bytes | None = None,
                  follow: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix n-gram
    (``max_n`` >= n >= ``min_n``) of ``token_ids`` that ``follow`` tokens or more follow; [] when none
    recurs. ``data``: the same tokens as int64 bytes (``token_bytes``), else converted here."""
    if k < 1 or len(token_ids) < min_n + follow:
        return []
    data = array("q", token_ids).tobytes() if data is None else data
    width = array("q").itemsize
    for n in range(min(max_n, len(token_ids) - follow), min_n - 1, -1):
        pos = _rfind_tokens(data, n, len(data) - follow * width)    # it ends ``follow`` tokens before the end
        if pos >= 0:
            return token_ids[pos + n:pos + n + k]
    return []


def may_propose_after(token_ids: list[int], min_n: int, data: bytes | None = None) -> bool:
    """False when ``propose_ngram`` finds nothing for ``token_ids`` plus any one more token: its
    suffix n-grams (n >= ``min_n``) end in that token, so each can recur only where the n - 1 tokens
    before it recur followed by a token, and the shortest of those (n = min_n) recurs wherever a longer
    one does. With min_n = 1 any token may recur: True. Under async scheduling this lets a step whose
    drafts cannot exist run ahead instead of waiting for the previous step's token."""
    if min_n <= 1:
        return True
    if len(token_ids) < min_n:
        return False
    data = array("q", token_ids).tobytes() if data is None else data
    width = array("q").itemsize
    return _rfind_tokens(data, min_n - 1, len(data) - width) >= 0


# A request whose verify step accepted no draft stops drafting and watches instead: each decode step still
# looks up its n-gram prediction of the next token (on the host, no rows on the device), and it drafts again
# once WATCH_HITS predictions in a row came true (``NgramDrafter._watching``). A prediction that comes true is
# exactly a first draft that would have been accepted (greedy; sampled: with the probability the verify
# accepts it), so drafts that keep failing cost one failed verify on the device, where a fixed pause
# probed again after 4, 16, 64 .. 128 steps (each probe about 0.2 of a plain step on the K3 slice: rejected
# drafts cost 0.5-0.6% of the first 256 tokens at 856b609). Two hits in a row, not one: where predictions
# come true at random with probability p, a probe follows p^2 of the steps, not p.
WATCH_HITS = 2
# Under async scheduling a request whose n-gram lookup found nothing skips this many decode steps' lookups
# (on a long context each lookup scans its whole history).
EMPTY_DRAFT_PAUSE = 4


@dataclass
class NgramState:
    """One request's n-gram drafting state (``Request.spec``)."""

    misses: int = 0                         # failed verify step + wrong predictions since (> 0: watching)
    watch: tuple[int, int] | None = None    # watching: (position, its predicted token)
    streak: int = 0                         # watching: predictions in a row that came true
    pause: int = 0                          # decode steps left before the next lookup
    limit: int = 1 << 30                    # most drafts the next step carries (``settle``)
    token_bytes: bytearray = field(default_factory=bytearray)   # token_ids as int64 (``token_bytes``)

    @property
    def watching(self) -> bool:
        """Watching its predictions instead of drafting (a failed verify step, watching on)."""
        return bool(self.misses) and WATCH_HITS > 0


class NgramDrafter(Drafter):
    """Prompt-lookup drafts (module docstring), between ``speculative_ngram_min`` and ``_max`` tokens long."""

    drafts_ahead = True

    @staticmethod
    def state(req) -> NgramState:
        if req.spec is None:
            req.spec = NgramState()
        return req.spec

    def _lookup(self, req, s: NgramState, k: int, follow: int = 1) -> list[int]:
        cfg = self.config
        return propose_ngram(req.token_ids, k, cfg.speculative_ngram_min, cfg.speculative_ngram_max,
                             data=token_bytes(req.token_ids, s.token_bytes), follow=follow)

    def propose(self, req, room: int) -> list[int]:
        s = self.state(req)
        if s.pause:                       # after an empty lookup, or a wrong watched prediction (``_watching``)
            s.pause -= 1
            return []
        draft = self._lookup(req, s, min(room, s.limit))
        watching = self._watching(req, s, draft[0] if draft else None)
        if draft and req.matcher is not None and not watching:   # only drafts the grammar accepts (the rest
            draft = draft[:req.matcher.valid_prefix(draft)]       # would be rejected)
        if not draft and self.config.async_scheduling:
            s.pause = max(s.pause, EMPTY_DRAFT_PAUSE)
        return [] if watching else draft

    def propose_ahead(self, req, room: int) -> list[int] | None:
        """[g, drafts..] for the step after ``req``'s pending token t, before t reaches the host: the lookup on
        the tokens before t (``follow`` = 2) proposes g (its guess of t) and the tokens after it; the drafts
        are those after g (verified against the real t's continuation, so a wrong g only costs their rows; and
        it tells the engine to expect their rejection, ``Scheduler.schedule_past_rejection``). Nothing found
        ([]): a pause, as after ``propose``'s empty lookup. A watching request (``_watching``) only records
        the guess as its prediction of t. None (wait for t): a request whose grammar must accept the drafts
        (its matcher has not seen t), unless no draft can follow any t (``may_propose_after``). A request with
        penalties drafts only after t is on the host (``propose``; [] here): its rows' history must hold t."""
        s = self.state(req)
        if s.pause or req.params.has_penalties:
            return []
        if req.matcher is not None and not s.watching:
            if may_propose_after(req.token_ids, self.config.speculative_ngram_min,
                                 token_bytes(req.token_ids, s.token_bytes)):
                return None
            s.pause = EMPTY_DRAFT_PAUSE + 1
            return []
        k = min(room, s.limit)
        guess = self._lookup(req, s, k + 1, follow=2) if k >= 1 else []
        if self._watching(req, s, guess[0] if guess else None):
            if not guess:
                s.pause = max(s.pause, EMPTY_DRAFT_PAUSE)
            if s.pause:
                s.pause += 1                   # ahead_scheduled counts this step too
            return []
        if req.matcher is not None:      # its watch just ended: the grammar must see t before drafts
            return None
        if len(guess) < 2:
            s.pause = EMPTY_DRAFT_PAUSE + 1
            return []
        return guess

    def ahead_scheduled(self, req) -> None:
        s = self.state(req)
        if s.pause:
            s.pause -= 1                       # a decode step without drafts, as ``propose`` counts them

    def expects_rejection(self, req) -> bool:
        """Its last verify step accepted no draft (only with watching off, ``WATCH_HITS`` = 0: a watching
        request drafts after right predictions)."""
        return bool(self.state(req).misses)

    def settle(self, req, draft: list[int], num_accepted: int) -> None:
        """A request that accepted no draft watches instead of drafting (``WATCH_HITS``), and its next step
        carries at most m + 1 drafts (``NgramState.limit``)."""
        s, m = self.state(req), num_accepted
        s.misses = 0 if m else s.misses + 1
        s.streak, s.watch = 0, None
        # A rejected draft limits the next step's drafts to m + 1 (a step that accepted all raises the limit by
        # one; the scheduler caps it at ``num_speculative_tokens``): each row of a verify step costs (on MoE
        # models a row touches its own top-k experts: a (1, 4)-row verify graph of the K3 slice reads up to four
        # tokens' experts), so drafts that fail at the same place stop paying for the rows after it, and a
        # request back from watching probes with one draft.
        s.limit = m + 1 if m < len(draft) else max(s.limit, m + 1)

    @staticmethod
    def _watching(req, s: NgramState, prediction: int | None) -> bool:
        """True while ``req`` watches instead of drafting (its last verify accepted no draft; ``WATCH_HITS``).
        Scores its last watched prediction if the token it predicted is the one that just came: a miss pauses
        its lookups (``watch_pause``: a request whose predictions keep failing looks up as seldom as the old
        probes did, and its host work stays bounded on long contexts); otherwise it watches ``prediction`` (the
        lookup's first token: its guess of token ``num_tokens``). WATCH_HITS right predictions in a row end
        the watch, and this lookup's drafts go to the device."""
        if not s.watching:
            return False
        last, s.watch = s.watch, None
        if last is not None and last[0] == req.num_tokens - 1:      # the token it predicted has come
            if last[1] != req.token_ids[-1]:
                s.streak = 0
                s.misses += 1
                s.pause = watch_pause(s.misses)
                return True
            s.streak += 1
        if s.streak >= WATCH_HITS:
            s.misses = s.streak = 0
            return False
        if prediction is not None:
            s.watch = (req.num_tokens, prediction)
        return True
