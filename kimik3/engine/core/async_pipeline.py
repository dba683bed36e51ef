"""Async scheduling: a pipeline around the engine's sync step that keeps the device busy.

``LLMEngine.step`` hands each call to ``AsyncPipeline.step`` when ``async_scheduling`` is on. A pure decode
step is launched and its tokens stay on the device (``in_flight``); the next call first launches the step
after it (``Scheduler.schedule_ahead``, fed those tokens on the device), then takes the in-flight tokens, so
the host's work for one step overlaps the device's for the next. A verify step whose drafts are expected to
fail is followed at once by the step that assumes they do (``Scheduler.schedule_past_rejection``). Any other
step runs as the engine's sync step (``LLMEngine.run_step``). A step launched ahead that fails is raised by
the next ``step`` call, after this call's tokens are delivered.
"""

from __future__ import annotations

import torch

from kimik3.engine.core.scheduler_output import SchedulerOutput, StepError
from kimik3.engine.sample.sampler import PendingOutput, SamplerOutput
from kimik3.engine.spec.verify import row_spans
from kimik3.engine.transfer import on_device


class AsyncPipeline:
    def __init__(self, engine):
        self.engine = engine
        self.in_flight: tuple[SchedulerOutput, PendingOutput] | None = None   # (step on the device, its tokens)
        self.error: StepError | None = None      # a step launched ahead failed: raised by the next step()

    def step(self) -> list:
        """``LLMEngine.step`` under async scheduling: the step after the one in flight, or a new one."""
        engine = self.engine
        if self.error is not None:      # before the aborted groups are taken: their deltas come next call
            error, self.error = self.error, None
            raise error
        touched = engine.take_aborted()
        if self.in_flight is not None:
            self._step_ahead(touched)
        else:
            out = engine.schedule()
            if out is not None:
                self._launch(out, touched)
        return engine.emit(touched)

    def _launch(self, out: SchedulerOutput, touched: dict) -> None:
        """A freshly scheduled step: a pure decode step stays in flight; a verify step expected to fail is
        followed at once by the step past it; any other runs as the sync step."""
        engine = self.engine
        if all(c.samples and not c.draft for c in out.chunks):
            self.in_flight = (out, engine.guarded(out, lambda: engine.runner.sample(out, engine.runner.launch(out))))
            engine.scheduler.update(out)      # the computed counts need no sampled token
            return
        after = engine.scheduler.schedule_past_rejection(out)
        if after is not None:
            self._verify_past_rejection(out, after, touched)
        else:
            engine.run_step(out, touched)

    def _verify_past_rejection(self, verify, after, touched: dict,
                               logits: torch.Tensor | None = None) -> None:
        """Launch a verify step, then at once ``after`` (``Scheduler.schedule_past_rejection``: the next step as
        if every draft fails, fed the verify's first-row tokens on the device), then settle the drafts (the
        rows' argmax was copied out before ``after`` was queued, so this waits for the verify alone). The
        chunks of requests whose drafts were all rejected and that go on are kept (all of them: ``after``
        stays in flight as an async step; some: their tokens are taken now); the others' rows are dropped
        (their snapshot slot goes back to the pool, and the latent it wrote is the accepted draft's own).
        ``logits``: the verify step's, when it was launched already (drafted ahead)."""
        engine = self.engine
        if logits is None:
            logits = engine.guarded(verify, lambda: engine.runner.launch(verify))
        greedy = logits.argmax(-1)
        first = greedy[on_device([a for a, _ in row_spans(verify.chunks)], torch.int64, engine.device)]
        host = PendingOutput(greedy, [None] * greedy.shape[0])       # its copy queued before ``after``
        logits_after = self._try(after, lambda: engine.runner.launch(after, first))
        pending = None if logits_after is None else self._try(after, lambda: engine.runner.sample(after, logits_after))
        greedy_rows = host.result().token_ids
        result = self._try(verify, lambda: engine.runner.sample(verify, logits, greedy_rows))
        if result is None:               # raised by the next ``step`` (after this one's deltas, as ``_step_ahead``)
            return
        engine.commit(verify, result, touched)
        if pending is None:
            return
        keep = [i for i, (c, v) in enumerate(zip(after.chunks, verify.chunks))
                if v.num_accepted == 0 and not c.req.is_finished]
        if len(keep) == len(after.chunks):
            engine.scheduler.update(after)
            self.in_flight = (after, pending)
        elif keep:
            result = pending.result()
            after.chunks = [after.chunks[i] for i in keep]
            engine.commit(after, SamplerOutput([result.token_ids[i] for i in keep], [result.logprobs[i] for i in keep]),
                          touched)

    def _step_ahead(self, touched: dict) -> None:
        """Launch the step after the one in flight, then take the in-flight step's tokens, then sample the
        new step (its logit controls see those tokens). A failure of the new step is raised by the next
        ``step`` call, after this one has delivered the in-flight step's tokens."""
        engine = self.engine
        prev, pending = self.in_flight
        self.in_flight = None
        ahead = engine.scheduler.schedule_ahead(prev)
        logits = None
        if ahead is not None:
            inputs = pending.tokens               # row i: prev.chunks[i]'s token; ahead keeps prev's order
            if len(ahead.chunks) < len(prev.chunks):
                row = {id(c.req): i for i, c in enumerate(prev.chunks)}
                inputs = inputs[on_device([row[id(c.req)] for c in ahead.chunks], torch.int64, engine.device)]
            logits = self._try(ahead, lambda: engine.runner.launch(ahead, inputs))
        finished = engine.commit(prev, pending.result(), touched, updated=True)
        if logits is None:
            return
        if finished:        # prev's token ended some: ahead's chunks of them go
            logits = self._drop_finished(ahead, logits)
            if logits is None:
                return
        if not ahead.plain_decode and any(c.draft for c in ahead.chunks):   # drafted ahead (``Scheduler._draft_ahead``)
            after = engine.scheduler.schedule_past_rejection(ahead)
            if after is not None:
                self._verify_past_rejection(ahead, after, touched, logits)
            else:
                result = self._try(ahead, lambda: engine.runner.sample(ahead, logits).result())
                if result is not None:
                    engine.commit(ahead, result, touched)
            return
        result = self._try(ahead, lambda: engine.runner.sample(ahead, logits))
        if result is not None:
            self.in_flight = (ahead, result)
            engine.scheduler.update(ahead)

    def _drop_finished(self, ahead: SchedulerOutput, logits: torch.Tensor) -> torch.Tensor | None:
        """Take the finished requests' chunks out of ``ahead`` (their snapshot slots back to the pool); the
        logits rows of the others, or None when none is left."""
        engine = self.engine
        keep = [i for i, c in enumerate(ahead.chunks) if not c.req.is_finished]
        if not keep:
            engine.kv.return_spec_slots(slot for c in ahead.chunks for slot in c.spec_slots)
            return None
        if len(keep) < len(ahead.chunks):
            spans = row_spans(ahead.chunks)
            engine.kv.return_spec_slots(slot for c in ahead.chunks if c.req.is_finished for slot in c.spec_slots)
            ahead.chunks = [ahead.chunks[i] for i in keep]
            logits = logits[on_device([r for i in keep for r in range(*spans[i])], torch.int64, engine.device)]
        return logits

    def _try(self, out, run):
        """``engine.guarded(out, run)``, its StepError kept for the next ``step`` call (None returned)."""
        try:
            return self.engine.guarded(out, run)
        except StepError as e:
            self.error = e
            return None
