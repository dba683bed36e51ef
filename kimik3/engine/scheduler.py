"""Scheduler: each step, hand out a token budget so every request's computed tokens catch up.

Rules, in order, per step (budget = ``max_num_batched_tokens``):
1. Running requests, oldest first, take what they still lack (1 for a decode, a chunk for a prefill).
   If the cache cannot grow, the newest running request is preempted (freed, recomputed later,
   first in line) until it can; a request never disappears.
2. Waiting requests, first come first served, are admitted while budget, ``max_num_seqs`` and
   cache allow; a long prompt gets a chunk and continues next step. A prefix hit skips the cached
   part. Nothing is admitted in a step that preempted (the cache is short already). The samples
   2..n of an n > 1 request wait until sample 1 has computed the prompt, then hit its blocks.
3. Chunks that cross a KDA checkpoint boundary ask the model for a state snapshot there.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kimik3.engine.kv_cache import KVCacheManager
from kimik3.engine.request import Request, RequestStatus
from kimik3.model.batch import StateCheckpoint


@dataclass
class ScheduledChunk:
    req: Request
    num_tokens: int          # new tokens computed this step, starting at req.num_computed_tokens
    start: int               # req.num_computed_tokens when scheduled
    # the chunk reaches the request's last token (as scheduled), so its last row gives the next token
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens == self.req.num_tokens


@dataclass
class SchedulerOutput:
    """What runs this step (the scheduler -> runner contract)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)   # (checkpoint slot, live slot) before the step
    state_resets: list[int] = field(default_factory=list)               # live slots to zero before the step
    checkpoints: list[StateCheckpoint] = field(default_factory=list)    # seq = index into chunks
    checkpoint_hashes: list[bytes] = field(default_factory=list)        # block hash of each checkpoint
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                self._add_chunk(out, req, n)
                budget -= n
                i += 1
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if self._blocked(req):
                break
            n = min(req.num_tokens, budget)
            admission = self.kv.admit(req, n)
            if admission is None:
                break
            self.waiting.popleft()
            req.wait_for = None
            req.status = RequestStatus.RUNNING
            req.num_prefix_hit_tokens = max(req.num_prefix_hit_tokens, admission.num_hit_tokens)
            self.running.append(req)
            if admission.restore_from is None:
                out.state_resets.append(req.state_slot)
            else:
                out.state_copies.append((admission.restore_from, req.state_slot))
            n = min(n, req.num_tokens - req.num_computed_tokens)
            self._add_chunk(out, req, n)
            budget -= n
        return out

    @staticmethod
    def _blocked(req: Request) -> bool:
        """Siblings of an n > 1 request wait until the first has computed the shared prompt."""
        first = req.wait_for
        return (first is not None and not first.is_finished
                and first.num_computed_tokens < first.num_prompt_tokens)

    def _add_chunk(self, out: SchedulerOutput, req: Request, n: int) -> None:
        start = req.num_computed_tokens
        seq = len(out.chunks)
        out.chunks.append(ScheduledChunk(req, n, start))
        for j in self.kv.checkpoint_boundaries(start, start + n):
            h = req.block_hashes[j - 1]
            slot = self.kv.take_checkpoint_slot(h)
            if slot is not None:
                out.checkpoints.append(StateCheckpoint(seq, j * self.kv.block_size - start, slot))
                out.checkpoint_hashes.append(h)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput) -> None:
        """After the step ran: advance computed counts, register cached blocks and checkpoints."""
        for chunk in out.chunks:
            chunk.req.num_computed_tokens = chunk.start + chunk.num_tokens
            self.kv.cache_blocks(chunk.req)
        for ck, h in zip(out.checkpoints, out.checkpoint_hashes):
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
