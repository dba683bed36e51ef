"""LLMEngine: the streaming core. add_request / abort_request / step, one forward per step.

One loop (nano-vllm's): ``Scheduler.schedule`` decides -> ``ModelRunner.execute`` builds the batch, runs the
model and samples -> ``Scheduler.update`` advances the requests -> the engine appends the tokens, checks
stops and emits deltas (``output.py``). With ``async_scheduling`` a decode step's tokens stay on the device
while the next step is scheduled and launched (``step``). Requests come in through ``InputProcessor``;
``stats()`` is the engine's one read-out. Not thread-safe: a server drives it from one loop and forwards
aborts there.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from kimik3.engine.config import EngineConfig
from kimik3.engine.core.cache_budget import plan_cache
from kimik3.engine.core.input_processor import InputProcessor
from kimik3.engine.core.kv_cache import KVCacheManager
from kimik3.engine.core.output import EngineStats, RequestGroup, RequestOutput, append_output, deltas
from kimik3.engine.core.request import RequestStatus
from kimik3.engine.core.scheduler import Scheduler
from kimik3.engine.core.scheduler_output import ScheduledChunk
from kimik3.engine.run.runner import ModelRunner
from kimik3.engine.sample.sampler import PendingOutput, SamplerOutput
from kimik3.engine.sample.sampling_params import SamplingParams
from kimik3.engine.spec.speculative import row_spans, settle_drafts
from kimik3.engine.transfer import on_device
from kimik3.model.batch import latent_cache_dtype
from kimik3.vision.preprocess import VisionInputs

logger = logging.getLogger(__name__)


class StepError(RuntimeError):
    """A step's forward raised. ``request_ids``: the requests (their user ids) in that step's batch,
    the only ones whose data can have caused it; the engine itself is consistent afterwards."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"engine step over request(s) {request_ids} failed: {type(cause).__name__}: {cause}")
        self.request_ids = request_ids


class LLMEngine:
    def __init__(self, model, config: EngineConfig | None = None, tokenizer=None,
                 tokenizer_path: str | None = None, runner_factory=None, draft=None):
        """``model``: ``forward_step``, ``compute_logits``, ``allocate_cache`` and ``cache_text_config`` (this
        rank's cache sizes) as ``KimiForCausalLM`` has them. ``runner_factory``: builds the runner like
        ``ModelRunner(model, cache, config)`` (tensor parallelism passes ``parallel_runner.ParallelRunner``).
        ``draft``: the draft model (``model/eagle3.py``, ``mtp.py``, ``dflash.py``) of a draft-model
        ``speculative_method``; None loads it from ``speculative_model`` (MTP: the target's own directory,
        ``tokenizer_path``, when None)."""
        self.model = model
        self.config = config = config or EngineConfig()
        self.vocab_size = model.config.text.vocab_size
        self.device = torch.device(model.device)
        if config.uses_draft_model and draft is None:       # loaded first: a GPU budget counts its weights
            from kimik3.engine.spec.draft_model import load_draft
            draft = load_draft(config.speculative_method, config.speculative_model or tokenizer_path, model)
        self.plan = plan_cache(config, model.cache_text_config, model.dtype, self.device)
        drafter = None
        if config.uses_draft_model:
            from kimik3.engine.spec.draft_model import ModelDrafter
            per_block = ModelDrafter.bytes_per_block(draft, config.block_size)
            if per_block and (config.cache_memory_bytes is not None or self.device.type == "cuda"):
                self.plan = self._plan_beside_draft(config, model, per_block)
            drafter = ModelDrafter(draft, config.num_speculative_tokens, self.plan.num_blocks, config.block_size,
                                   config.max_num_seqs)
        elif draft is not None:
            raise ValueError("a draft model was given but speculative_method is 'ngram' (or no speculative tokens)")
        self.drafter = drafter
        self.cache = model.allocate_cache(self.plan.num_slots, self.plan.num_blocks, config.block_size,
                                          latent_cache_dtype(config.kv_cache_dtype, model.dtype))
        self.kv = KVCacheManager(self.plan, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config)
        if drafter is not None:
            if runner_factory is not None:
                raise ValueError("speculative draft models run in one process for now; use tensor_parallel_size 1 "
                                 "or n-gram speculation")
            # eager steps keep the states the draft reads (CUDA graphs of draft/verify steps: not yet)
            self.runner = ModelRunner(model, self.cache, dataclasses.replace(config, enforce_eager=True))
            self.runner.aux_layers = drafter.aux_layers
        else:
            self.runner = (runner_factory or ModelRunner)(model, self.cache, config)
        self.inputs = InputProcessor(model.config, config, self.device, tokenizer, tokenizer_path)
        self.groups: dict[str, RequestGroup] = {}
        self._aborted: list[RequestGroup] = []
        self.num_draft_tokens = self.num_accepted_tokens = 0     # speculative decoding: drafts verified / accepted
        self.num_drafts = 0                                       # verify chunks (vLLM's spec_decode_num_drafts)
        self.accepted_per_position: list[int] = []                # drafts accepted at draft position j
        self._in_flight = None        # async scheduling: (step on the device, its PendingOutput)
        self._error: StepError | None = None      # a step scheduled ahead failed: raised by the next step()

    def _plan_beside_draft(self, config: EngineConfig, model, per_block: int):
        """The target's plan within the budget less the draft's cache (``per_block`` bytes per block), found by
        shrinking the target's budget by what the last try overshot (KDA checkpoints scale with the blocks too)."""
        budget, plan = self.plan.budget_bytes, self.plan
        share = budget
        for _ in range(16):
            over = plan.total_bytes + plan.num_blocks * per_block - budget
            if over <= 0:
                return plan
            share -= -(-over // (plan.bytes_per_block + per_block)) * plan.bytes_per_block   # a block less saves both
            plan = plan_cache(dataclasses.replace(config, cache_memory_bytes=max(share, 1)), model.cache_text_config,
                              model.dtype, self.device)
        raise ValueError(f"cannot fit the draft's cache ({per_block} B per block) beside the target's in "
                         f"{budget} B; raise cache_memory_bytes / gpu_memory_utilization")

    def get_tokenizer(self, required: bool = False):
        """The checkpoint's tokenizer (loaded on first use); None, or ValueError if ``required``, without one."""
        return self.inputs.get_tokenizer(required)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, *, multi_modal_data: VisionInputs | None = None) -> None:
        """Queue a request; raises ValueError (and changes nothing) if it can never run.

        ``prompt`` is a string or ``{"prompt_token_ids": [...], "multi_modal_data": VisionInputs, "prompt":
        text}`` (only the ids required). Images hold one ``<|media_pad|>`` per embedding row in the ids, as
        ``apply_chat_template(..., images=[ImagePrompt(W, H, N), ...])`` renders them; they may also come as the
        ``multi_modal_data`` argument (the server passes them so). Atomic: every sample is built and checked
        before any is queued and the group registered, so a failure leaves no trace of the request.
        """
        params = params or SamplingParams()
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use; pick a unique id")
        checked = self.inputs.check(prompt, params, multi_modal_data)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = self.inputs.make_requests(request_id, checked, params, arrival, self.kv.enable_prefix_caching)
        self.groups[request_id] = RequestGroup(request_id, checked.text, children)   # nothing below can fail
        for req in children:
            self.scheduler.add(req)

    def prepare_constraint(self, params: SamplingParams, copies: int = 1) -> None:
        """Thread-safe, for callers off the engine's thread: compile ``params.structured_outputs`` (checked in
        a worker process under the grammar budget; ValueError if it does not compile) and make ``copies``
        matchers ahead, so that ``add_request`` only hands them out. A no-op without a constraint."""
        if params.structured_outputs is not None:
            self.inputs.grammar_compiler().prepare(params.structured_outputs, copies)

    def check_request(self, prompt, params: SamplingParams, multi_modal_data: VisionInputs | None = None):
        """Validate a request without queueing it: its ``CheckedPrompt``, or ValueError."""
        return self.inputs.check(prompt, params, multi_modal_data)

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
        return self.scheduler.has_unfinished() or bool(self._aborted) or self._in_flight is not None

    def request_started(self, request_id: str) -> bool:
        """Whether any sample of the request has been scheduled (or it is gone already)."""
        group = self.groups.get(request_id)
        return group is None or any(r.num_computed_tokens or r.num_output_tokens or r.status is not
                                    RequestStatus.WAITING for r in group.children)

    def stats(self) -> EngineStats:
        kv, runner = self.kv, self.runner
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_usable_blocks=self.plan.num_usable_blocks, num_free_blocks=kv.blocks.num_free,
            num_queried_tokens=kv.num_queried_tokens, num_hit_tokens=kv.num_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions, num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens, num_drafts=self.num_drafts,
            accepted_per_position=tuple(self.accepted_per_position), num_steps=runner.num_steps,
            num_graph_steps=runner.num_graph_steps, num_encoded_images=runner.images.num_encoded_images,
            host_seconds=runner.host_seconds, prepare_seconds=runner.prepare_seconds,
            model_seconds=runner.model_seconds)

    def step(self) -> list[RequestOutput]:
        """Run one forward step; returns a delta for every request that produced tokens or finished. With
        async scheduling a pure decode step's tokens come in the next call (which first launches the step
        after it, ``Scheduler.schedule_ahead``), so the host's work overlaps the device's."""
        if self._error is not None:      # before the aborted groups are taken: their deltas come next call
            error, self._error = self._error, None
            raise error
        touched: dict[str, RequestGroup] = {g.request_id: g for g in self._aborted}
        self._aborted = []
        if self._in_flight is not None:
            self._step_ahead(touched)
            return self._deltas(touched)
        out = self.scheduler.schedule()
        if out.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError(f"scheduler found nothing to run with {len(self.scheduler.waiting)} waiting "
                                   f"requests; the cache plan cannot hold one chunk ({self.plan.describe()})")
            return self._deltas(touched)
        if self.config.async_scheduling and all(c.samples and not c.draft for c in out.chunks):
            self._in_flight = (out, self._guarded(out, lambda: self.runner.sample(out, self.runner.launch(out))))
            self.scheduler.update(out)      # the computed counts need no sampled token
            return self._deltas(touched)
        after = self.scheduler.schedule_past_rejection(out) if self.config.async_scheduling else None
        if after is not None:
            self._verify_past_rejection(out, after, touched)
            return self._deltas(touched)
        self._commit(out, self._guarded(out, lambda: self.runner.execute(out)), touched)
        return self._deltas(touched)

    def _verify_past_rejection(self, verify, after, touched: dict[str, RequestGroup],
                               logits: torch.Tensor | None = None) -> None:
        """Launch a verify step, then at once ``after`` (``Scheduler.schedule_past_rejection``: the next step as
        if every draft fails, fed the verify's first-row tokens on the device), then settle the drafts (the
        rows' argmax was copied out before ``after`` was queued, so this waits for the verify alone). The
        chunks of requests whose drafts were all rejected and that go on are kept (all of them: ``after``
        stays in flight as an async step; some: their tokens are taken now); the others' rows are dropped
        (their snapshot slot goes back to the pool, and the latent it wrote is the accepted draft's own).
        ``logits``: the verify step's, when it was launched already (drafted ahead)."""
        if logits is None:
            logits = self._guarded(verify, lambda: self.runner.launch(verify))
        greedy = logits.argmax(-1)
        first = greedy[on_device([a for a, _ in row_spans(verify.chunks)], torch.int64, self.device)]
        host = PendingOutput(greedy, [None] * greedy.shape[0])       # its copy queued before ``after``
        logits_after = self._try(after, lambda: self.runner.launch(after, first))
        pending = None if logits_after is None else self._try(after, lambda: self.runner.sample(after, logits_after))
        greedy_rows = host.result().token_ids
        result = self._try(verify, lambda: self.runner.sample(verify, logits, greedy_rows))
        if result is None:               # raised by the next ``step`` (after this one's deltas, as ``_step_ahead``)
            return
        self._commit(verify, result, touched)
        if pending is None:
            return
        keep = [i for i, (c, v) in enumerate(zip(after.chunks, verify.chunks))
                if v.num_accepted == 0 and not c.req.is_finished]
        if len(keep) == len(after.chunks):
            self.scheduler.update(after)
            self._in_flight = (after, pending)
        elif keep:
            result = pending.result()
            after.chunks = [after.chunks[i] for i in keep]
            self._commit(after, SamplerOutput([result.token_ids[i] for i in keep], [result.logprobs[i] for i in keep]),
                         touched)

    def _guarded(self, out, run):
        """``run()``; if it raises, the step's reserved slots go back and a StepError names its requests."""
        try:
            return run()
        except BaseException as e:
            self.kv.return_checkpoint_slots(ck.slot for ck, h in zip(out.checkpoints, out.checkpoint_hashes)
                                            if h is not None)
            self.kv.return_spec_slots(slot for c in out.chunks for slot in c.spec_slots)
            if isinstance(e, Exception):
                raise StepError(list(dict.fromkeys(c.req.group_id for c in out.chunks)), e) from e
            raise

    def _step_ahead(self, touched: dict[str, RequestGroup]) -> None:
        """Launch the step after the one in flight, then take the in-flight step's tokens, then sample the
        new step (its logit controls see those tokens). A failure of the new step is raised by the next
        ``step`` call, after this one has delivered the in-flight step's tokens."""
        prev, pending = self._in_flight
        self._in_flight = None
        ahead = self.scheduler.schedule_ahead(prev)
        logits = None
        if ahead is not None:
            inputs = pending.tokens               # row i: prev.chunks[i]'s token; ahead keeps prev's order
            if len(ahead.chunks) < len(prev.chunks):
                row = {id(c.req): i for i, c in enumerate(prev.chunks)}
                inputs = inputs[on_device([row[id(c.req)] for c in ahead.chunks], torch.int64, self.device)]
            logits = self._try(ahead, lambda: self.runner.launch(ahead, inputs))
        self._commit(prev, pending.result(), touched, updated=True)
        if logits is None:
            return
        keep = [i for i, c in enumerate(ahead.chunks) if not c.req.is_finished]   # prev's token ended the others
        if not keep:
            self.kv.return_spec_slots(slot for c in ahead.chunks for slot in c.spec_slots)
            return
        if len(keep) < len(ahead.chunks):
            spans = row_spans(ahead.chunks)
            self.kv.return_spec_slots(slot for c in ahead.chunks if c.req.is_finished for slot in c.spec_slots)
            ahead.chunks = [ahead.chunks[i] for i in keep]
            logits = logits[on_device([r for i in keep for r in range(*spans[i])], torch.int64, self.device)]
        if any(c.draft for c in ahead.chunks):          # drafted ahead (``Scheduler._draft_ahead``)
            after = self.scheduler.schedule_past_rejection(ahead)
            if after is not None:
                self._verify_past_rejection(ahead, after, touched, logits)
            else:
                result = self._try(ahead, lambda: self.runner.sample(ahead, logits).result())
                if result is not None:
                    self._commit(ahead, result, touched)
            return
        result = self._try(ahead, lambda: self.runner.sample(ahead, logits))
        if result is not None:
            self._in_flight = (ahead, result)
            self.scheduler.update(ahead)

    def _try(self, out, run):
        try:
            return self._guarded(out, run)
        except StepError as e:
            self._error = e
            return None

    def _commit(self, out, result, touched: dict[str, RequestGroup], updated: bool = False) -> None:
        """Settle a step's drafts, advance the requests (unless ``updated`` already) and append its tokens."""
        sampling = [c for c in out.chunks if c.samples]
        accepted = result.accepted or [[] for _ in sampling]
        for c, drafts in zip(sampling, accepted):
            if c.draft:
                settle_drafts(self.kv, c, len(drafts))
                self.num_draft_tokens += len(c.draft)
                self.num_accepted_tokens += len(drafts)
                self.num_drafts += 1
                if len(self.accepted_per_position) < len(c.draft):
                    self.accepted_per_position += [0] * (len(c.draft) - len(self.accepted_per_position))
                for j in range(len(drafts)):
                    self.accepted_per_position[j] += 1
                if self.drafter is not None:
                    self.drafter.settled(c)
        if not updated:
            self.scheduler.update(out)
        draft_lps = result.accepted_logprobs or [[None] * len(d) for d in accepted]
        now = time.monotonic()
        for c, token, lp, drafts, lps in zip(sampling, result.token_ids, result.logprobs, accepted, draft_lps):
            if c.req.is_finished:       # aborted while its step was in flight
                continue
            self._append(c, (*drafts, token), (*lps, lp), now)
            group = self.groups.get(c.req.group_id)
            if group is None:    # cannot happen (add_request is atomic); never let it fail a step
                logger.error("request %s has no group; finishing it", c.req.request_id)
                if not c.req.is_finished:
                    self.scheduler.finish(c.req, "abort")
                continue
            touched[group.request_id] = group
        if self.drafter is not None:
            self.drafter.after_step(out, out.draft_states)

    def _append(self, c: ScheduledChunk, tokens: tuple[int, ...], logprobs: tuple, now: float) -> None:
        """Give a request its new tokens until one of them finishes it."""
        req, out = c.req, c.req.out
        if out.first_token_time is None:
            out.first_token_time = now
        for t, t_lp in zip(tokens, logprobs):
            reason = append_output(req, t, t_lp, self.config.max_model_len)
            if reason is not None:
                self.scheduler.finish(req, reason)
                out.finish_time = now
                return

    def _deltas(self, touched: dict[str, RequestGroup]) -> list[RequestOutput]:
        outs = deltas(list(touched.values()))
        for o in outs:
            if o.finished:
                self.groups.pop(o.request_id, None)
        return outs
