"""Acceptance counts of a draft model's drafts (``controller.py``): the first draft's rate and a later draft's
after the one before it, exponentially decayed, per request and for the whole drafter."""

from __future__ import annotations

from dataclasses import dataclass, field

REQUEST_DECAY = 0.85     # a request's acceptance counts decay per observed draft (about 7 drafts of memory)
GLOBAL_DECAY = 0.98      # the drafter's global counts (the prior of new and quiet requests)
PRIOR = 2.0              # pseudo-observations of the global rates in a request's estimate


@dataclass
class Rate:
    """Decayed hit/try counts."""

    hits: float = 0.0
    tries: float = 0.0

    def add(self, hits: float, tries: float, decay: float) -> None:
        if tries:
            w = decay ** tries
            self.hits, self.tries = self.hits * w + hits, self.tries * w + tries

    def estimate(self, prior: float, weight: float = PRIOR) -> float:
        return (self.hits + weight * prior) / (self.tries + weight)

    def sample(self, prior: float, rng, weight: float = PRIOR) -> float:
        """A draw from the Beta posterior of the rate (``weight`` pseudo-observations of ``prior``): near
        ``estimate`` where many observations agree, spread where few were made."""
        hits = self.hits + weight * prior
        return rng.betavariate(max(hits, 1e-3), max(self.tries + weight - hits, 1e-3))


@dataclass
class Acceptance:
    """One request's (or, with ``GLOBAL_DECAY``, the drafter's) first-draft and later-draft acceptance."""

    first: Rate = field(default_factory=Rate)
    later: Rate = field(default_factory=Rate)
    seen: int = 0            # first drafts scored (verified or watched), not decayed: how young the estimate is

    def record(self, drafts: int, accepted: int, decay: float) -> None:
        """A verify step of ``drafts`` drafts accepted the first ``accepted``."""
        if drafts:
            self.seen += 1
            self.first.add(float(accepted > 0), 1.0, decay)
            self.later.add(max(accepted - 1, 0), max(min(drafts, accepted + 1) - 1, 0), decay)

    def record_watch(self, hit: bool, decay: float) -> None:
        """A first draft computed without drafting came true (or not)."""
        self.seen += 1
        self.first.add(float(hit), 1.0, decay)
