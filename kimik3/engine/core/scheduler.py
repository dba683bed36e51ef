"""Scheduler: each step, hand out a token budget so every request's computed tokens catch up.

Per step (budget = ``max_num_batched_tokens``):
1. Running requests, oldest first, take what they still lack (1 for a decode, a chunk for a prefill: at most
   ``long_prefill_token_threshold`` tokens when that is set); while
   the cache cannot grow, the newest running request is preempted (freed, recomputed later, first in line).
2. Waiting requests, first come first served, are admitted while budget, ``max_num_seqs`` and cache allow
   (a long prompt gets a chunk, a prefix hit skips the cached part), but not in a step that preempted (the
   cache is short already). Samples 2..n of an n > 1 request wait for sample 1's prompt, then hit its blocks.
3. Chunks that cross a KDA checkpoint boundary ask the model for a state snapshot there.
4. Speculative decoding: a decode step of a request the drafter may draft for carries its drafts (the
   drafter proposes them within the room ``_draft_room`` computes, ``engine/spec/drafter.py``) and a snapshot
   after each but the last (``spec/verify.py``); a request whose drafts were partly rejected first copies
   its snapshot back (``settle_drafts``, ``CacheHoldings.rollback_slot``).
5. Async scheduling: while a step's tokens are still on the device, the next decode step of the same requests
   is scheduled ahead (``schedule_ahead``) when nothing else could change it: no waiting request, no
   preemption, no checkpoint to take, prev without drafts. A request due to draft asks the drafter for
   drafts ahead of prev's token (``Drafter.propose_ahead``: a guess of that token and drafts after it, or
   None: wait for it); a request that prev's token finishes is left out or dropped.
6. Async scheduling with speculation: a verify step whose drafts are expected to fail (drafted ahead on a
   guess the real token proved wrong) is followed at once by the step that assumes they fail
   (``schedule_past_rejection``), so the device does not wait for the verify's tokens; the engine drops it
   for any request whose drafts were accepted.
"""

from __future__ import annotations

from collections import deque

from kimik3.engine.config import EngineConfig
from kimik3.engine.core.kv_cache import KVCacheManager
from kimik3.engine.core.request import Request, RequestStatus
from kimik3.engine.core.scheduler_output import ScheduledChunk, SchedulerOutput
from kimik3.engine.sample.sampler import is_plain_greedy
from kimik3.engine.spec.drafter import Drafter
from kimik3.model.batch import StateCheckpoint


PROMPT_LOGPROB_ROWS = 1024     # prompt positions one step scores for prompt_logprobs (their float32 logits rows)


def _cap_prompt_rows(req: Request, start: int, n: int, left: int) -> tuple[int, int]:
    """A chunk of ``n`` tokens from ``start`` shortened so it scores at most ``left`` prompt positions for
    ``prompt_logprobs`` (each a [vocab] float32 logits row: 8,192 of them took 5.4 GB at K3's vocabulary);
    (tokens, rows scored). 0 tokens: it waits for the next step."""
    if req.params.prompt_logprobs is None:
        return n, 0
    lo = max(start, len(req.out.prompt_logprobs) - 1)
    rows = max(0, min(start + n, req.num_prompt_tokens - 1) - lo)
    if rows <= left:
        return n, rows
    return max(0, lo - start) + left, left


class Scheduler:
    def __init__(self, kv: KVCacheManager, config: EngineConfig, drafter: Drafter | None = None):
        self.kv = kv
        self.config = config
        self.drafter = drafter          # None: no speculative decoding
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def _chunk_cap(self) -> int:
        """The most tokens one request computes in a step: ``long_prefill_token_threshold`` (vLLM's: a long prompt
        is prefilled in chunks that short, so the decode steps it shares stay short), else the step's budget."""
        return self.config.long_prefill_token_threshold or self.config.max_num_batched_tokens

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        """Requests to schedule (a paused one waits for ``LLMEngine.pause_request(..., False)``)."""
        return bool(self.waiting) or any(not r.paused for r in self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        rows_left = PROMPT_LOGPROB_ROWS
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.paused:                  # keeps its cache and slot; not stepped
                i += 1
                continue
            self.kv.take_rollback(req, out.state_copies)     # roll back to the last accepted draft first
            n, rows = _cap_prompt_rows(req, req.num_computed_tokens,
                                       min(req.num_tokens - req.num_computed_tokens, budget, self._chunk_cap),
                                       rows_left)
            if n == 0:
                i += 1
                continue
            rows_left -= rows
            # drafts follow a decode token only (a 1-token chunk inside a prompt, under a threshold of 1, has none)
            draft = self._draft(req, budget) if n == 1 == req.num_tokens - req.num_computed_tokens else []
            while not self.kv.allocate(req, n + len(draft)):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                slots = self.kv.take_spec_slots(len(draft))
                draft = draft[:len(slots)]
                self._add_chunk(out, req, n + len(draft), draft, slots)
                budget -= n + len(draft)
                i += 1
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self._blocked(req):
                break
            n = min(req.num_tokens, budget, self._chunk_cap)
            admission = self.kv.admit(req, n)
            if admission is None:
                break
            self.running.append(self.waiting.popleft())
            req.wait_for = None
            req.status = RequestStatus.RUNNING
            out.admitted.append((req, admission.num_hit_tokens))
            if admission.restore_from is None:
                out.state_resets.append(req.cache.state_slot)
            else:
                out.state_copies.append((admission.restore_from, req.cache.state_slot))
            n, rows = _cap_prompt_rows(req, req.num_computed_tokens, min(n, req.num_tokens - req.num_computed_tokens),
                                       rows_left)
            rows_left -= rows
            if n:
                self._add_chunk(out, req, n)
            budget -= n
        return out

    def schedule_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """Async scheduling (rule 5): the decode step after ``prev`` while prev's tokens are still on
        the device, or None when it could differ from what ``schedule`` will decide once they arrive.
        A request due to draft drafts ahead (``_draft_ahead``): its chunk verifies prev's token and drafts."""
        if not self._drafts_ahead and any(self._may_draft(c.req) for c in prev.chunks):
            return None                                # its drafter drafts from prev's committed tokens
        if self.waiting or len(prev.chunks) != len(self.running) or len(prev.chunks) > self.config.max_num_batched_tokens:
            return None
        for c in prev.chunks:
            if not c.samples or c.draft or c.req.status is RequestStatus.FINISHED or c.req.paused:
                return None
        if self.drafter is None:
            return self._decode_ahead(prev)
        budget = self.config.max_num_batched_tokens - len(prev.chunks)
        planned = []
        for c in prev.chunks:
            req, start = c.req, c.req.num_computed_tokens
            if req.reaches_length(self.config.max_model_len, pending=1):
                continue                               # prev's token ends it
            if self.kv.checkpoint_boundaries(start, start + 1):
                return None                            # a checkpoint needs its block's hash
            guess = self._draft_ahead(req, budget)
            if guess is None or not self.kv.allocate(req, len(guess) or 1):
                return None                            # a draft needs prev's token; or preemption
            budget -= max(len(guess) - 1, 0)
            planned.append((req, guess))
        return self._plan_ahead(planned)

    def _decode_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """``schedule_ahead`` without a drafter: one token for each request of ``prev`` that its pending token
        does not end (the loop above written out for the batch: the step's host work)."""
        kv, max_len = self.kv, self.config.max_model_len
        bs = kv.block_size
        every = kv.interval * bs if kv.enable_prefix_caching else 0      # tokens between checkpoints
        out = SchedulerOutput(plain_decode=True)
        chunks = out.chunks
        for c in prev.chunks:
            req = c.req
            n = len(req.token_ids) + 1                 # with the pending token
            if n - len(req.prompt_token_ids) >= req.params.max_tokens or n >= max_len:
                continue                               # prev's token ends it (``Request.reaches_length``)
            start = req.num_computed_tokens
            if every and (start + 1) % every == 0:
                return None                            # a checkpoint needs its block's hash
            if start >= len(req.cache.block_ids) * bs and not kv.allocate(req, 1):
                return None                            # preemption
            chunks.append(ScheduledChunk.decode(req, start))
        return out if chunks else None

    def _plan_ahead(self, planned: list[tuple[Request, list[int]]]) -> SchedulerOutput | None:
        """``schedule_ahead``'s step from its planned requests and their guesses ([g, drafts..] or [])."""
        out = SchedulerOutput()
        for req, guess in planned:
            slots = self.kv.take_spec_slots(len(guess) - 1) if guess else []
            self._add_chunk(out, req, 1 + len(slots), guess[1:1 + len(slots)], slots, input_pending=True)
            if slots:
                out.chunks[-1].guess = guess[0]
        for c in out.chunks:
            if self._may_draft(c.req):
                self.drafter.ahead_scheduled(c.req)
        for c in out.chunks:     # prev ran on a verify step's snapshot (``schedule_past_rejection``): copy it back
            self.kv.take_rollback(c.req, out.state_copies)
        return out if out.chunks else None

    def _draft_ahead(self, req: Request, budget: int) -> list[int] | None:
        """[g, drafts..] for the step after ``req``'s pending token (``Drafter.propose_ahead``), [] for none,
        None to wait for that token."""
        if not self._may_draft(req):
            return []
        return self.drafter.propose_ahead(req, self._draft_room(req, budget + 1, 1))

    def schedule_past_rejection(self, verify: SchedulerOutput) -> SchedulerOutput | None:
        """Async scheduling with speculation (rule 6): the decode step after ``verify`` (a step with drafts)
        launched before its drafts are settled, as if every draft is rejected: each request's next position,
        its input the verify's first-row token (on the device), run on the verify's snapshot after that row
        (``ScheduledChunk.state_slot``), so the live state and the other snapshots stay for any other outcome.
        Only where rejection is expected and the step is what ``schedule`` would then decide: every running
        request is in ``verify`` with drafts that are expected to fail (drafted ahead on a successor guess the
        real input token proved wrong; else the drafter expects it, ``Drafter.expects_rejection``), it samples
        plain greedy without controls and the verify's token does not end it; no request waits; no prefix
        checkpoint at the new position. Else None. The engine keeps the chunks whose drafts were all rejected.
        (Called once the verify's input tokens are on the host.) Never with a drafter that does not draft ahead
        (``Drafter.drafts_ahead``: a draft model's drafts follow the verify's committed tokens)."""
        if (self.waiting or len(verify.chunks) != len(self.running) or not self._drafts_ahead
                or any(c.req.paused for c in verify.chunks)):
            return None
        out = SchedulerOutput()
        for c in verify.chunks:
            if not self._runs_past_rejection(c):
                return None
            out.chunks.append(ScheduledChunk(c.req, 1, c.start + 1, input_pending=True, state_slot=c.spec_slots[0]))
        return out

    def _runs_past_rejection(self, c: ScheduledChunk) -> bool:
        """Whether the step after verify chunk ``c`` can be launched as if its drafts all fail
        (``schedule_past_rejection``'s conditions for one request)."""
        req, start, p = c.req, c.start + 1, c.req.params
        if not c.draft or not c.samples:
            return False
        expect_rejection = self.drafter.expects_rejection(req) if c.guess is None else c.guess != req.token_ids[c.start]
        return bool(expect_rejection and is_plain_greedy(p) and not p.has_controls and req.matcher is None
                    and not req.reaches_length(self.config.max_model_len, pending=1)
                    and not self.kv.checkpoint_boundaries(start, start + 1))

    def _may_draft(self, req: Request) -> bool:
        return self.drafter is not None and self.drafter.may_draft(req)

    @property
    def _drafts_ahead(self) -> bool:
        return self.drafter is None or self.drafter.drafts_ahead

    @staticmethod
    def _blocked(req: Request) -> bool:
        """Siblings of an n > 1 request wait until the first has computed the shared prompt."""
        first = req.wait_for
        return first is not None and not first.is_finished and first.num_computed_tokens < first.num_prompt_tokens

    def _draft(self, req: Request, budget: int) -> list[int]:
        """Draft tokens for a decode step of ``req`` (``Drafter.propose`` within ``_draft_room``; ``schedule``
        trims them to the free snapshot slots); none where the drafter has none for it (``Drafter.proposes``)."""
        if not self._may_draft(req) or not self.drafter.proposes(req):
            return []
        return self.drafter.propose(req, self._draft_room(req, budget, 0))

    def _draft_room(self, req: Request, budget: int, pending: int) -> int:
        """Most drafts ``req``'s next decode chunk may carry (the room the drafter proposes within): within
        ``budget`` tokens (its input included), ``num_speculative_tokens``, max_tokens, max_model_len and short of
        the next checkpoint boundary (a checkpoint inside the drafts would need a hash of unconfirmed tokens).
        ``pending``: tokens sampled but not yet on the host (1 when drafting ahead of the previous token; the
        chunk's input is at num_computed_tokens either way)."""
        cfg = self.config
        k = min(cfg.num_speculative_tokens, budget - 1,
                req.params.max_tokens - req.num_output_tokens - 1 - pending, cfg.max_model_len - req.num_tokens - 1 - pending)
        boundary = self.kv.next_checkpoint(req.num_computed_tokens + 1)
        return k if boundary is None else min(k, boundary - req.num_computed_tokens - 2)

    def _add_chunk(self, out: SchedulerOutput, req: Request, n: int, draft: list[int] | None = None,
                   spec_slots: list[int] | None = None, input_pending: bool = False) -> None:
        start = req.num_computed_tokens
        seq = len(out.chunks)
        out.chunks.append(ScheduledChunk(req, n, start, draft or [], spec_slots or [], input_pending=input_pending))
        for j in self.kv.checkpoint_boundaries(start, start + n):
            h = req.block_hashes[j - 1]
            slot = self.kv.take_checkpoint_slot(h)
            if slot is not None:
                out.checkpoints.append(StateCheckpoint(seq, j * self.kv.block_size - start, slot))
                out.checkpoint_hashes.append(h)
        for j, slot in enumerate(spec_slots or []):      # state after row j + 1 (the real token, drafts 1..j)
            out.checkpoints.append(StateCheckpoint(seq, j + 1, slot))
            out.checkpoint_hashes.append(None)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        if self.drafter is not None:
            self.drafter.release(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def settle_drafts(self, chunk: ScheduledChunk, m: int) -> None:
        """A speculative chunk accepted ``m`` of its drafts (before ``update``): the drafter learns it, the
        request keeps the snapshot after row m + 1 for its next step (unless every draft was accepted: then
        the live state is right) and the other snapshot slots go back."""
        chunk.num_accepted = m
        self.drafter.settle(chunk.req, chunk.draft, m)
        slots = chunk.spec_slots
        if m < len(chunk.draft):
            self.kv.keep_rollback(chunk.req, slots[m])
            self.kv.return_spec_slots(slots[:m] + slots[m + 1:])
        else:
            self.kv.return_spec_slots(slots)

    def update(self, out: SchedulerOutput) -> None:
        """After the step ran: advance computed counts, register cached blocks and checkpoints."""
        kv = self.kv
        bs = kv.block_size if kv.enable_prefix_caching else 0
        for chunk in out.chunks:
            req = chunk.req
            req.num_computed_tokens = n = chunk.start + chunk.num_tokens - len(chunk.draft) + chunk.num_accepted
            if bs and n // bs > req.cache.num_cached_blocks:     # a block filled up
                kv.cache_blocks(req)
        for ck, h in zip(out.checkpoints, out.checkpoint_hashes):
            if h is not None:                           # None: a speculative snapshot (spec/verify.py)
                self.kv.commit_checkpoint(h, ck.slot)

    def finish(self, req: Request, reason: str) -> None:
        """Finish or abort a request now: its memory is freed immediately."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self.kv.free(req)
        if self.drafter is not None:
            self.drafter.release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
