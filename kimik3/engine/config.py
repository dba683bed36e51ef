"""Engine settings: one dataclass, validated once; the engine derives everything else from it."""

from __future__ import annotations

from dataclasses import dataclass


def batch_size_table(value) -> tuple[tuple[int, int, int], ...]:
    """vLLM's ``num_speculative_tokens_per_batch_size``: [first batch size, last batch size, drafts] entries, sorted,
    not overlapping, the first starting at 1 (a batch size in a gap or past the last range takes the range before
    it; drafts above ``num_speculative_tokens`` are cut to it). vLLM's five-item entries (context-length ranges) are
    not implemented: an error names them."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"num_speculative_tokens_per_batch_size must be a non-empty list of [first batch size, "
                         f"last batch size, drafts] entries, got {value!r}")
    table = []
    for entry in value:
        if isinstance(entry, (list, tuple)) and len(entry) == 5:
            raise ValueError("num_speculative_tokens_per_batch_size: five-item entries (context-length ranges) are "
                             "not implemented in kimik3; give [first batch size, last batch size, drafts]")
        if (not isinstance(entry, (list, tuple)) or len(entry) != 3
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in entry)):
            raise ValueError(f"num_speculative_tokens_per_batch_size: each entry is [first batch size, last batch "
                             f"size, drafts] (integers), got {entry!r}")
        lo, hi, k = entry
        if lo < 1 or hi < lo or k < 0:
            raise ValueError(f"num_speculative_tokens_per_batch_size: {list(entry)} needs 1 <= first <= last and "
                             f"drafts >= 0")
        table.append((lo, hi, k))
    if table[0][0] != 1 or any(b[0] <= a[1] for a, b in zip(table, table[1:])):
        raise ValueError(f"num_speculative_tokens_per_batch_size: the ranges must be sorted, not overlap, and the "
                         f"first must start at batch size 1, got {[list(e) for e in table]}")
    return tuple(table)


@dataclass
class EngineConfig:
    max_num_seqs: int = 64                  # sequences in one step (= live KDA state slots)
    max_num_batched_tokens: int = 8192      # token budget of one step (long prompts are chunked; bounds a step's memory)
    long_prefill_token_threshold: int = 0   # a request's prefill tokens per step at most (0: the budget; vLLM's)
    max_model_len: int = 8192               # prompt + output tokens of one sequence
    enable_prefix_caching: bool = True
    block_size: int = 16                    # tokens per MLA latent-cache block (and prefix-cache hash unit)
    kda_checkpoint_interval: int | None = None  # blocks between KDA state checkpoints; None = auto (memory.py)
    cache_memory_bytes: int | None = None   # both cache pools; None = from gpu_memory_utilization / enough on CPU
    kv_cache_dtype: str = "auto"            # MLA latents: auto (model dtype) or fp8 / fp8_e4m3 (E4M3, per-token scales)
    gpu_memory_utilization: float = 0.9     # fraction of the GPU's memory the whole process may use (vLLM's meaning)
    max_logprobs: int = 20                  # most logprobs one request may ask for per token
    seed: int = 0                           # engine RNG (requests without their own seed)
    encoder_cache_tokens: int = 16384       # image embedding rows kept by content hash (one max-size K3 image)
    enforce_eager: bool = False             # True: no CUDA graphs (decode steps run eagerly too)
    num_speculative_tokens: int = 0         # draft tokens verified per step (0 = off; engine/spec/)
    speculative_method: str = "ngram"       # "ngram" or a draft model: "eagle3", "mtp", "dflash"/"dspark"
    speculative_model: str | None = None    # the draft model's directory ("default": the default model's)
    speculative_ngram_min: int = 2          # shortest suffix n-gram looked up for a draft
    speculative_ngram_max: int = 4          # longest suffix n-gram looked up for a draft
    # vLLM's dynamic speculative decoding table ((first batch, last batch, drafts), ...): a draft model drafts the
    # table's number for the step's batch size instead of the controller's plan (None: the controller; spec/)
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    grammar_compile_timeout: float = 5.0    # seconds a constraint may take to compile (worker process; structured.py)
    grammar_compile_memory: int = 2 << 30   # bytes its compiler process may grow by
    async_scheduling: bool = False          # schedule and launch decode step N + 1 before step N's tokens reach the host
    max_cudagraph_capture_size: int | None = None   # largest decode batch captured (None: max_num_seqs)
    pp_micro_batches: int | None = None     # pipeline parallelism: micro-batches per step (None: one per stage)

    @property
    def graph_max_seqs(self) -> int:
        """The largest batch the decode graphs hold (larger batches run eagerly)."""
        cap = self.max_cudagraph_capture_size
        return self.max_num_seqs if cap is None else min(cap, self.max_num_seqs)

    def __post_init__(self) -> None:
        self._check_counts()
        if self.kda_checkpoint_interval is not None and (
                not isinstance(self.kda_checkpoint_interval, int) or self.kda_checkpoint_interval < 1):
            raise ValueError(f"kda_checkpoint_interval must be a positive integer or None (auto), "
                             f"got {self.kda_checkpoint_interval!r}")
        self._check_speculation()
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization!r}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        from kimik3.model.batch import KV_CACHE_DTYPES
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        self._check_budgets()

    def _check_budgets(self) -> None:
        """The grammar compiler's budgets, the pipeline's micro-batches and the cache's bytes."""
        if not (isinstance(self.grammar_compile_timeout, (int, float)) and self.grammar_compile_timeout > 0):
            raise ValueError(f"grammar_compile_timeout must be > 0 seconds, got {self.grammar_compile_timeout!r}")
        if not isinstance(self.grammar_compile_memory, int) or self.grammar_compile_memory < 1:
            raise ValueError(f"grammar_compile_memory must be a positive number of bytes, "
                             f"got {self.grammar_compile_memory!r}")
        if self.pp_micro_batches is not None and (not isinstance(self.pp_micro_batches, int)
                                                  or isinstance(self.pp_micro_batches, bool) or self.pp_micro_batches < 1):
            raise ValueError(f"pp_micro_batches must be a positive integer or None (one per stage), "
                             f"got {self.pp_micro_batches!r}")
        if self.cache_memory_bytes is not None and self.cache_memory_bytes <= 0:
            raise ValueError(f"cache_memory_bytes must be positive or None (auto), got {self.cache_memory_bytes!r}")

    def _check_counts(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("encoder_cache_tokens", "long_prefill_token_threshold"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")

    def _check_speculation(self) -> None:
        """The speculative-decoding settings (draft count, method, draft model, n-gram sizes)."""
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be a non-negative integer, got {self.num_speculative_tokens!r}")
        methods = ("ngram", "eagle3", "mtp", "dflash", "dspark")
        if self.speculative_method not in methods:
            raise ValueError(f"speculative method {self.speculative_method!r} is not one of {methods}")
        if self.speculative_method in ("eagle3", "dflash", "dspark") and not self.speculative_model:
            raise ValueError(f"speculative method {self.speculative_method!r} needs the draft's directory "
                             "('model' in the speculative config)")
        if not (isinstance(self.speculative_ngram_min, int) and isinstance(self.speculative_ngram_max, int)
                and 1 <= self.speculative_ngram_min <= self.speculative_ngram_max):
            raise ValueError(f"speculative n-gram sizes need 1 <= speculative_ngram_min <= speculative_ngram_max, "
                             f"got {self.speculative_ngram_min!r} and {self.speculative_ngram_max!r}")
        if self.num_speculative_tokens_per_batch_size is not None:
            if self.speculative_method == "ngram":
                raise ValueError("num_speculative_tokens_per_batch_size is implemented for draft models (eagle3, mtp, "
                                 "dflash, dspark), not for 'ngram'")
            self.num_speculative_tokens_per_batch_size = batch_size_table(self.num_speculative_tokens_per_batch_size)

    @property
    def uses_draft_model(self) -> bool:
        """Drafts come from a draft model (``draft_model.py``), not n-gram lookups."""
        return self.speculative_method != "ngram" and self.num_speculative_tokens > 0
