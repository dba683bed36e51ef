"""The drafter interface: what the scheduler and the engine ask of a speculative-decoding proposer.

A ``Drafter`` proposes draft tokens for a request's decode steps and alone owns the request's draft state
(``Request.spec``: whatever object the drafter keeps there; nothing outside engine/spec/ reads or writes
it). The scheduler computes the *room* (how many drafts a step of the request may carry: the step's token
budget, ``num_speculative_tokens``, ``max_tokens``, ``max_model_len``, the next prefix checkpoint) and
asks the drafter for at most that many; it then reserves the KDA snapshot slots, schedules the verify
chunk, and after verification (``verify.py``) keeps the snapshot of the last accepted row (the target's
rollback). The drafter is told how many drafts were accepted (``settle``) and rolls back its own state.

The calls, in the order a request meets them:
- ``may_draft(req)``: whether ``req`` ever drafts (the default: every request; a request with penalties too:
  ``verify.penalised`` penalises each verify row over the drafts before it). Requests that may not decode one
  token per step.
- ``proposes(req)``: whether ``propose`` may give ``req`` drafts for its next decode step; where False the
  scheduler neither computes its room nor calls ``propose`` (default True: a drafter that keeps per-step
  bookkeeping in ``propose``, n-gram's, is always asked).
- ``propose(req, room)``: the drafts for ``req``'s next decode step, after its last token (<= room; [] for a
  plain decode step). Called once per decode step of a request that may draft and ``proposes``, with room >= 0.
- ``propose_ahead(req, room)``: async scheduling (``Scheduler.schedule_ahead``), only where ``drafts_ahead``:
  the step after ``req``'s pending token t (sampled, still on the device) is being planned. Returns []
  (no drafts), None (wait for t: the step is not scheduled ahead), or [g, d_1 .. d_j] (j <= room): g a guess
  of t, the d's the drafts after it (verified against the real t's continuation; a wrong g costs only their
  rows). A drafter without ``drafts_ahead`` keeps its requests' steps from being scheduled ahead.
- ``ahead_scheduled(req)``: the step planned by ``propose_ahead`` for ``req`` is certain (every request of it
  was planned); bookkeeping that must only count steps that run goes here.
- ``expects_rejection(req)``: for a verify step of ``req`` whose drafts follow its real input token: whether
  every draft is expected to fail, so async scheduling launches the next step as if they do
  (``Scheduler.schedule_past_rejection``). Default False.
- ``settle(req, draft, num_accepted)``: the verify step of ``draft`` accepted its first ``num_accepted``
  (before the step's tokens are appended): the drafter rolls its own state back to the accepted prefix.
- ``observe(out, states)``: a step is committed (drafts settled, tokens appended): ``states`` are the
  target's hidden states at the entry of the ``aux_layers`` of every packed row of ``out`` ([T, n * D],
  ``KimiForCausalLM.forward_step(aux_layers=...)``; a CUDA graph step's: a view of the graphs' fixed buffer, valid
  until the next step launches), None when ``aux_layers`` is empty. A draft model catches its cache up and prepares the next step's drafts here.
- ``release(req)``: ``req`` leaves the running set (finished, aborted or preempted and later recomputed):
  give back what the drafter holds for it. Default: nothing held.

A drafter with ``aux_layers`` runs in one process; the runner keeps those states of every target step, eager or
a decode / verify CUDA graph (``cuda_graphs.DecodeGraphs.aux_states``). A new drafter is a subclass in engine/spec/ plus a branch in
``drafters.make_drafter``: n-gram (``ngram.py``) and the draft models (``draft_model.py``: Eagle3, MTP,
DFlash/DSpark) are the two there now.
"""

from __future__ import annotations

from kimik3.engine.config import EngineConfig


# A verify step that accepted none pauses the request's drafts (n-gram: its lookups while it watches; a draft
# model: its proposals): 4, 16, 64, then MAX_WATCH_PAUSE decode steps as its misses in a row grow. Each n-gram
# lookup scans the request's history (about 3 us per 1k tokens here: 0.1 ms at 32k, which a batch of 128 pays
# per step), so a request whose predictions keep failing looks up as seldom as device probes once did.
WATCH_PAUSE_BASE = 4
MAX_WATCH_PAUSE = 128


def watch_pause(misses: int) -> int:
    """Decode steps a request skips drafting after a failed verify or wrong prediction; ``misses``: its failed
    verify steps and wrong predictions in a row (n-gram: 2 at the first wrong prediction)."""
    return min(WATCH_PAUSE_BASE ** (misses - 1), MAX_WATCH_PAUSE)


class Drafter:
    """Base class of the drafters (module docstring: the calls and their order). ``propose`` is required."""

    aux_layers: tuple[int, ...] = ()    # target layers whose states ``observe`` reads (the runner keeps them)
    drafts_ahead: bool = False          # whether ``propose_ahead`` may draft before the previous token is known

    def __init__(self, config: EngineConfig):
        self.config = config

    def may_draft(self, req) -> bool:
        return True

    def proposes(self, req) -> bool:
        return True

    def propose(self, req, room: int) -> list[int]:
        raise NotImplementedError(f"{type(self).__name__} must implement propose(req, room)")

    def propose_ahead(self, req, room: int) -> list[int] | None:
        return None

    def ahead_scheduled(self, req) -> None:
        pass

    def expects_rejection(self, req) -> bool:
        return False

    def settle(self, req, draft: list[int], num_accepted: int) -> None:
        pass

    def observe(self, out, states) -> None:
        pass

    def pending_drafts(self):
        """After each step is scheduled: a ``device_drafts.DeviceDrafts`` where its drafts are placeholders for
        tokens still on the device (``draft_model.py``), else None (the default)."""
        return None

    def release(self, req) -> None:
        pass

