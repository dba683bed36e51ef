"""Scheduler: each step, hand out a token budget so every request's computed tokens catch up.

Per step (budget = ``max_num_batched_tokens``):
1. Running requests, oldest first, take what they still lack (1 for a decode, a chunk for a prefill); while
   the cache cannot grow, the newest running request is preempted (freed, recomputed later, first in line).
2. Waiting requests, first come first served, are admitted while budget, ``max_num_seqs`` and cache allow
   (a long prompt gets a chunk, a prefix hit skips the cached part), but not in a step that preempted (the
   cache is short already). Samples 2..n of an n > 1 request wait for sample 1's prompt, then hit its blocks.
3. Chunks that cross a KDA checkpoint boundary ask the model for a state snapshot there.
4. Speculative decoding: a decode step without penalties carries n-gram drafts (``_draft``) and a snapshot
   after each but the last (``speculative.py``); a request whose drafts were partly rejected first copies
   its snapshot back (``CacheHoldings.rollback_slot``); one whose drafts all failed watches instead: it
   drafts again once its n-gram predictions came true twice in a row, and a wrong one pauses its lookups
   (``_watching``).
5. Async scheduling: while a step's tokens are still on the device, the next decode step of the same requests
   is scheduled ahead (``schedule_ahead``) when nothing else could change it: no waiting request, no
   preemption, no checkpoint to take, prev without drafts. A request due to draft looks up the n-gram before
   prev's token and drafts what followed its successor there (``_draft_ahead``); one with a grammar waits
   for prev's token unless no draft can follow any token (``speculative.may_propose_after``);
   a request that prev's token finishes is left out or dropped.
6. Async scheduling with speculation: a verify step whose drafts are expected to fail (drafted ahead on a
   guess the real token proved wrong) is followed at once by the step that assumes they fail
   (``schedule_past_rejection``), so the device does not wait for the verify's tokens; the engine drops it
   for any request whose drafts were accepted.
"""

from __future__ import annotations

import time
from collections import deque

from kimik3.engine.config import EngineConfig
from kimik3.engine.core.kv_cache import KVCacheManager
from kimik3.engine.core.request import Request, RequestStatus
from kimik3.engine.core.scheduler_output import ScheduledChunk, SchedulerOutput
from kimik3.engine.sample.sampler import is_plain_greedy
from kimik3.engine.spec import speculative
from kimik3.engine.spec.speculative import EMPTY_DRAFT_PAUSE, can_speculate, may_propose_after, propose_ngram, token_bytes
from kimik3.model.batch import StateCheckpoint


class Scheduler:
    def __init__(self, kv: KVCacheManager, config: EngineConfig):
        self.kv = kv
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            self.kv.take_rollback(req, out.state_copies)     # roll back to the last accepted draft first
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            draft = self._draft(req, budget) if n == 1 else []
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
            n = min(req.num_tokens, budget)
            admission = self.kv.admit(req, n)
            if admission is None:
                break
            self.running.append(self.waiting.popleft())
            req.wait_for = None
            req.status = RequestStatus.RUNNING
            if req.out.scheduled_time is None:
                req.out.scheduled_time = time.monotonic()
            req.out.num_prefix_hit_tokens = max(req.out.num_prefix_hit_tokens, admission.num_hit_tokens)
            if admission.restore_from is None:
                out.state_resets.append(req.cache.state_slot)
            else:
                out.state_copies.append((admission.restore_from, req.cache.state_slot))
            n = min(n, req.num_tokens - req.num_computed_tokens)
            self._add_chunk(out, req, n)
            budget -= n
        return out

    def schedule_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """Async scheduling (rule 5): the decode step after ``prev`` while prev's tokens are still on
        the device, or None when it could differ from what ``schedule`` will decide once they arrive.
        A request due to draft drafts ahead (``_draft_ahead``): its chunk verifies prev's token and drafts."""
        if self.config.uses_draft_model and any(self._may_draft(c.req) for c in prev.chunks):
            return None                                # a draft model drafts from prev's committed tokens
        if (self.waiting or len(prev.chunks) != len(self.running)
                or len(prev.chunks) > self.config.max_num_batched_tokens
                or any(not c.samples or c.draft or c.req.is_finished for c in prev.chunks)):
            return None
        budget = self.config.max_num_batched_tokens - len(prev.chunks)
        planned = []
        for c in prev.chunks:
            req, start = c.req, c.req.num_computed_tokens
            if req.num_output_tokens + 1 >= req.params.max_tokens or start + 1 >= self.config.max_model_len:
                continue                               # prev's token ends it
            if self.kv.checkpoint_boundaries(start, start + 1):
                return None                            # a checkpoint needs its block's hash
            guess = self._draft_ahead(req, budget) if self._may_draft(req) and not req.draft_pause else []
            if guess is None or not self.kv.allocate(req, len(guess) or 1):
                return None                            # a draft needs prev's token; or preemption
            budget -= max(len(guess) - 1, 0)
            planned.append((req, guess))
        out = SchedulerOutput()
        for req, guess in planned:
            slots = self.kv.take_spec_slots(len(guess) - 1) if guess else []
            self._add_chunk(out, req, 1 + len(slots), guess[1:1 + len(slots)], slots, input_pending=True)
            if slots:
                out.chunks[-1].guess = guess[0]
        for req in (c.req for c in out.chunks if self._may_draft(c.req) and c.req.draft_pause):
            req.draft_pause -= 1                       # a decode step without drafts, as ``_draft`` counts them
        for c in out.chunks:     # prev ran on a verify step's snapshot (``schedule_past_rejection``): copy it back
            self.kv.take_rollback(c.req, out.state_copies)
        return out if out.chunks else None

    def _draft_ahead(self, req: Request, budget: int) -> list[int] | None:
        """[g, drafts..] for the step after ``req``'s pending token t, before t reaches the host: the n-gram
        lookup on the tokens before t proposes t's successor g and the tokens after it; the drafts are those
        after g (verified against the real t's continuation, so a wrong g only costs their rows; and it tells
        the engine to expect their rejection, ``schedule_past_rejection``). Nothing found ([]): a pause, as
        after ``_draft``'s empty lookup. A watching request (``_watching``) only records the guess as its
        prediction of t. None (wait for t): a request whose grammar must accept the drafts (its matcher has not
        seen t), unless no draft can follow any t (``may_propose_after``)."""
        cfg = self.config
        if req.matcher is not None and not speculative.is_watching(req):
            if may_propose_after(req.token_ids, cfg.speculative_ngram_min, token_bytes(req)):
                return None
            req.draft_pause = EMPTY_DRAFT_PAUSE + 1
            return []
        k = self._draft_room(req, budget + 1, 1)
        guess = propose_ngram(req.token_ids, k + 1, cfg.speculative_ngram_min, cfg.speculative_ngram_max,
                              data=token_bytes(req), follow=2) if k >= 1 else []
        if self._watching(req, guess[0] if guess else None):
            if not guess:
                req.draft_pause = max(req.draft_pause, EMPTY_DRAFT_PAUSE)
            if req.draft_pause:
                req.draft_pause += 1                   # schedule_ahead counts this step too
            return []
        if req.matcher is not None:      # its watch just ended: the grammar must see t before drafts
            return None
        if len(guess) < 2:
            req.draft_pause = EMPTY_DRAFT_PAUSE + 1
            return []
        return guess

    def schedule_past_rejection(self, verify: SchedulerOutput) -> SchedulerOutput | None:
        """Async scheduling with speculation (rule 6): the decode step after ``verify`` (a step with drafts)
        launched before its drafts are settled, as if every draft is rejected: each request's next position,
        its input the verify's first-row token (on the device), run on the verify's snapshot after that row
        (``ScheduledChunk.state_slot``), so the live state and the other snapshots stay for any other outcome.
        Only where rejection is expected and the step is what ``schedule`` would then decide: every running
        request is in ``verify`` with drafts that are expected to fail (drafted ahead on a successor guess the
        real input token proved wrong; else its last verify accepted none, ``draft_misses``: only with watching
        off, ``speculative.WATCH_HITS`` = 0, as a watching request drafts after right predictions), it samples plain
        greedy without controls and the verify's token does not end it; no request waits; no prefix
        checkpoint at the new position. Else None. The engine keeps the chunks whose drafts were all rejected.
        (Called once the verify's input tokens are on the host.) Never with a draft model: its drafts follow the
        verify's committed tokens."""
        if self.waiting or len(verify.chunks) != len(self.running) or self.config.uses_draft_model:
            return None
        out = SchedulerOutput()
        for c in verify.chunks:
            req, start = c.req, c.start + 1
            p = req.params
            expect_rejection = req.draft_misses if c.guess is None else c.guess != req.token_ids[c.start]
            if (not c.draft or not c.samples or not expect_rejection or not is_plain_greedy(p) or p.has_controls
                    or req.matcher is not None or req.num_output_tokens + 1 >= p.max_tokens
                    or start + 1 >= self.config.max_model_len or self.kv.checkpoint_boundaries(start, start + 1)):
                return None
            out.chunks.append(ScheduledChunk(req, 1, start, input_pending=True, state_slot=c.spec_slots[0]))
        return out

    def _may_draft(self, req: Request) -> bool:
        return bool(self.config.num_speculative_tokens) and can_speculate(req.params)

    @staticmethod
    def _blocked(req: Request) -> bool:
        """Siblings of an n > 1 request wait until the first has computed the shared prompt."""
        first = req.wait_for
        return first is not None and not first.is_finished and first.num_computed_tokens < first.num_prompt_tokens

    def _draft(self, req: Request, budget: int) -> list[int]:
        """N-gram draft tokens for a decode step of ``req`` (``_draft_room``; ``schedule`` trims them to the
        free snapshot slots)."""
        cfg = self.config
        if not self._may_draft(req):
            return []
        if req.draft_pause:               # after an empty lookup, or a wrong watched prediction (``_watching``)
            req.draft_pause -= 1
            return []
        if cfg.uses_draft_model:          # the draft model's proposal from the last step (``draft_model.py``)
            draft, req.spec_proposal = req.spec_proposal[:self._draft_room(req, budget, 0)], []
            return draft[:req.matcher.valid_prefix(draft)] if draft and req.matcher is not None else draft
        draft = propose_ngram(req.token_ids, self._draft_room(req, budget, 0), cfg.speculative_ngram_min,
                              cfg.speculative_ngram_max, data=token_bytes(req))
        watching = self._watching(req, draft[0] if draft else None)
        if draft and req.matcher is not None and not watching:   # only drafts the grammar accepts (the rest
            draft = draft[:req.matcher.valid_prefix(draft)]       # would be rejected)
        if not draft and cfg.async_scheduling:
            req.draft_pause = max(req.draft_pause, EMPTY_DRAFT_PAUSE)
        return [] if watching else draft

    @staticmethod
    def _watching(req: Request, prediction: int | None) -> bool:
        """True while ``req`` watches instead of drafting (its last verify accepted no draft;
        ``speculative.WATCH_HITS``). Scores its last watched prediction if the token it predicted is the one
        that just came: a miss pauses its lookups (``speculative.watch_pause``: a request whose predictions
        keep failing looks up as seldom as the old probes did, and its host work stays bounded on long
        contexts); otherwise it watches ``prediction`` (the lookup's first token: its guess of token
        ``num_tokens``). WATCH_HITS right predictions in a row end the watch, and this lookup's drafts go to
        the device."""
        if not speculative.is_watching(req):
            return False
        last, req.draft_watch = req.draft_watch, None
        if last is not None and last[0] == req.num_tokens - 1:      # the token it predicted has come
            if last[1] != req.token_ids[-1]:
                req.draft_streak = 0
                req.draft_misses += 1
                req.draft_pause = speculative.watch_pause(req.draft_misses)
                return True
            req.draft_streak += 1
        if req.draft_streak >= speculative.WATCH_HITS:
            req.draft_misses = req.draft_streak = 0
            return False
        if prediction is not None:
            req.draft_watch = (req.num_tokens, prediction)
        return True

    def _draft_room(self, req: Request, budget: int, pending: int) -> int:
        """Most drafts ``req``'s next decode chunk may carry: within ``budget`` tokens (its input included),
        max_tokens, max_model_len and short of the next checkpoint boundary (a checkpoint inside the drafts
        would need a hash of unconfirmed tokens). ``pending``: tokens sampled but not yet on the host (1 when
        drafting ahead of the previous token; the chunk's input is at num_computed_tokens either way)."""
        cfg = self.config
        k = min(cfg.num_speculative_tokens, req.draft_limit, budget - 1,
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
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.out.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput) -> None:
        """After the step ran: advance computed counts, register cached blocks and checkpoints."""
        for chunk in out.chunks:
            chunk.req.num_computed_tokens = chunk.start + chunk.num_tokens - len(chunk.draft) + chunk.num_accepted
            self.kv.cache_blocks(chunk.req)
        for ck, h in zip(out.checkpoints, out.checkpoint_hashes):
            if h is not None:                           # None: a speculative snapshot (speculative.py's)
                self.kv.commit_checkpoint(h, ck.slot)

    def finish(self, req: Request, reason: str) -> None:
        """Finish or abort a request now: its memory is freed immediately."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
