"""LLMEngine: the streaming core. add_request / abort_request / step, one forward per step.

One loop: ``Scheduler.schedule`` -> ``ModelRunner.execute`` -> ``Scheduler.update`` -> append tokens,
check stops, emit deltas. Not thread-safe: a server drives it from one loop and forwards aborts there.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from kimik3.engine.config import EngineConfig, default_cache_bytes
from kimik3.engine.detokenizer import OutputText
from kimik3.engine.kv_cache import KVCacheManager
from kimik3.engine.memory import MemoryPlan, default_checkpoint_interval, max_blocks_per_seq, plan_memory
from kimik3.engine.multimodal import build_multi_modal_input, check_vision_inputs
from kimik3.engine.request import CompletionOutput, Request, RequestOutput
from kimik3.engine.runner import ModelRunner
from kimik3.engine.sampling_params import SamplingParams, check_seed
from kimik3.engine.scheduler import Scheduler
from kimik3.model.batch import HybridCache
from kimik3.vision.preprocess import VisionInputs

logger = logging.getLogger(__name__)

_NO_TOKENIZER = object()
_PROMPT_KEYS = {"prompt_token_ids", "prompt", "multi_modal_data"}


class StepError(RuntimeError):
    """A step's forward raised. ``request_ids``: the requests (their user ids) in that step's batch,
    the only ones whose data can have caused it; the engine itself is consistent afterwards."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"engine step over request(s) {request_ids} failed: {type(cause).__name__}: {cause}")
        self.request_ids = request_ids


@dataclass
class _Group:
    """The n samples of one user request."""

    request_id: str
    prompt: str | None
    children: list[Request]
    sent_final: set[int] = field(default_factory=set)
    sent_prompt_logprobs: bool = False


class LLMEngine:
    def __init__(self, model, config: EngineConfig | None = None, tokenizer=None,
                 tokenizer_path: str | None = None, runner_factory=None):
        """``runner_factory``: builds the runner like ``ModelRunner`` (tensor parallelism passes
        ``kimik3.engine.parallel_runner.ParallelRunner``)."""
        self.model = model
        self.config = config = config or EngineConfig()
        text = model.config.text
        self.vocab_size = text.vocab_size
        self.eos_token_id = text.eos_token_id
        self.device = torch.device(model.device)
        dtype = model.dtype
        # sizes of this rank's cache (under tensor parallelism a KDA state holds only the local heads)
        cache_text = getattr(model, "cache_text_config", text)
        interval = None
        if config.enable_prefix_caching:
            interval = config.kda_checkpoint_interval or default_checkpoint_interval(cache_text, config.block_size, dtype)
        budget = config.cache_memory_bytes
        if budget is None:   # enough for max_num_seqs full-length sequences and their checkpoints
            per_seq = max_blocks_per_seq(config.max_model_len, config.block_size)
            slot = HybridCache.bytes_per_slot(cache_text, dtype)
            block = HybridCache.bytes_per_block(cache_text, config.block_size, dtype)
            n = config.max_num_seqs
            wanted = ((1 + n + n * config.num_speculative_tokens) * slot + (1 + n * per_seq) * block
                      + (n * per_seq // interval if interval else 0) * slot)
            budget = default_cache_bytes(self.device, wanted, config.gpu_memory_utilization)
        self.plan: MemoryPlan = plan_memory(cache_text, budget, config.block_size, config.max_num_seqs, interval, dtype,
                                            num_spec_slots=config.max_num_seqs * config.num_speculative_tokens)
        need = max_blocks_per_seq(config.max_model_len, config.block_size)
        if need > self.plan.num_usable_blocks:
            raise ValueError(
                f"max_model_len={config.max_model_len} needs {need} cache blocks of {config.block_size} tokens, but "
                f"cache_memory_bytes={budget} holds {self.plan.num_usable_blocks} ({self.plan.describe()}); "
                f"raise cache_memory_bytes or lower max_model_len to {self.plan.max_cached_tokens}")
        logger.info("%s; %d sequences of max_model_len=%d tokens fit at once", self.plan.describe(),
                    self.plan.sequences_of(config.max_model_len), config.max_model_len)
        if hasattr(model, "allocate_cache"):
            self.cache = model.allocate_cache(self.plan.num_slots, self.plan.num_blocks, config.block_size)
        else:
            self.cache = HybridCache.allocate(cache_text, self.plan.num_slots, self.plan.num_blocks, config.block_size,
                                              dtype, self.device)
        self.kv = KVCacheManager(self.plan, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.num_speculative_tokens, config.speculative_ngram_min,
                                   config.speculative_ngram_max, config.max_model_len)
        self.num_draft_tokens = 0         # speculative decoding: drafts verified / accepted so far
        self.num_accepted_tokens = 0
        self.runner = (runner_factory or ModelRunner)(model, self.cache, config.seed, config.encoder_cache_tokens,
                                                      config.max_num_seqs, config.max_model_len, config.enforce_eager)
        self._tokenizer = tokenizer
        self._tokenizer_path = tokenizer_path
        self._grammar = None    # structured.GrammarCompiler, built on the first constrained request
        self.groups: dict[str, _Group] = {}
        self._aborted: list[_Group] = []

    # ---- tokenizer (loaded on first use) -------------------------------------------------
    def get_tokenizer(self, required: bool = False):
        if self._tokenizer is None:
            try:
                from kimik3.tokenizer import load_tokenizer
                self._tokenizer = load_tokenizer(self._tokenizer_path)
            except Exception as e:  # no tokenizer files (tiny test checkpoints) or module not there yet
                logger.info("no tokenizer at %s (%s): outputs carry token ids only", self._tokenizer_path, e)
                self._tokenizer = _NO_TOKENIZER
                self._tokenizer_error = e
        if self._tokenizer is _NO_TOKENIZER:
            if required:
                raise ValueError(f"this needs a tokenizer, but none could be loaded from {self._tokenizer_path} "
                                 f"({self._tokenizer_error}); pass {{'prompt_token_ids': [...]}} prompts and "
                                 f"stop_token_ids instead of text")
            return None
        return self._tokenizer

    def grammar_compiler(self):
        """The llguidance compiler over this engine's tokenizer (built on first use; needs a tokenizer)."""
        if self._grammar is None:
            from kimik3.engine.structured import GrammarCompiler
            tok = self.get_tokenizer(required=True)
            ends = [self.eos_token_id, *getattr(tok, "stop_token_ids", [])]
            self._grammar = GrammarCompiler(tok, self.vocab_size, [t for t in ends if t is not None])
        return self._grammar

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, *, multi_modal_data: VisionInputs | None = None) -> None:
        """Queue a request; raises ValueError (and changes nothing) if it can never run.

        ``prompt`` is a string or ``{"prompt_token_ids": [...], "multi_modal_data": VisionInputs, "prompt":
        text}`` (only the ids required). Images hold one ``<|media_pad|>`` per embedding row in the ids, as
        ``apply_chat_template(..., images=[ImagePrompt(W, H, N), ...])`` renders them; they may also come
        as the ``multi_modal_data`` argument (the server passes them so).

        Atomic: every sample of the request is built (and checked) first; only then are they all
        queued and the group registered, so a failure leaves no trace of the request.
        """
        params = params or SamplingParams()
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use; pick a unique id")
        text, ids, vision, pads = self._check(prompt, params, multi_modal_data)
        mm = build_multi_modal_input(vision, pads) if vision is not None else None
        extra_keys = mm.block_extra_keys(len(ids), self.config.block_size) if mm is not None else None
        arrival = time.monotonic() if arrival_time is None else arrival_time
        tok = self.get_tokenizer() if params.detokenize else None
        bad_words = self._bad_word_ids(params)
        so = params.structured_outputs
        matchers = [self.grammar_compiler().matcher(so) for _ in range(params.n)] if so is not None else None
        children = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(params.seed + i)
            req = Request(request_id if params.n == 1 else f"{request_id}#{i}", ids, params, arrival, gen,
                          self.eos_token_id, self.config.block_size, extra_keys=extra_keys, mm=mm,
                          group_id=request_id)
            if i and self.kv.enable_prefix_caching and len(ids) > self.config.block_size:
                req.wait_for = children[0]
            if tok is not None:
                req.detok = OutputText(tok, params.stop_strings, params.skip_special_tokens,
                                       params.include_stop_str_in_output)
            req.bad_word_ids = bad_words
            req.matcher = matchers[i] if matchers else None
            children.append(req)
        self.groups[request_id] = _Group(request_id, text, children)   # nothing below can fail
        for req in children:
            self.scheduler.add(req)

    def check_request(self, prompt, params: SamplingParams, multi_modal_data: VisionInputs | None = None
                      ) -> tuple[str | None, list[int]]:
        """Validate a request without queueing it: (prompt text, prompt token ids), or ValueError."""
        text, ids, _, _ = self._check(prompt, params, multi_modal_data)
        return text, ids

    def _check(self, prompt, params: SamplingParams, multi_modal_data):
        """(text, ids, images or None, the images' pad positions or None), or ValueError."""
        text, ids, vision = self._prompt_ids(prompt)
        if multi_modal_data is not None:
            if vision is not None:
                raise ValueError("images given twice (in the prompt's multi_modal_data and as multi_modal_data=); "
                                 "give them once")
            vision = multi_modal_data
        self._validate(ids, params)
        return text, ids, vision, self._check_images(ids, vision)

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int], VisionInputs | None]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty; give at least one token")
            return prompt, list(self.get_tokenizer(required=True).encode(prompt)), None
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            unknown = sorted(set(prompt) - _PROMPT_KEYS, key=str)
            if unknown:
                raise ValueError(f"unknown prompt key(s) {unknown}; a prompt dict takes {sorted(_PROMPT_KEYS)}")
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                              for t in ids):
                raise ValueError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}")
            return prompt.get("prompt"), list(ids), prompt.get("multi_modal_data")
        raise ValueError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        check_seed(params.seed, params.n)     # again: the fields may have changed since construction
        if not ids:
            raise ValueError("prompt is empty (0 tokens); give at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} lie outside the vocabulary [0, {self.vocab_size})")
        if len(ids) > self.config.max_model_len:
            pad = getattr(self.model.config, "media_placeholder_token_id", None)
            n_img = sum(1 for t in ids if t == pad) if pad is not None else 0
            what = f" ({n_img} of them image tokens)" if n_img else ""
            fix = "use fewer or smaller images, shorten the text" if n_img else "shorten it"
            raise ValueError(f"prompt has {len(ids)} tokens{what}, more than max_model_len="
                             f"{self.config.max_model_len}; {fix} or raise max_model_len")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} is more than max_logprobs={self.config.max_logprobs}; "
                             f"ask for fewer or raise max_logprobs")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} lie outside the vocabulary [0, {self.vocab_size}); "
                             f"remove them")
        if params.stop_strings:
            if not params.detokenize:
                raise ValueError(f"stop strings {params.stop_strings} need detokenize=True")
            self.get_tokenizer(required=True)
        for what, ids_ in (("logit_bias", list(params.logit_bias or ())), ("allowed_token_ids",
                                                                          params.allowed_token_ids or [])):
            bad = [t for t in ids_ if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{what}: token ids {bad[:5]} lie outside the vocabulary [0, {self.vocab_size}); "
                                 f"remove them")
        if params.bad_words:
            self.get_tokenizer(required=True)
        if params.structured_outputs is not None:
            self.grammar_compiler().check(params.structured_outputs)

    def _bad_word_ids(self, params: SamplingParams) -> list[list[int]]:
        """Token sequences of each bad word, as written and after a space (vLLM's rule), deduplicated."""
        if not params.bad_words:
            return []
        tok = self.get_tokenizer(required=True)
        seqs: list[list[int]] = []
        for w in params.bad_words:
            for text in (w, " " + w.lstrip()):
                ids = list(tok.encode(text))
                if ids and ids not in seqs:
                    seqs.append(ids)
        return seqs

    def _check_images(self, ids: list[int], vision) -> list[int] | None:
        """Pad positions of a prompt's images (checked against the model), or None without images."""
        if vision is None:
            return None
        cfg = self.model.config
        vc = getattr(cfg, "vision", None)
        pad = getattr(cfg, "media_placeholder_token_id", None)
        if vc is None or pad is None:
            raise ValueError("this model has no vision tower (its config.json has no vision_config), so it "
                             "cannot take images; send text only")
        return check_vision_inputs(vision, ids, pad, vc.patch_size, vc.merge_kernel_size[0])

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its memory; its final delta (finish_reason "abort") comes from step()."""
        group = self.groups.get(request_id)
        if group is None:
            return
        for req in group.children:
            if not req.is_finished:
                self.scheduler.finish(req, "abort")
        self._aborted.append(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward step; returns a delta for every request that produced tokens or finished."""
        touched: dict[str, _Group] = {g.request_id: g for g in self._aborted}
        self._aborted = []
        out = self.scheduler.schedule()
        if out.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError(f"scheduler found nothing to run with {len(self.scheduler.waiting)} waiting "
                                   f"requests; the cache plan cannot hold one chunk ({self.plan.describe()})")
            return self._deltas(touched)
        try:
            result = self.runner.execute(out)
        except BaseException as e:
            self.kv.return_checkpoint_slots(ck.slot for ck, h in zip(out.checkpoints, out.checkpoint_hashes)
                                            if h is not None)
            self.kv.return_spec_slots(slot for c in out.chunks for slot in c.spec_slots)
            if isinstance(e, Exception):
                raise StepError(list(dict.fromkeys(c.req.group_id for c in out.chunks)), e) from e
            raise
        sampling = [c for c in out.chunks if c.samples]
        accepted = result.accepted or [[] for _ in sampling]
        for c, drafts in zip(sampling, accepted):
            if c.draft:
                self._settle_drafts(c, len(drafts))
        self.scheduler.update(out)
        now = time.monotonic()
        draft_lps = result.accepted_logprobs or [[None] * len(d) for d in accepted]
        for c, token, lp, drafts, lps in zip(sampling, result.token_ids, result.logprobs, accepted, draft_lps):
            req = c.req
            if req.first_token_time is None:
                req.first_token_time = now
            for t, t_lp in zip((*drafts, token), (*lps, lp)):
                req.append_token(t)
                if req.params.logprobs is not None:
                    req.logprobs.append(t_lp)
                reason = self._check_stop(req, t)
                if req.matcher is not None:
                    req.matcher.consume(t)
                    if reason is None and req.matcher.stopped:   # the grammar is complete
                        req.stop_reason, reason = t, "stop"
                if reason is not None:
                    if req.detok is not None and not isinstance(req.stop_reason, str):
                        req.detok.finish()
                    self.scheduler.finish(req, reason)
                    req.finish_time = now
                    break
            group = self.groups.get(req.group_id)
            if group is None:    # cannot happen (add_request is atomic); never let it fail a step
                logger.error("request %s has no group; finishing it", req.request_id)
                if not req.is_finished:
                    self.scheduler.finish(req, "abort")
                continue
            touched[req.group_id] = group
        return self._deltas(touched)

    def _settle_drafts(self, c, m: int) -> None:
        """A speculative chunk accepted ``m`` of its drafts: keep the snapshot after row m + 1 for
        the request's next step (unless every draft was accepted: then the live state is right)."""
        req = c.req
        c.num_accepted = m
        self.num_draft_tokens += len(c.draft)
        self.num_accepted_tokens += m
        if m < len(c.draft):
            req.pending_state_copy = (c.spec_slots[m], req.state_slot)
            self.kv.return_spec_slots(c.spec_slots[:m] + c.spec_slots[m + 1:])
        else:
            self.kv.return_spec_slots(c.spec_slots)

    def _check_stop(self, req: Request, token: int) -> str | None:
        p = req.params
        if token in p.stop_token_ids:
            req.stop_reason = token
            return "stop"
        if token == req.eos_token_id and not p.ignore_eos:
            req.stop_reason = token
            return "stop"
        if req.detok is not None:
            hit = req.detok.add(token, check_stop=req.num_output_tokens >= p.min_tokens)
            if hit is not None:
                req.stop_reason = hit
                return "stop"
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _deltas(self, groups: dict[str, _Group]) -> list[RequestOutput]:
        outs = []
        for g in groups.values():
            completions = []
            for i, req in enumerate(g.children):
                if i in g.sent_final:
                    continue
                n_out = req.num_output_tokens
                done = req.is_finished
                if n_out == req.num_sent_tokens and not done:
                    continue
                text = req.detok.visible(done) if req.detok is not None else ""
                completions.append(CompletionOutput(
                    index=i, text=text[req.num_sent_chars:],
                    token_ids=req.token_ids[req.num_prompt_tokens + req.num_sent_tokens:],
                    logprobs=req.logprobs[req.num_sent_tokens:] if req.params.logprobs is not None else None,
                    finish_reason=req.finish_reason, stop_reason=req.stop_reason))
                req.num_sent_tokens, req.num_sent_chars = n_out, len(text)
                if done:
                    g.sent_final.add(i)
            finished = len(g.sent_final) == len(g.children)
            if completions or finished:
                first = g.children[0]
                prompt_lps = None
                if (first.params.prompt_logprobs is not None and not g.sent_prompt_logprobs
                        and len(first.prompt_logprobs) == first.num_prompt_tokens):
                    prompt_lps, g.sent_prompt_logprobs = list(first.prompt_logprobs), True
                outs.append(RequestOutput(g.request_id, g.prompt, first.prompt_token_ids, completions,
                                          finished, self._metrics(g) if finished else {}, prompt_lps))
            if finished:
                self.groups.pop(g.request_id, None)
        return outs

    def _metrics(self, g: _Group) -> dict[str, float]:
        first = [r.first_token_time for r in g.children if r.first_token_time is not None]
        arrival = g.children[0].arrival
        end = max(r.finish_time or time.monotonic() for r in g.children)
        n_out = sum(r.num_output_tokens for r in g.children)
        m = {"arrival_time": arrival, "e2e_s": end - arrival, "num_output_tokens": float(n_out),
             "num_preemptions": float(sum(r.num_preemptions for r in g.children)),
             "num_prefix_hit_tokens": float(sum(r.num_prefix_hit_tokens for r in g.children))}
        m["max_output_tokens"] = float(max(r.num_output_tokens for r in g.children))
        scheduled = [r.scheduled_time for r in g.children if r.scheduled_time is not None]
        if scheduled:
            m["queue_s"] = min(scheduled) - arrival          # waiting for a slot and cache
            m["inference_s"] = end - min(scheduled)          # running (prefill + decode)
        if first:
            m["ttft_s"] = min(first) - arrival
            if scheduled:
                m["prefill_s"] = min(first) - min(scheduled)
                m["decode_s"] = end - min(first)
            if n_out > len(g.children):
                m["tpot_s"] = (end - min(first)) / max(n_out / len(g.children) - 1, 1)
        return m
