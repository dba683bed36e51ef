"""What the scheduler hands the runner each step (the scheduler -> runner contract): the chunks to
compute, the KDA state copies, resets and checkpoints to take, the requests admitted and preempted (their
metrics are the output path's to write, ``output.record_scheduling``). The engine writes back each chunk's
accepted drafts (``Scheduler.settle_drafts``: ``num_accepted``) before ``Scheduler.update`` reads them. And
``StepError``: what a step whose forward raised turns into."""

from __future__ import annotations

from dataclasses import dataclass, field

from kimik3.engine.core.request import Request
from kimik3.model.batch import StateCheckpoint


@dataclass(slots=True)
class ScheduledChunk:
    req: Request
    num_tokens: int          # new tokens computed this step, starting at req.num_computed_tokens (drafts included)
    start: int               # req.num_computed_tokens when scheduled
    draft: list[int] = field(default_factory=list)       # speculative tokens after the request's last token
    spec_slots: list[int] = field(default_factory=list)  # snapshot slot after row j + 1, per draft token j
    num_accepted: int = 0    # drafts the step accepted (set by the engine before ``Scheduler.update``)
    input_pending: bool = False   # async: the input token is the previous step's sample, not yet on the host
    state_slot: int | None = None  # KDA state slot it runs on when not the request's live one (a step launched
    #                                before its verify step's drafts are settled runs on the verify's first snapshot)
    guess: int | None = None      # drafted ahead: the input token its drafts assume (the real one is pending)
    samples: bool = field(init=False)   # reaches the request's last token (as scheduled): its last row samples

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens - len(self.draft) == self.req.num_tokens + self.input_pending

    @classmethod
    def decode(cls, req: Request, start: int) -> ScheduledChunk:
        """An async-scheduled decode chunk: one token at ``start``, the previous step's pending sample (what
        ``ScheduledChunk(req, 1, start, input_pending=True)`` gives, built field by field: a large batch's
        step makes one a request)."""
        c = cls.__new__(cls)
        c.req, c.num_tokens, c.start, c.draft, c.spec_slots, c.num_accepted = req, 1, start, [], [], 0
        c.input_pending, c.state_slot, c.guess = True, None, None
        c.samples = start == len(req.token_ids)
        return c


@dataclass
class SchedulerOutput:
    """What runs this step."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)   # (checkpoint slot, live slot) before the step
    state_resets: list[int] = field(default_factory=list)               # live slots to zero before the step
    checkpoints: list[StateCheckpoint] = field(default_factory=list)    # seq = index into chunks
    checkpoint_hashes: list[bytes | None] = field(default_factory=list)  # block hash per checkpoint; None: speculative
    preempted: list[Request] = field(default_factory=list)
    draft_states: object = None        # the target's states a draft model reads, [T, n * D] (runner)
    pending_drafts: object = None      # ``spec/device_drafts.DeviceDrafts``: drafts still on the device
    admitted: list[tuple[Request, int]] = field(default_factory=list)  # (request, its prefix-hit tokens)
    # every chunk a ``ScheduledChunk.decode`` (one pending token each, past its prompt) and no checkpoint or state
    # op: the batch builder and sampler need not check the chunks one by one (``Scheduler.schedule_ahead``)
    plain_decode: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class StepError(RuntimeError):
    """A step's forward raised. ``request_ids``: the requests (their user ids) in that step's batch,
    the only ones whose data can have caused it; the engine itself is consistent afterwards."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"engine step over request(s) {request_ids} failed: {type(cause).__name__}: {cause}")
        self.request_ids = request_ids
