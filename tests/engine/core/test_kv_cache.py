"""Block allocator, prefix cache and memory planner invariants (hypothesis state machine)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kimik3.engine import SamplingParams, plan_memory
from kimik3.engine.core.block_pool import BlockPool
from kimik3.engine.core.kv_cache import KVCacheManager
from kimik3.engine.core.memory import MemoryPlan
from kimik3.engine.core.request import Request
from kimik3.model.batch import HybridCache
from tests.engine.fake_model import fake_config
from tests.engine.helpers import check_invariants

BS = 2


class CacheMachine(RuleBasedStateMachine):
    """Admit / grow / compute / free requests with prompts over a tiny alphabet (so prefixes collide);
    after every rule: ref counts exact, nothing leaked or double-freed, hits only where states exist."""

    def __init__(self):
        super().__init__()
        plan = MemoryPlan(block_size=BS, num_blocks=12, num_slots=1 + 3 + 3, num_live_slots=3, num_checkpoint_slots=3,
                          checkpoint_interval=1, bytes_per_block=1, bytes_per_slot=1, budget_bytes=1 << 20)
        self.kv = KVCacheManager(plan, enable_prefix_caching=True)
        self.running: list[Request] = []
        self.n = 0

    @precondition(lambda self: len(self.running) < 3)
    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=9), chunk=st.integers(1, 9))
    def admit(self, tokens, chunk):
        self.n += 1
        req = Request(f"r{self.n}", tokens, SamplingParams(), 0.0, block_size=BS)
        before = self.kv.blocks.num_free
        adm = self.kv.admit(req, chunk)
        if adm is None:
            assert self.kv.blocks.num_free == before and not req.cache.block_ids
            return
        assert adm.num_hit_tokens % BS == 0 and adm.num_hit_tokens < req.num_tokens
        if adm.num_hit_tokens:
            event("prefix hit")
            assert adm.restore_from in self.kv.checkpoints.values()
        req.pending = min(chunk, req.num_tokens - req.num_computed_tokens)
        self.running.append(req)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 2), checkpoint=st.booleans())
    def compute(self, i, checkpoint):
        """The step ran: the pending chunk is computed, blocks are registered, checkpoints committed."""
        req = self.running[i % len(self.running)]
        start, n = req.num_computed_tokens, getattr(req, "pending", 0)
        taken = []
        if checkpoint:
            for j in self.kv.checkpoint_boundaries(start, start + n):
                slot = self.kv.take_checkpoint_slot(req.block_hashes[j - 1])
                if slot is not None:
                    taken.append((req.block_hashes[j - 1], slot))
        req.num_computed_tokens = start + n
        req.pending = 0
        self.kv.cache_blocks(req)
        for h, slot in taken:
            self.kv.commit_checkpoint(h, slot)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 2), n=st.integers(1, 5), new_token=st.integers(0, 1))
    def grow(self, i, n, new_token):
        req = self.running[i % len(self.running)]
        if req.pending == 0 and req.num_computed_tokens == req.num_tokens:
            req.append_token(new_token)          # a decode step sampled a token
        n = min(n, req.num_tokens - req.num_computed_tokens - req.pending)
        if n > 0:
            held = list(req.cache.block_ids)
            before = self.kv.blocks.num_free
            if self.kv.allocate(req, req.pending + n):
                req.pending += n
            else:
                assert req.cache.block_ids == held and self.kv.blocks.num_free == before

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 2))
    def free(self, i):
        req = self.running.pop(i % len(self.running))
        self.kv.free(req)

    @invariant()
    def consistent(self):
        check_invariants(self.kv, self.running)
        for r in self.running:
            assert len(r.cache.block_ids) * BS >= r.num_computed_tokens + r.pending


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_block_pool_lru_and_reuse():
    pool = BlockPool(5)
    a = [pool.allocate() for _ in range(3)]
    pool.cache(a[0], b"h0")
    pool.cache(a[1], b"h1")
    pool.release(a)                           # tail first: a[2] is evicted first, a[0] last
    assert list(pool.free) == [4, a[2], a[1], a[0]]
    pool.take(pool.lookup(b"h0"))
    assert pool.ref_counts[a[0]] == 1 and a[0] not in pool.free
    got = [pool.allocate() for _ in range(3)]
    assert got == [4, a[2], a[1]] and pool.lookup(b"h1") is None and pool.lookup(b"h0") == a[0]
    with pytest.raises(AssertionError, match="released more often"):
        pool.release([a[1], a[1]])


@pytest.mark.parametrize("interval", [None, 1, 3])
@pytest.mark.parametrize("budget", [2_000, 10_000, 123_457])
def test_plan_stays_within_budget(interval, budget):
    text = fake_config().text
    plan = plan_memory(text, budget, block_size=4, max_num_seqs=3, checkpoint_interval=interval, dtype=torch.float32)
    per_slot = HybridCache.bytes_per_slot(text, torch.float32)
    per_block = HybridCache.bytes_per_block(text, 4, torch.float32)
    assert plan.total_bytes <= budget
    assert budget - plan.total_bytes < per_block + per_slot * (interval or 1) + per_block * (interval or 1)
    assert plan.num_live_slots == 3 and plan.num_slots == 4 + plan.num_checkpoint_slots
    if interval:
        assert plan.num_checkpoint_slots == plan.num_usable_blocks // interval
    else:
        assert plan.num_checkpoint_slots == 0
    assert "latent tokens" in plan.describe()


def test_plan_errors_name_the_fix():
    text = fake_config().text
    with pytest.raises(ValueError, match="cannot hold 8 sequence states.*lower max_num_seqs"):
        plan_memory(text, 100, block_size=4, max_num_seqs=8, checkpoint_interval=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="kda_checkpoint_interval must be >= 1"):
        plan_memory(text, 10_000, block_size=4, max_num_seqs=1, checkpoint_interval=0, dtype=torch.float32)


def test_engine_rejects_a_cache_too_small_for_max_model_len():
    from tests.engine.fake_model import FakeModel
    from tests.engine.helpers import budget_for
    from kimik3.engine import EngineConfig, LLMEngine
    model = FakeModel()
    cfg = EngineConfig(block_size=4, max_num_seqs=2, max_model_len=100, kda_checkpoint_interval=1,
                       cache_memory_bytes=budget_for(model, 4, 2, 10, 1))
    with pytest.raises(ValueError, match="max_model_len=100 needs 25 cache blocks.*raise cache_memory_bytes"):
        LLMEngine(model, cfg)


def test_reset_prefix_cache():
    plan = MemoryPlan(block_size=BS, num_blocks=6, num_slots=4, num_live_slots=1, num_checkpoint_slots=2,
                      checkpoint_interval=1, bytes_per_block=1, bytes_per_slot=1, budget_bytes=1 << 20)
    kv = KVCacheManager(plan, enable_prefix_caching=True)
    req = Request("a", [1, 2, 3, 4, 5], SamplingParams(), 0.0, block_size=BS)
    kv.admit(req, 5)
    slot = kv.take_checkpoint_slot(req.block_hashes[1])
    req.num_computed_tokens = 5
    kv.cache_blocks(req)
    kv.commit_checkpoint(req.block_hashes[1], slot)
    assert not kv.reset_prefix_cache()           # blocks still held
    kv.free(req)
    assert kv.reset_prefix_cache()
    check_invariants(kv, [])
    assert not kv.blocks.cached and not kv.checkpoints and len(kv.free_checkpoint_slots) == 2


def test_plan_counts_whole_sequences_of_a_length():
    """sequences_of: the latent blocks of full sequences (null block aside), capped by the live states."""
    from kimik3.engine.core.memory import MemoryPlan
    plan = MemoryPlan(block_size=16, num_blocks=1 + 10 * 64 + 5, num_slots=9, num_live_slots=8, num_checkpoint_slots=0,
                      checkpoint_interval=None, bytes_per_block=1, bytes_per_slot=1, budget_bytes=1 << 20)
    assert plan.sequences_of(1024) == 8                 # 10 fit in the blocks, 8 states
    assert plan.sequences_of(2048) == 5                 # 645 usable blocks // 128 blocks per sequence
    assert plan.sequences_of(10 * 1024 * 1024) == 0


def test_requests_admitted_together_get_consecutive_ascending_live_slots():
    """Whatever order earlier requests finished in, a batch admitted together holds the lowest free live slots in
    ascending order (so a CPU decode step updates its KDA states in place: ``ops/pool_rows.slot_range``)."""
    plan = MemoryPlan(block_size=BS, num_blocks=40, num_slots=1 + 6, num_live_slots=6, num_checkpoint_slots=0,
                      checkpoint_interval=1, bytes_per_block=1, bytes_per_slot=1, budget_bytes=1 << 20)
    kv = KVCacheManager(plan, enable_prefix_caching=False)

    def admit(n, tag):
        reqs = [Request(f"{tag}{i}", [1, 2, 3], SamplingParams(), 0.0, block_size=BS) for i in range(n)]
        assert all(kv.admit(r, 3) is not None for r in reqs)
        return reqs

    first = admit(5, "a")
    assert [r.cache.state_slot for r in first] == [1, 2, 3, 4, 5]
    for i in (3, 0, 4, 1):                 # finish out of order; slot 3 (first[2]) stays held
        kv.free(first[i])
    assert [r.cache.state_slot for r in admit(4, "b")] == [1, 2, 4, 5]
    kv.free(first[2])
    assert [r.cache.state_slot for r in admit(2, "c")] == [3, 6]
