"""LLMEngine: the streaming core. add_request / abort_request / step, one forward per step.

One loop (nano-vllm's): ``Scheduler.schedule`` decides -> ``ModelRunner.execute`` builds the batch, runs the
model and samples -> ``Scheduler.update`` advances the requests -> the engine appends the tokens, checks
stops and emits deltas (``output.py``). With ``async_scheduling`` the ``AsyncPipeline`` (``async_pipeline.py``)
drives these same parts: a decode step's tokens stay on the device while the next step is scheduled and
launched, and steps it cannot overlap run as the sync step (``run_step``). Requests come in through ``InputProcessor``;
``stats()`` is the engine's one read-out. Not thread-safe: a server drives it from one loop and forwards
aborts there.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from kimik3.engine.config import EngineConfig
from kimik3.engine.core.async_pipeline import AsyncPipeline
from kimik3.engine.core.cache_budget import plan_cache
from kimik3.engine.core.input_processor import InputProcessor
from kimik3.engine.core.kv_cache import KVCacheManager
from kimik3.engine.core.output import EngineStats, RequestGroup, RequestOutput, append_output, deltas, record_scheduling
from kimik3.engine.core.request import RequestStatus
from kimik3.engine.core.scheduler import Scheduler
from kimik3.engine.core.scheduler_output import SchedulerOutput, StepError
from kimik3.engine.run.runner import ModelRunner
from kimik3.engine.sample.sampling_params import SamplingParams
from kimik3.engine.spec.drafters import make_drafter
from kimik3.model.batch import latent_cache_dtype
from kimik3.vision.preprocess import VisionInputs

logger = logging.getLogger(__name__)


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
        from_source = draft is None
        if config.uses_draft_model and draft is None:       # loaded first: a GPU budget counts its weights
            from kimik3.engine.spec.draft_model import load_draft
            draft = load_draft(config.speculative_method, config.speculative_model or tokenizer_path, model)
        # pipeline stages: the plan every rank allocates covers the stage with the most layers of each kind
        plan_text = getattr(model, "cache_plan_text_config", model.cache_text_config)
        self.plan = plan_cache(config, plan_text, model.dtype, self.device)
        if config.uses_draft_model:          # the draft's cache shares the target's blocks: plan them together
            from kimik3.engine.spec.draft_model import ModelDrafter
            per_block = ModelDrafter.bytes_per_block(draft, config.block_size)
            per_slot = ModelDrafter.bytes_per_slot(draft)
            if (per_block or per_slot) and (config.cache_memory_bytes is not None or self.device.type == "cuda"):
                self.plan = self._plan_beside_draft(config, model, per_block, per_slot)
        self.cache = model.allocate_cache(self.plan.num_slots, self.plan.num_blocks, config.block_size,
                                          latent_cache_dtype(config.kv_cache_dtype, model.dtype))
        self.kv = KVCacheManager(self.plan, config.enable_prefix_caching)
        first_spec = 1 + self.plan.num_live_slots          # the plan's slot layout (``KVCacheManager``)
        drafter = make_drafter(config, model, self.plan.num_blocks, draft, tokenizer_path, from_source,
                               self.plan.num_slots, range(first_spec, first_spec + self.plan.num_spec_slots))
        self.scheduler = Scheduler(self.kv, config, drafter)
        if drafter is not None and drafter.aux_layers:
            # every step (eager or a decode / verify graph) keeps the states the draft reads; under tensor
            # parallelism the draft runs on every rank (``ParallelRunner.attach_draft``), its graphs on every rank too
            self.runner = (runner_factory or ModelRunner)(model, self.cache, config, aux_layers=drafter.aux_layers)
            self.runner.attach_draft(drafter)
        else:
            self.runner = (runner_factory or ModelRunner)(model, self.cache, config)
        self.inputs = InputProcessor(model.config, config, self.device, tokenizer, tokenizer_path)
        self.groups: dict[str, RequestGroup] = {}
        self._aborted: list[RequestGroup] = []
        self.num_draft_tokens = self.num_accepted_tokens = 0     # speculative decoding: drafts verified / accepted
        self.num_drafts = 0                                       # verify chunks (vLLM's spec_decode_num_drafts)
        self.accepted_per_position: list[int] = []                # drafts accepted at draft position j
        self.pipeline = AsyncPipeline(self) if config.async_scheduling else None

    def _plan_beside_draft(self, config: EngineConfig, model, per_block: int, per_slot: int = 0):
        """The target's plan within the budget less the draft's cache (``per_block`` bytes per block, ``per_slot``
        per state slot: the target's but its snapshot slots, and a scratch slot per sequence), found by shrinking
        the target's budget by what the last try overshot (KDA checkpoints scale with the blocks too)."""
        budget, plan = self.plan.budget_bytes, self.plan
        share = budget
        for _ in range(16):
            draft_slots = plan.num_slots - plan.num_spec_slots + config.max_num_seqs
            over = plan.total_bytes + plan.num_blocks * per_block + draft_slots * per_slot - budget
            if over <= 0:
                return plan
            unit = plan.bytes_per_block + per_block             # a block less saves both
            share -= -(-over // unit) * plan.bytes_per_block if plan.bytes_per_block else over
            plan = plan_cache(dataclasses.replace(config, cache_memory_bytes=max(share, 1)), model.cache_text_config,
                              model.dtype, self.device)
        raise ValueError(f"cannot fit the draft's cache ({per_block} B per block, {per_slot} B per state) beside the "
                         f"target's in {budget} B; raise cache_memory_bytes / gpu_memory_utilization")

    def get_tokenizer(self, required: bool = False):
        """The checkpoint's tokenizer (loaded on first use); None, or ValueError if ``required``, without one."""
        return self.inputs.get_tokenizer(required)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, *, multi_modal_data: VisionInputs | None = None,
                    final_only: bool = False) -> None:
        """Queue a request; raises ValueError (and changes nothing) if it can never run.

        ``prompt`` is a string or ``{"prompt_token_ids": [...], "multi_modal_data": VisionInputs, "prompt":
        text}`` (only the ids required). Images hold one ``<|media_pad|>`` per embedding row in the ids, as
        ``apply_chat_template(..., images=[ImagePrompt(W, H, N), ...])`` renders them; they may also come as the
        ``multi_modal_data`` argument (the server passes them so). Atomic: every sample is built and checked
        before any is queued and the group registered, so a failure leaves no trace of the request.
        ``final_only``: no deltas while it runs, one with all its samples' tokens and text when the last one
        finishes (vLLM's ``FINAL_ONLY`` output kind, as ``LLM.generate`` asks: it saves a delta per step).
        """
        params = params or SamplingParams()
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use; pick a unique id")
        checked = self.inputs.check(prompt, params, multi_modal_data)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = self.inputs.make_requests(request_id, checked, params, arrival, self.kv.enable_prefix_caching)
        self.groups[request_id] = RequestGroup(request_id, checked.text, children,   # nothing below can fail
                                               final_only=final_only)
        for req in children:
            self.scheduler.add(req)

    def prepare_constraint(self, params: SamplingParams, copies: int = 1, cached_only: bool = False) -> bool:
        """Thread-safe, for callers off the engine's thread: compile ``params.structured_outputs`` (checked in
        a worker process under the grammar budget; ValueError if it does not compile) and make ``copies``
        matchers ahead, so that ``add_request`` only hands them out. A no-op without a constraint.
        ``cached_only``: only if the constraint is compiled already (then it costs only the copies); returns
        False, having done nothing, if it is not."""
        if params.structured_outputs is None:
            return True
        return self.inputs.grammar_compiler().prepare(params.structured_outputs, copies, cached_only)

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

    def pause_request(self, request_id: str, paused: bool = True) -> None:
        """Stop (or resume) scheduling a request's samples; they keep their cache. A server pauses a stream
        whose client has stopped reading."""
        group = self.groups.get(request_id)
        for req in group.children if group is not None else ():
            req.paused = paused

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self._aborted)
                or (self.pipeline is not None and self.pipeline.in_flight is not None))

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
        async scheduling the pipeline (``async_pipeline.py``) drives it: a decode step's tokens come in the next
        call, so the host's work overlaps the device's."""
        if self.pipeline is not None:
            return self.pipeline.step()
        touched = self.take_aborted()
        out = self.schedule()
        if out is not None:
            self.run_step(out, touched)
        return self.emit(touched)

    def take_aborted(self) -> dict[str, RequestGroup]:
        """The groups to report this step, starting with those aborted since the last one."""
        touched = {g.request_id: g for g in self._aborted}
        self._aborted = []
        return touched

    def schedule(self) -> SchedulerOutput | None:
        """The scheduler's next step; None when nothing is left to run."""
        out = self.scheduler.schedule()
        if self.scheduler.drafter is not None:
            out.pending_drafts = self.scheduler.drafter.pending_drafts()
        record_scheduling(out, time.monotonic())
        if not out.is_empty:
            return out
        if self.scheduler.has_unfinished():
            raise RuntimeError(f"scheduler found nothing to run with {len(self.scheduler.waiting)} waiting "
                               f"requests; the cache plan cannot hold one chunk ({self.plan.describe()})")
        return None

    def run_step(self, out: SchedulerOutput, touched: dict[str, RequestGroup]) -> None:
        """The sync step: run ``out`` (forward and sampling) and commit its tokens."""
        self.commit(out, self.guarded(out, lambda: self.runner.execute(out)), touched)

    def guarded(self, out, run):
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

    def commit(self, out, result, touched: dict[str, RequestGroup], updated: bool = False) -> int:
        """Settle a step's drafts, advance the requests (unless ``updated`` already) and append its tokens;
        returns how many requests its tokens finished."""
        sampling = out.chunks if out.plain_decode else [c for c in out.chunks if c.samples]
        finished = 0
        if result.accepted is not None:
            for c, drafts in zip(sampling, result.accepted):
                if c.draft:
                    self.scheduler.settle_drafts(c, len(drafts))
                    self._count_drafts(len(c.draft), len(drafts))
        if not updated:
            self.scheduler.update(out)
        now = time.monotonic()
        if result.accepted is None:         # one token a chunk (no drafts verified)
            for c, token, lp in zip(sampling, result.token_ids, result.logprobs):
                if c.req.status is not RequestStatus.FINISHED:      # else aborted while its step was in flight
                    finished += not self._append(c.req, token, lp, now, touched)
        else:
            draft_lps = result.accepted_logprobs or [[None] * len(d) for d in result.accepted]
            for c, token, lp, drafts, lps in zip(sampling, result.token_ids, result.logprobs, result.accepted,
                                                 draft_lps):
                for t, t_lp in zip((*drafts, token), (*lps, lp)):
                    if c.req.status is RequestStatus.FINISHED:
                        break
                    if not self._append(c.req, t, t_lp, now, touched):
                        finished += 1
                        break
        if self.scheduler.drafter is not None:
            self.scheduler.drafter.observe(out, out.draft_states)
        return finished

    def _count_drafts(self, n: int, accepted: int) -> None:
        """A verify chunk of ``n`` drafts accepted its first ``accepted`` (the stats' speculative counters)."""
        self.num_draft_tokens += n
        self.num_accepted_tokens += accepted
        self.num_drafts += 1
        if len(self.accepted_per_position) < n:
            self.accepted_per_position += [0] * (n - len(self.accepted_per_position))
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    def _append(self, req, token: int, logprob, now: float, touched: dict[str, RequestGroup]) -> bool:
        """Give a request a new token (its group reported this step, a ``final_only`` one when it finishes);
        False when the token finishes it."""
        out = req.out
        if out.first_token_time is None:
            out.first_token_time = now
        reason = append_output(req, token, logprob, self.config.max_model_len)
        if reason is not None:
            self.scheduler.finish(req, reason)
            out.finish_time = now
        group = self.groups.get(req.group_id)
        if group is None:    # cannot happen (add_request is atomic); never let it fail a step
            logger.error("request %s has no group; finishing it", req.request_id)
            if req.status is not RequestStatus.FINISHED:
                self.scheduler.finish(req, "abort")
            return False
        if reason is not None or not group.final_only:
            touched[group.request_id] = group
        return reason is None

    def emit(self, touched: dict[str, RequestGroup]) -> list[RequestOutput]:
        outs = deltas(list(touched.values()))
        for o in outs:
            if o.finished:
                self.groups.pop(o.request_id, None)
        return outs
