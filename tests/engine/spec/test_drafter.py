"""The ``Drafter`` interface (engine/spec/drafter.py) through the engine: a drafter written against the interface
alone (no n-gram, no draft model) drives speculative decoding; the scheduler keeps its proposals within the room
it computes and calls the hooks in the documented order; the tokens stay plain greedy's."""

from __future__ import annotations

import pytest

from kimik3.engine import EngineConfig, SamplingParams
from kimik3.engine.spec.drafter import Drafter
from tests.engine.fake_model import FakeModel, reference_greedy
from tests.engine.helpers import check_invariants, make_engine, run


class KnownFuture(Drafter):
    """Proposes a request's known greedy continuation, its second draft corrupted on every third call."""

    def __init__(self, config: EngineConfig, futures: dict[tuple[int, ...], list[int]], vocab: int):
        super().__init__(config)
        self.futures, self.vocab = futures, vocab
        self.calls: list[tuple[str, str, int]] = []     # (hook, request id, number)

    def propose(self, req, room: int) -> list[int]:
        prompt = next(p for p in self.futures if tuple(req.token_ids[:len(p)]) == p)
        done = req.num_tokens - len(prompt)
        draft = list(self.futures[prompt][done:done + room])
        if len(self.calls) % 3 == 2 and len(draft) > 1:
            draft[1] = (draft[1] + 1) % self.vocab
        self.calls.append(("propose", req.request_id, room))
        assert req.spec is None                       # nothing else writes the drafter's state
        return draft

    def settle(self, req, draft: list[int], num_accepted: int) -> None:
        assert 0 <= num_accepted <= len(draft)
        self.calls.append(("settle", req.request_id, num_accepted))

    def release(self, req) -> None:
        self.calls.append(("release", req.request_id, 0))


@pytest.mark.parametrize("budget", [64, 6], ids=["room", "tight-budget"])
def test_a_drafter_written_against_the_interface_drives_speculation(budget):
    model = FakeModel()
    prompts = {"a": [3, 1, 4, 1, 5], "b": [9, 2, 6]}
    max_tokens = {"a": 17, "b": 11}
    futures = {tuple(p): reference_greedy(model, p, max_tokens[r]) for r, p in prompts.items()}
    engine = make_engine(model, block_size=4, max_num_seqs=2, max_num_batched_tokens=budget, max_model_len=40,
                         extra_blocks=20, num_speculative_tokens=3, enable_prefix_caching=False)
    drafter = KnownFuture(engine.config, futures, model.config.text.vocab_size)
    engine.scheduler.drafter = drafter
    reqs = {r: (p, SamplingParams(temperature=0, max_tokens=max_tokens[r], ignore_eos=True)) for r, p in prompts.items()}
    out = run(engine, reqs, check=lambda e: check_invariants(e.kv, e.scheduler.running))
    for r, p in prompts.items():
        assert out[r][0][0] == futures[tuple(p)], r
    rooms = [n for hook, _, n in drafter.calls if hook == "propose"]
    assert max(rooms) == min(3, budget - 2) and min(rooms) >= 0     # num_speculative_tokens, or the step's budget
    settled = [n for hook, _, n in drafter.calls if hook == "settle"]
    assert engine.num_accepted_tokens == sum(settled) > 0
    assert engine.num_draft_tokens > engine.num_accepted_tokens            # the corrupted drafts were rejected
    assert sorted(r for hook, r, _ in drafter.calls if hook == "release") == ["a", "b"]
    check_invariants(engine.kv, [])


def test_the_base_drafter_names_what_a_drafter_must_implement():
    class Half(Drafter):
        pass
    with pytest.raises(NotImplementedError, match="Half must implement propose"):
        Half(EngineConfig()).propose(None, 1)
    d = Half(EngineConfig())
    assert d.propose_ahead(None, 1) is None and not d.drafts_ahead and not d.expects_rejection(None)
