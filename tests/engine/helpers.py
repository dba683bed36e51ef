"""Shared test helpers: build engines on a model, drive them, check cache-manager invariants."""

from __future__ import annotations

from collections import Counter

import torch

from kimik3.engine import EngineConfig, LLMEngine, SamplingParams
from kimik3.engine.core.kv_cache import KVCacheManager
from kimik3.engine.core.request import Request
from kimik3.model.batch import HybridCache, latent_cache_dtype
from kimik3.model.cuda_graphs import DecodeGraphs


def budget_for(model, block_size: int, max_num_seqs: int, num_blocks: int, interval: int | None,
               num_speculative_tokens: int = 0, kv_cache_dtype: str = "auto") -> int:
    """Bytes for which the planner gives at least ``num_blocks`` usable blocks (and their checkpoints)."""
    text, dtype = model.config.text, model.dtype
    slot = HybridCache.bytes_per_slot(text, dtype)
    block = HybridCache.bytes_per_block(text, block_size, dtype, latent_cache_dtype(kv_cache_dtype, dtype))
    checkpoints = -(-num_blocks // interval) if interval else 0
    spec = max_num_seqs * num_speculative_tokens
    return (1 + max_num_seqs + spec + checkpoints) * slot + (1 + num_blocks) * block


def make_engine(model, **kw) -> LLMEngine:
    """An engine whose cache holds one max_model_len sequence plus ``extra_blocks`` blocks."""
    extra_blocks = kw.pop("extra_blocks", None)
    tokenizer = kw.pop("tokenizer", None)
    kw.setdefault("kda_checkpoint_interval", 1)
    cfg = EngineConfig(**kw)
    if extra_blocks is not None:
        need = -(-cfg.max_model_len // cfg.block_size)
        interval = cfg.kda_checkpoint_interval if cfg.enable_prefix_caching else None
        cfg.cache_memory_bytes = budget_for(model, cfg.block_size, cfg.max_num_seqs, need + extra_blocks, interval,
                                            cfg.num_speculative_tokens, cfg.kv_cache_dtype)
    return LLMEngine(model, cfg, tokenizer=tokenizer)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]],
        arrivals: dict[int, list[str]] | None = None, aborts: dict[int, list[str]] | None = None,
        check=None, max_steps: int = 100_000) -> dict[str, list]:
    """Add requests (all at step 0, or per ``arrivals``), step to the end, collect per-sample token ids.

    Returns {request id: [CompletionOutput accumulated per sample index]} as lists of (token_ids, finish_reason).
    """
    arrivals = arrivals if arrivals is not None else {0: list(requests)}
    aborts = aborts or {}
    results: dict[str, dict[int, list]] = {}
    step = 0
    while step < max_steps:
        for rid in arrivals.get(step, []):
            engine.add_request(rid, {"prompt_token_ids": requests[rid][0]}, requests[rid][1])
        for rid in aborts.get(step, []):
            engine.abort_request(rid)
        if not engine.has_unfinished_requests() and step >= max(list(arrivals) + list(aborts) + [0]):
            break
        for delta in engine.step():
            per = results.setdefault(delta.request_id, {})
            for c in delta.outputs:
                acc = per.setdefault(c.index, [[], None, []])
                acc[0].extend(c.token_ids)
                acc[1] = c.finish_reason
                if c.logprobs:
                    acc[2].extend(c.logprobs)
        if check is not None:
            check(engine)
        step += 1
    assert step < max_steps, "engine did not finish"
    return {rid: [per[i] for i in sorted(per)] for rid, per in results.items()}


def check_invariants(kv: KVCacheManager, running: list[Request], pending_checkpoints: int = 0) -> None:
    """No block leaked or double-freed, ref counts exact, slots accounted for."""
    pool = kv.blocks
    holders = Counter(b for r in running for b in r.cache.block_ids)
    assert 0 not in holders, "the null block was handed out"
    for b in range(1, pool.num_blocks):
        assert pool.ref_counts[b] == holders.get(b, 0), f"block {b}: ref {pool.ref_counts[b]}, held {holders.get(b, 0)}"
        assert (b in pool.free) == (pool.ref_counts[b] == 0), f"block {b} free-list membership wrong"
    assert 0 not in pool.free and pool.ref_counts[0] == 0
    for h, b in pool.cached.items():
        assert pool.block_hashes[b] == h
    for r in running:
        held = r.cache
        assert len(set(held.block_ids)) == len(held.block_ids), "a request holds a block twice"
        for i in range(held.num_cached_blocks):
            assert (pool.cached.get(r.block_hashes[i]) == held.block_ids[i]
                    or pool.block_hashes[held.block_ids[i]] is None)
    live = [r.cache.state_slot for r in running]
    assert 0 not in live and len(set(live)) == len(live)
    assert sorted(live + kv.free_live_slots) == list(range(1, kv.plan.num_live_slots + 1))
    first_ck = kv.plan.num_live_slots + kv.plan.num_spec_slots + 1
    spec = [r.cache.rollback_slot for r in running if r.cache.rollback_slot is not None] + kv.free_spec_slots
    assert sorted(spec) == list(range(kv.plan.num_live_slots + 1, first_ck)), "speculative slots leaked"
    ck = list(kv.checkpoints.values())
    assert all(h in pool.cached for h in kv.checkpoints), "a checkpoint outlived its block"
    all_ck = list(range(first_ck, kv.plan.num_slots))
    assert len(ck) + len(kv.free_checkpoint_slots) + pending_checkpoints == len(all_ck)
    assert set(ck).isdisjoint(kv.free_checkpoint_slots) and set(ck + kv.free_checkpoint_slots) <= set(all_ck)
    assert kv.plan.total_bytes <= kv.plan.budget_bytes


def oracle_requests(model, monkeypatch, seed: int) -> tuple[dict, dict[tuple[int, ...], list[int]]]:
    """Three greedy requests of 12 tokens on random prompts of 5, 9 and 13 tokens, with
    ``propose_ngram`` replaced by ``oracle_proposer`` over their continuations (the model called
    directly): (requests, continuation by prompt)."""
    import random

    import kimik3.engine.spec.ngram as ngram
    from tests.engine.fake_model import reference_greedy
    rng = random.Random(seed)
    vocab = model.config.text.vocab_size
    reqs = {f"r{i}": ([rng.randrange(5, vocab) for _ in range(5 + 4 * i)],
                      SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) for i in range(3)}
    futures = {tuple(p): reference_greedy(model, p, sp.max_tokens) for p, sp in reqs.values()}
    monkeypatch.setattr(ngram, "propose_ngram", oracle_proposer(futures, vocab))
    return reqs, futures


def turn_async(engine) -> None:
    """Switch an idle engine to async scheduling (a test compares one engine's sync and async runs)."""
    from kimik3.engine.core.async_pipeline import AsyncPipeline
    assert not engine.has_unfinished_requests()
    engine.config.async_scheduling = True
    engine.pipeline = AsyncPipeline(engine)


def oracle_proposer(futures: dict[tuple[int, ...], list[int]], vocab: int):
    """A stand-in for ``propose_ngram`` whose drafts are a request's known continuation (``futures``:
    prompt -> its plain-decoding tokens), every other step with the second draft corrupted, so
    verify steps see accepted runs, bonus tokens and rejections."""
    def propose(token_ids, k, min_n, max_n, data=None, follow=1):
        for prompt, tokens in futures.items():
            if tuple(token_ids[:len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                draft = list(tokens[done:done + k])
                if done % 2 and len(draft) > 1:
                    draft[1] = (draft[1] + 1) % vocab
                return draft
        raise AssertionError("drafts asked for an unknown request")
    return propose


class count_calls:
    """Wraps ``owner.name`` (an instance's method) to count the calls that returned something."""

    def __init__(self, owner, name: str):
        self.hits = 0
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            out = fn(*a, **k)
            self.hits += out is not None
            return out
        setattr(owner, name, wrapper)


class _EagerReplay:
    """Stands in for a captured graph: the same step, run eagerly, into a fixed output buffer."""

    def __init__(self, graphs: DecodeGraphs, size: int, L: int, vocab: int, seen: list):
        self.graphs, self.size, self.L, self.seen = graphs, size, L, seen
        self.out = torch.empty(size * L, vocab, dtype=torch.promote_types(graphs.model.dtype, torch.float32))

    def replay(self):
        cache = self.graphs.cache
        before = (cache.kda_conv.clone(), cache.kda_state.clone(), cache.mla_latent.clone())
        logits = self.graphs.step(self.size, self.L)  # None on a tensor-parallel worker (rank 0 gets them)
        if logits is not None:
            self.out.copy_(logits)
        self.graphs.replayed.append((self.size, self.L))
        meta = self.graphs.meta[:, :self.size * self.L]
        self.seen.append((meta.clone(), before, (cache.kda_conv.clone(), cache.kda_state.clone(), cache.mla_latent.clone())))


class EagerReplayGraphs(DecodeGraphs):
    """DecodeGraphs whose capture makes eager stand-ins (CPU)."""

    def capture(self) -> None:
        self.seen: list = []
        self.replayed: list[tuple[int, int]] = []      # (size, query length) of each replay
        vocab = self.model.config.text.vocab_size
        for size, L in self.batches:
            replay = _EagerReplay(self, size, L, vocab, self.seen)
            self.graphs[size, L] = (replay, replay.out)


class VerifyFailingGraphs(EagerReplayGraphs):
    """Decode steps capture; verify steps cannot (a kernel of the short path that does not capture)."""

    def capture(self) -> None:
        super().capture()
        if self.max_query_len > 1:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


class FailingGraphs(DecodeGraphs):
    """A model that cannot be captured (e.g. a host sync inside a decode step)."""

    def capture(self) -> None:
        self.graphs[1, 1] = ("half-captured", None)
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore detail")
