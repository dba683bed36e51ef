"""Per-request sampling settings, validated once when the request is made."""

from __future__ import annotations

from dataclasses import dataclass, field

SEED_LIMIT = 1 << 64        # seeds lie in [0, 2^64) (as vLLM's); sample i of a request uses seed + i


def check_seed(seed, n: int) -> None:
    """ValueError unless every sample's seed ``seed + i`` (i < n) lies in [0, 2^64)."""
    if seed is None:
        return
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"SamplingParams: seed must be an integer or None, got {seed!r}; pass an int")
    if not 0 <= seed <= SEED_LIMIT - n:
        raise ValueError(f"SamplingParams: seed must lie in [0, 2^64 - n] = [0, {SEED_LIMIT - n}] with n={n} "
                         f"(sample i uses seed + i), got {seed}; pick a smaller seed")


LOGIT_BIAS_LIMIT = 100.0


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's ``StructuredOutputsParams``): exactly one of
    ``json`` (a JSON schema, dict or text), ``json_object`` (any JSON object), ``regex``, ``choice``
    (one of these strings) or ``grammar`` (a Lark grammar in llguidance's dialect, GBNF, or
    llguidance's JSON grammar list ``{"grammars": [...]}``).
    Decoding is masked token by token with llguidance (``kimik3.engine.sample.structured``)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(f"SamplingParams: structured_outputs takes exactly one of json, json_object, regex, "
                             f"choice, grammar; got {given or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"SamplingParams: structured_outputs.choice must be a non-empty list of strings, "
                             f"got {self.choice!r}")
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"SamplingParams: structured_outputs.{k} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"SamplingParams: structured_outputs.json must be a JSON schema (dict or text), "
                             f"got {type(self.json).__name__}")


@dataclass
class SamplingParams:
    """How to pick each generated token and when to stop (vLLM's names and meanings).

    Processing order per step: logit controls (``logit_bias``, ``allowed_token_ids``, ``bad_words``,
    ``min_tokens``, the ``structured_outputs`` mask) -> penalties -> temperature -> min_p -> top_k ->
    top_p -> sample. ``logprobs`` are taken from the raw model distribution (before any of the above).
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
    logit_bias: dict[int, float] | None = None     # added to the token's logit, each in [-100, 100]
    allowed_token_ids: list[int] | None = None     # only these tokens may be generated
    bad_words: list[str] | None = None             # never generate these words (last token banned after the rest)
    bad_token_sequences: list[list[int]] | None = None   # the same, as token ids (the server's tool-section guard)
    min_tokens: int = 0                 # stop tokens, EOS and stop strings are off until this many tokens
    include_stop_str_in_output: bool = False      # keep the stop string that ended the text
    prompt_logprobs: int | None = None  # top-n logprobs of every prompt token after the first (no prefix-cache hit)
    structured_outputs: StructuredOutputsParams | None = None
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
        self._check_controls(need)

    def _check_controls(self, need) -> None:
        self._check_token_controls(need)
        need(isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool)
             and 0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
             "lower min_tokens or raise max_tokens")
        need(isinstance(self.include_stop_str_in_output, bool),
             f"include_stop_str_in_output must be a bool, got {self.include_stop_str_in_output!r}", "pass true/false")
        need(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                              and not isinstance(self.prompt_logprobs, bool)
                                              and self.prompt_logprobs >= 0),
             f"prompt_logprobs must be None or an integer >= 0, got {self.prompt_logprobs!r}",
             "pass the number of top tokens wanted")
        if self.structured_outputs is not None:
            need(isinstance(self.structured_outputs, StructuredOutputsParams),
                 f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}",
                 "wrap the constraint in StructuredOutputsParams(...)")
            need(not self.ignore_eos, "ignore_eos cannot be combined with structured_outputs",
                 "the constraint ends the text when its grammar is complete; drop ignore_eos")
            need(self.min_tokens == 0, "min_tokens cannot be combined with structured_outputs",
                 "the grammar decides where the text ends; drop min_tokens")

    def _check_token_controls(self, need) -> None:
        """The controls that name tokens: logit_bias, allowed_token_ids, bad_words, bad_token_sequences."""
        def token_ids(v) -> bool:
            return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v)

        if self.logit_bias is not None:
            need(isinstance(self.logit_bias, dict) and token_ids(self.logit_bias),
                 f"logit_bias must map token ids to numbers, got {self.logit_bias!r}", "use {token_id: bias}")
            bad = {t: b for t, b in self.logit_bias.items() if not isinstance(b, (int, float)) or isinstance(b, bool)
                   or not -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT}
            need(not bad, f"logit_bias values must be numbers in [-100, 100], got {bad}", "clip the biases")
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            need(isinstance(self.allowed_token_ids, (list, tuple)) and len(self.allowed_token_ids) > 0
                 and token_ids(self.allowed_token_ids),
                 f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids!r}",
                 "pass at least one token id")
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))     # once each: the cost per step
        if self.bad_words is not None:
            need(isinstance(self.bad_words, (list, tuple)) and all(isinstance(w, str) and w.strip()
                                                                   for w in self.bad_words),
                 f"bad_words must be a list of non-blank strings, got {self.bad_words!r}", "drop blank words")
            self.bad_words = list(self.bad_words)
        if self.bad_token_sequences is not None:
            need(isinstance(self.bad_token_sequences, (list, tuple)) and all(
                     isinstance(w, (list, tuple)) and len(w) > 0 and token_ids(w) for w in self.bad_token_sequences),
                 f"bad_token_sequences must be a list of non-empty token id lists, got {self.bad_token_sequences!r}",
                 "drop empty sequences")
            self.bad_token_sequences = [list(w) for w in self.bad_token_sequences]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_controls(self) -> bool:
        """Logit controls or a constraint: the row needs its own processing before sampling."""
        return (self.logit_bias is not None or self.allowed_token_ids is not None or self.bad_words is not None
                or self.bad_token_sequences is not None
                or self.min_tokens > 0 or self.structured_outputs is not None)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing else to compute: the token is the argmax of its row."""
        return self.greedy and not self.has_penalties and self.logprobs is None

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
