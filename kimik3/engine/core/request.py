"""A request as the engine sees it: its tokens and settings, plus one small record per other owner.

The scheduling idea (vLLM's): a request holds ``num_tokens`` tokens (prompt + generated) of which
``num_computed_tokens`` are in the cache. Each step hands it some of the difference; when the two
meet, the last row's logits give the next token. Prefill, chunked prefill, prefix hits, decode and
recompute after preemption are all this one rule.

Owners: ``Request`` itself (tokens, settings, status) is the scheduler's; ``Request.cache`` is the
cache manager's (``kv_cache.py``); ``Request.spec`` is the drafter's (``engine/spec/``); ``Request.out`` is
what the engine hands back (``output.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kimik3.engine.core.block_hash import extend_block_hashes
from kimik3.engine.core.block_pool import BlockTable
from kimik3.engine.images.multimodal import MultiModalInput
from kimik3.engine.sample.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class CacheHoldings:
    """What the cache manager gave the request; only ``KVCacheManager`` writes it."""

    block_ids: BlockTable = field(default_factory=BlockTable)   # MLA latent blocks, in position order
    state_slot: int = 0                 # live KDA state slot; 0 = none (slot 0 is the null slot)
    num_cached_blocks: int = 0          # leading blocks registered in the prefix cache
    rollback_slot: int | None = None    # speculative: snapshot of the last accepted draft's state, copied in next step


@dataclass
class OutputState:
    """Results and metrics on their way to the caller (``output.py``)."""

    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)  # one per prompt token
    stop_reason: int | str | None = None    # the stop token id or stop string that ended it
    detok: object | None = None             # detokenizer.OutputText, or None (token ids only)
    num_sent_tokens: int = 0                # tokens already returned as deltas
    scheduled_time: float | None = None     # first admitted to run (queue time ends)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_prefix_hit_tokens: int = 0


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    seed: int | None = None                   # seeded sampling (sampler.seeded_uniform); None = engine RNG
    eos_token_id: int | None = None
    block_size: int = 16
    extra_keys: list[bytes | None] | None = None   # per-block extra hash key (image content), or None
    mm: MultiModalInput | None = None               # the prompt's images (shared by n > 1 siblings)
    group_id: str = ""              # the user's request id (children of an n > 1 request share it)
    wait_for: Request | None = None  # sibling whose prompt this one reuses from the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)        # prompt + output
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)     # one per full block of token_ids (block_hash.py)
    bad_words: object | None = None  # logit controls: params.bad_words as token ids (logit_controls.BadWords)
    device_controls: object | None = None   # logit controls: ids and biases on the device (first use)
    matcher: object | None = None                   # logit controls: the structured-output grammar (structured.Matcher)
    spec: object | None = None      # the drafter's state for this request (engine/spec/; only the drafter writes it)
    paused: bool = False            # not scheduled until resumed (its reader is behind: LLMEngine.pause_request)
    # Image embeddings [N_i, D] by item, held (the runner's tensors) from the first chunk that needs an
    # item until its last pad is computed, so a request encodes or fetches each image once per prefill.
    image_embeds: dict[int, torch.Tensor] = field(default_factory=dict)
    cache: CacheHoldings = field(default_factory=CacheHoldings)
    out: OutputState = field(default_factory=OutputState)
    # ``params`` read once when the request is made (each step checks these over the whole batch)
    plain_greedy: bool = field(init=False)  # its token is the argmax of its row (``SamplingParams.plain_greedy``)
    has_controls: bool = field(init=False)  # logit controls or a constraint (``SamplingParams.has_controls``)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.plain_greedy, self.has_controls = self.params.plain_greedy, self.params.has_controls
        extend_block_hashes(self.block_hashes, self.token_ids, self.block_size, self.extra_keys)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def reaches_length(self, max_model_len: int, pending: int = 0) -> bool:
        """Whether the request is at its length limit (``max_tokens`` outputs or ``max_model_len`` tokens) once
        ``pending`` more tokens (sampled, not yet appended) are appended: the one "finished by length" rule."""
        return (self.num_output_tokens + pending >= self.params.max_tokens
                or self.num_tokens + pending >= max_model_len)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if len(self.token_ids) % self.block_size == 0:
            extend_block_hashes(self.block_hashes, self.token_ids, self.block_size, self.extra_keys)
