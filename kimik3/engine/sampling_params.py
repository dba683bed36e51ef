"""Per-request sampling settings, validated once when the request is made."""

from __future__ import annotations

from dataclasses import dataclass, field

SEED_LIMIT = 1 << 64        # torch generators take seeds in [0, 2^64); sample i of a request uses seed + i


def check_seed(seed, n: int) -> None:
    """ValueError unless every sample's seed ``seed + i`` (i < n) lies in [0, 2^64)."""
    if seed is None:
        return
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"SamplingParams: seed must be an integer or None, got {seed!r}; pass an int")
    if not 0 <= seed <= SEED_LIMIT - n:
        raise ValueError(f"SamplingParams: seed must lie in [0, 2^64 - n] = [0, {SEED_LIMIT - n}] with n={n} "
                         f"(sample i uses seed + i), got {seed}; pick a smaller seed")


@dataclass
class SamplingParams:
    """How to pick each generated token and when to stop (vLLM's names and meanings).

    Processing order per step: penalties -> temperature -> min_p -> top_k -> top_p -> sample.
    ``logprobs`` are taken from the raw model distribution (before any of the above).
    """

    n: int = 1                          # independent samples per prompt (share the prompt via prefix caching)
    max_tokens: int = 16
    temperature: float = 1.0            # 0 = greedy
    top_p: float = 1.0                  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = -1                     # keep the k most likely tokens; -1 (or 0) = all
    min_p: float = 0.0                  # drop tokens below min_p * (probability of the most likely token)
    seed: int | None = None             # per-request generator: same seed -> same tokens, whatever the batch
    presence_penalty: float = 0.0       # subtract once per token id present in the output (OpenAI)
    frequency_penalty: float = 0.0      # subtract per occurrence in the output (OpenAI)
    repetition_penalty: float = 1.0     # divide positive / multiply negative logits of prompt+output ids (HF)
    stop: list[str] | str | None = None           # stop strings (not included in the text)
    stop_token_ids: list[int] | None = None       # stop tokens (kept in token_ids)
    ignore_eos: bool = False
    logprobs: int | None = None         # top-n logprobs per generated token (the sampled one always included)
    detokenize: bool = True
    skip_special_tokens: bool = True
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def need(ok: bool, what: str, fix: str) -> None:
            if not ok:
                raise ValueError(f"SamplingParams: {what}; {fix}")

        need(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}", "ask for at least one sample")
        need(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "ask for at least one token")
        need(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}", "use 0 for greedy decoding")
        need(0.0 < self.top_p <= 1.0, f"top_p must lie in (0, 1], got {self.top_p}", "use 1.0 to disable it")
        need(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 0),
             f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}", "use -1 to disable it")
        need(0.0 <= self.min_p <= 1.0, f"min_p must lie in [0, 1], got {self.min_p}", "use 0 to disable it")
        need(-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must lie in [-2, 2], got {self.presence_penalty}",
             "use 0 to disable it")
        need(-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must lie in [-2, 2], got {self.frequency_penalty}",
             "use 0 to disable it")
        need(self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}",
             "use 1.0 to disable it")
        check_seed(self.seed, self.n)
        need(self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
             f"logprobs must be None or an integer >= 0, got {self.logprobs!r}", "pass the number of top tokens wanted")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        need(all(isinstance(s, str) and s for s in stops), f"stop must hold non-empty strings, got {self.stop!r}",
             "drop empty stop strings")
        self.stop_strings = tuple(stops)
        ids = list(self.stop_token_ids or [])
        need(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids),
             f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}", "pass token ids")
        self.stop_token_ids = ids
        if self.top_k == 0:
            self.top_k = -1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
