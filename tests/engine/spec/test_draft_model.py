"""Speculative decoding with a draft model (``engine/spec/draft_model.py``): greedy output identical to plain decoding in
every engine mode (chunked prefill, prefix hits, preemption, async scheduling), drafts accepted and rejected, the
per-request controller, the per-position counters, and the user-facing configuration."""

from __future__ import annotations

import math
import random

import pytest
import torch

import kimik3
from kimik3.engine import EngineArgs, EngineConfig, SamplingParams
from kimik3.engine.core.llm_engine import LLMEngine
from kimik3.engine.spec.controller import DraftController
from kimik3.engine.spec.draft_model import ModelDrafter
from kimik3.model.eagle3 import Eagle3Config, Eagle3Draft
from tests.engine.fake_model import reference_greedy
from tests.engine.helpers import budget_for, check_invariants, make_engine, run


@pytest.fixture(scope="module")
def target(tiny_ckpt):
    return kimik3.load_model(tiny_ckpt["kimi_k3"], dtype=torch.float32, language_model_only=True)


def random_eagle3(target, seed: int = 0) -> Eagle3Draft:
    text = target.config.text
    cfg = Eagle3Config(hidden_size=text.hidden_size, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                       intermediate_size=48, rms_norm_eps=1e-6, rope_theta=1000.0, vocab_size=text.vocab_size,
                       draft_vocab_size=text.vocab_size, target_hidden_size=text.hidden_size, aux_layer_ids=(1, 3, 6))
    m = Eagle3Draft(cfg)
    g = torch.Generator().manual_seed(seed)
    for p in m.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]) if p.dim() > 1 else torch.ones(p.shape))
    return m.eval()


def engine_with(target, k: int = 3, blocks: int | None = None, **kw) -> LLMEngine:
    kw.setdefault("kda_checkpoint_interval", 1)
    cfg = EngineConfig(num_speculative_tokens=k, speculative_method="eagle3", speculative_model="test", **kw)
    need = -(-cfg.max_model_len // cfg.block_size) + (blocks if blocks is not None else 8)
    interval = cfg.kda_checkpoint_interval if cfg.enable_prefix_caching else None
    draft = random_eagle3(target)
    cfg.cache_memory_bytes = budget_for(target, cfg.block_size, cfg.max_num_seqs, need, interval, k) + \
        (need + 2) * ModelDrafter.bytes_per_block(draft, cfg.block_size)     # the budget holds the draft's cache too
    return LLMEngine(target, cfg, draft=draft)


def oracle(monkeypatch, futures: dict[tuple[int, ...], list[int]], vocab: int) -> None:
    """Drafts replaced (after the draft model ran) by each request's known continuation, the second one corrupted
    every other step: verify steps see accepted runs, bonus tokens and rejections. (Host drafts: the next step
    waits for them, ``ModelDrafter._may_defer``.)"""
    monkeypatch.setattr(ModelDrafter, "_may_defer", staticmethod(lambda reqs, counts: False))
    hand_out = ModelDrafter._hand_out

    def patched(self, reqs, counts, drafts):
        hand_out(self, reqs, counts, drafts)
        for req in reqs:
            if not req.spec.proposal:
                continue
            prompt = next(p for p in futures if tuple(req.token_ids[:len(p)]) == p)
            done = req.num_tokens - len(prompt)
            d = list(futures[prompt][done:done + len(req.spec.proposal)])
            if done % 2 and len(d) > 1:
                d[1] = (d[1] + 1) % vocab
            req.spec.proposal = d
    monkeypatch.setattr(ModelDrafter, "_hand_out", patched)


def fixed_plan(monkeypatch) -> None:
    """Every request drafts all it may: the controller's plan follows measured step times, so two engines (or
    two runs) would otherwise draft differently."""
    monkeypatch.setattr(DraftController, "plan", lambda self, rates, rooms, batch, watching, costs=None: list(rooms))


def requests(target, seed: int, n: int = 3, shared: int = 0, max_tokens: int = 12):
    rng = random.Random(seed)
    vocab = target.config.text.vocab_size
    head = [rng.randrange(5, vocab) for _ in range(shared)]
    return {f"r{i}": (head + [rng.randrange(5, vocab) for _ in range(5 + 4 * i)],
                      SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)) for i in range(n)}


MODES = {
    "plain": dict(block_size=4, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=48),
    "chunked": dict(block_size=4, max_num_seqs=3, max_num_batched_tokens=6, max_model_len=48),
    "prefix": dict(block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=48),
    "preempt": dict(block_size=4, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=40, blocks=2,
                    enable_prefix_caching=False),
    "async": dict(block_size=4, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=48, async_scheduling=True),
}


@pytest.mark.parametrize("mode, drafts", [("plain", "model")] + [(m, "oracle") for m in MODES])
def test_greedy_output_is_plain_decodings(target, monkeypatch, mode, drafts):
    reqs = requests(target, seed=len(mode), shared=8 if mode == "prefix" else 0)
    futures = {tuple(p): reference_greedy(target, p, sp.max_tokens) for p, sp in reqs.values()}
    if drafts == "oracle":
        oracle(monkeypatch, futures, target.config.text.vocab_size)
        fixed_plan(monkeypatch)         # long drafts every step: accepted runs, rejections and rollbacks
    kw = dict(MODES[mode])
    engine = engine_with(target, **kw)
    arrivals = {0: ["r0"], 3: ["r1", "r2"]} if mode == "prefix" else None
    results = run(engine, reqs, arrivals=arrivals, check=lambda e: check_invariants(e.kv, e.scheduler.running))
    for rid, (prompt, _) in reqs.items():
        assert results[rid][0][0] == futures[tuple(prompt)], (rid, mode)
    assert engine.num_draft_tokens > 0
    if drafts == "oracle":
        assert engine.num_accepted_tokens > 0 and engine.num_draft_tokens > engine.num_accepted_tokens
    assert sum(engine.accepted_per_position) == engine.num_accepted_tokens
    if mode == "prefix":
        assert engine.stats().num_hit_tokens > 0
    if mode == "preempt":
        assert engine.scheduler.num_preemptions > 0
    check_invariants(engine.kv, [])


def test_requests_with_penalties_draft_and_keep_plain_tokens(target, monkeypatch):
    """Greedy requests with presence, frequency and repetition penalties draft (oracle drafts of their penalised
    continuation, the second one corrupted every other step) and emit plain decoding's tokens: each verify row is
    penalised over the drafts before it (``verify.penalised``; float64 references: test_speculative.py)."""
    pen = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.7,
                         repetition_penalty=1.3)
    reqs = {rid: (prompt, pen) for rid, (prompt, _) in requests(target, seed=4).items()}
    plain = make_engine(target, **MODES["plain"], extra_blocks=8)
    want = {rid: r[0][0] for rid, r in run(plain, reqs).items()}
    assert any(want[rid] != reference_greedy(target, p, 12) for rid, (p, _) in reqs.items())   # penalties matter
    oracle(monkeypatch, {tuple(p): want[rid] for rid, (p, _) in reqs.items()}, target.config.text.vocab_size)
    fixed_plan(monkeypatch)
    engine = engine_with(target, **MODES["plain"])
    got = {rid: r[0][0] for rid, r in run(engine, reqs).items()}
    assert got == want
    assert 0 < engine.num_accepted_tokens < engine.num_draft_tokens


@pytest.mark.parametrize("plan, mode", [("controller", "prefix"), ("sparse", "prefix"), ("sparse", "plain"),
                                        ("sparse", "preempt")])
def test_proposals_equal_the_draft_run_from_scratch(target, monkeypatch, plan, mode):
    """Every proposal the engine's drafter makes (catch-up over chunked prefill and verify steps, then the chain)
    equals the draft run once over the whole history: the target's states of positions < P, the tokens after them,
    draft 1 from row P - 1, draft j + 1 from a row at P + j - 1 fed draft j and the feature before it. ``sparse``: a
    request drafts one decode step in three (the other's offset), so rows of requests that neither draft nor watch
    wait and are caught up late (``ModelDrafter._defer``; with prefix caching at each block's end too; a preempted
    request's waiting rows dropped, its recomputed ones caught up)."""
    from kimik3.model.batch import ForwardBatch
    from kimik3.model.draft_attention import DraftBatch
    seen, lagged = [], []
    hand_out, defer = ModelDrafter._hand_out, ModelDrafter._defer

    def record(self, reqs, counts, drafts):
        hand_out(self, reqs, counts, drafts)
        seen.extend((list(r.token_ids), list(r.spec.proposal) or [r.spec.watch[1]], self.draft) for r in reqs)
    monkeypatch.setattr(ModelDrafter, "_hand_out", record)
    if plan == "sparse":
        calls = iter(range(10 ** 6))
        monkeypatch.setattr(DraftController, "plan", lambda self, rates, rooms, batch, watching, costs=None: (
            lambda t: [r if (t + i) % 3 == 0 else 0 for i, r in enumerate(rooms)])(next(calls)))

        def count(self, work, spans, heads, states):
            out = defer(self, work, spans, heads, states)
            lagged.append(sum(len(p) for req, _, _ in spans for _, p, _ in self.state(req).lag))
            return out
        monkeypatch.setattr(ModelDrafter, "_defer", count)
    n = 3 if mode == "preempt" else 2
    reqs = requests(target, seed=4, n=n, max_tokens=12)
    engine = engine_with(target, k=3, block_size=4, max_num_seqs=n, max_num_batched_tokens=7, max_model_len=40,
                         enable_prefix_caching=mode == "prefix", **({"blocks": 2} if mode == "preempt" else {}))
    run(engine, reqs)
    assert len(seen) >= 3
    assert plan == "controller" or max(lagged) >= 2, lagged
    assert mode != "preempt" or engine.scheduler.num_preemptions > 0
    for tokens, proposal, draft in seen:
        P = len(tokens) - 1
        cache = target.allocate_cache(2, 2, P)
        _, aux = target.forward_step(torch.tensor(tokens[:P]), ForwardBatch.build([P], [0], [1], [[1]], P), cache,
                                     draft.aux_layer_ids)
        kv = torch.zeros(4, 64, *draft.cfg.cache_shape)
        logits, r = draft(torch.tensor(tokens[1:P + 1]), draft.combine(aux), DraftBatch.build([P], [0], [[0, 1]], 64), kv)
        want, h = [int(draft.to_target(logits[-1].argmax()))], r[-1:]
        while len(want) < len(proposal):
            logits, h = draft(torch.tensor(want[-1:]), h, DraftBatch.build([1], [P + len(want) - 1], [[0, 1]], 64), kv)
            want.append(int(draft.to_target(logits[-1].argmax())))
        assert proposal == want, (P, proposal, want)


def random_module(m, seed: int):
    g = torch.Generator().manual_seed(seed)
    for p in m.parameters():
        if p.dtype.is_floating_point:
            p.data.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]) if p.dim() > 1 else torch.ones(p.shape))
    return m.eval()


@pytest.mark.parametrize("method", ["mtp", "dflash"])
def test_mtp_and_dflash_drafts_through_the_engine(target, monkeypatch, method):
    """K3's MTP layer (chained, its own MLA latent cache) and a DFlash block drafter (one forward per block) in the
    engine: greedy output plain decoding's, with their own drafts and with oracle drafts (accepted runs)."""
    from kimik3.model.dflash import DFlashConfig, DFlashDraft
    from kimik3.model.mtp import MTPDraft
    text = target.config.text
    if method == "mtp":
        draft = random_module(MTPDraft(text, 1), 1)
    else:
        draft = random_module(DFlashDraft(DFlashConfig(
            hidden_size=text.hidden_size, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            intermediate_size=48, rms_norm_eps=1e-6, rope_theta=1000.0, vocab_size=text.vocab_size,
            draft_vocab_size=text.vocab_size, target_hidden_size=text.hidden_size, aux_layer_ids=(2, 4),
            block_size=4, mask_token_id=3)), 2)
    reqs = requests(target, seed=11, n=2, max_tokens=10)
    futures = {tuple(p): reference_greedy(target, p, sp.max_tokens) for p, sp in reqs.values()}
    proposals = []
    if method == "dflash":
        hand_out = ModelDrafter._hand_out

        def oracle_block(self, reqs, counts, drafts):
            hand_out(self, reqs, counts, drafts)
            for req, d in zip(reqs, drafts):
                proposals.append(len(d))
                prompt = next(p for p in futures if tuple(req.token_ids[:len(p)]) == p)
                done = req.num_tokens - len(prompt)
                req.spec.proposal = list(futures[prompt][done:done + len(req.spec.proposal)])
        monkeypatch.setattr(ModelDrafter, "_hand_out", oracle_block)
    else:
        oracle(monkeypatch, futures, text.vocab_size)
    fixed_plan(monkeypatch)
    cfg = EngineConfig(num_speculative_tokens=3, speculative_method=method, speculative_model="test", block_size=4,
                       max_num_seqs=2, max_num_batched_tokens=9, max_model_len=40, kda_checkpoint_interval=1)
    cfg.cache_memory_bytes = budget_for(target, 4, 2, 18, 1, 3) + 20 * ModelDrafter.bytes_per_block(draft, 4)
    engine = LLMEngine(target, cfg, draft=draft)
    per_block = ModelDrafter.bytes_per_block(draft, 4)
    assert engine.plan.total_bytes + engine.plan.num_blocks * per_block <= cfg.cache_memory_bytes   # budget shared
    results = run(engine, reqs, check=lambda e: check_invariants(e.kv, e.scheduler.running))
    for rid, (prompt, _) in reqs.items():
        assert results[rid][0][0] == futures[tuple(prompt)], rid
    assert engine.num_accepted_tokens > 0
    assert method == "mtp" or max(proposals) == 3


def test_only_requests_with_drafts_are_asked_for_them(target, monkeypatch):
    """The scheduler asks for drafts (``propose``, and computes the room) only for the requests the last step gave
    drafts (``ModelDrafter.proposes``): one decode step in three per request here; output plain decoding's."""
    calls = iter(range(10 ** 6))
    monkeypatch.setattr(DraftController, "plan", lambda self, rates, rooms, batch, watching, costs=None: (
        lambda t: [r if (t + i) % 3 == 0 else 0 for i, r in enumerate(rooms)])(next(calls)))
    handed, asked = [], []
    hand_out, propose = ModelDrafter._hand_out, ModelDrafter.propose

    def record(self, reqs, counts, drafts):
        hand_out(self, reqs, counts, drafts)
        handed.extend(r.request_id for r, k in zip(reqs, counts) if k)
    monkeypatch.setattr(ModelDrafter, "_hand_out", record)
    monkeypatch.setattr(ModelDrafter, "propose", lambda self, req, room: (asked.append(req.request_id),
                                                                          propose(self, req, room))[1])
    reqs = requests(target, seed=5, n=3, max_tokens=16)
    engine = engine_with(target, **MODES["plain"])
    results = run(engine, reqs)
    for rid, (prompt, sp) in reqs.items():
        assert results[rid][0][0] == reference_greedy(target, prompt, sp.max_tokens)
    assert engine.num_drafts > 0 and sorted(asked) == sorted(handed), (asked, handed)


def test_requests_whose_rows_wait_long_do_not_watch(target, monkeypatch):
    """On a CPU the rows of a request that neither drafts nor watches wait (``_defer``; no prefix caching, whose
    block ends catch up); where one request drafts, the others watch only while at most ``WATCH_LAG`` of their rows
    wait (a watch would catch them all up): in the first decode step (their prompts wait) they watch; after more
    steps than ``WATCH_LAG`` they do not. Output plain decoding's."""
    from kimik3.engine.spec.draft_lag import WATCH_LAG, waiting
    late = WATCH_LAG + 6
    calls = iter(range(10 ** 6))
    step = [0]

    def plan(self, rates, rooms, batch, watching, costs=None):
        step[0] = next(calls)
        return [r if i == 0 and step[0] in (1, late) else 0 for i, r in enumerate(rooms)]
    monkeypatch.setattr(DraftController, "plan", plan)
    heads, lags = {}, {}
    reqs = requests(target, seed=6, n=3, max_tokens=late + 8)
    engine = engine_with(target, **{**MODES["plain"], "max_model_len": 64, "enable_prefix_caching": False})
    drafter = engine.scheduler.drafter
    assert drafter.may_lag
    run_draft = drafter.executor.run

    def record(work, states):
        heads[step[0]] = len(work.heads)
        return run_draft(work, states)
    drafter.executor.run = record
    drafting = drafter._drafting

    def lag_of(cands, rooms, depths):
        lags[step[0]] = sorted(waiting(drafter.state(req).lag) for req, _, _ in cands)
        return drafting(cands, rooms, depths)
    drafter._drafting = lag_of
    results = run(engine, reqs)
    for rid, (prompt, sp) in reqs.items():
        assert results[rid][0][0] == reference_greedy(target, prompt, sp.max_tokens)
    assert max(lags[1]) <= WATCH_LAG and heads[1] == 3, (lags[1], heads)
    assert min(lags[late][1:]) > WATCH_LAG and heads[late] == 1, (lags[late], heads)


def test_failing_drafts_stop_and_are_watched(target):
    """A random draft (drafts rejected): the request's measured acceptance falls, the controller stops its drafts,
    and it only watches its first draft now and then (``controller.py``), so most steps run plain; output still
    plain decoding's."""
    reqs = requests(target, seed=9, n=1, max_tokens=36)
    engine = engine_with(target, k=4, block_size=4, max_num_seqs=1, max_model_len=64)
    executor = engine.scheduler.drafter.executor
    forwards, run_draft = [], executor.run
    executor.run = lambda work, states: (forwards.append(len(work.heads)), run_draft(work, states))[1]
    results = run(engine, reqs)
    prompt = reqs["r0"][0]
    assert results["r0"][0][0] == reference_greedy(target, prompt, 36)
    assert 0 < engine.num_drafts <= 8, engine.num_drafts        # far fewer than the 36 decode steps
    # no first draft computed to watch on a step that drafts nothing (it would need a forward of its own)
    assert sum(1 for heads in forwards if heads) <= engine.num_drafts + 1, (forwards, engine.num_drafts)


def test_a_batch_size_table_fixes_the_drafts(target):
    """vLLM's num_speculative_tokens_per_batch_size: a lone request drafts the table's 3 at every decode step, though
    a random draft's drafts all fail (the controller would stop them: the test above); output plain decoding's."""
    reqs = requests(target, seed=9, n=1, max_tokens=16)
    engine = engine_with(target, k=4, block_size=4, max_num_seqs=1, max_model_len=64, enable_prefix_caching=False,
                         num_speculative_tokens_per_batch_size=[[1, 2, 3], [3, 8, 0]])   # no checkpoints cut the room
    results = run(engine, reqs)
    assert results["r0"][0][0] == reference_greedy(target, reqs["r0"][0], 16)
    steps = 16 - 1 - engine.num_accepted_tokens               # decode steps (the first token came from the prefill)
    assert engine.num_drafts >= steps - 2                     # all of them verified drafts but the last (room < 1)
    assert 3 * engine.num_drafts - 3 <= engine.num_draft_tokens <= 3 * engine.num_drafts   # 3 each (the last: room)


def test_sampled_requests_run_and_keep_lengths(target):
    reqs = {"s": ([7, 8, 9, 10, 11], SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=5))}
    engine = engine_with(target, block_size=4, max_num_seqs=1, max_model_len=40)
    out = run(engine, reqs)["s"][0][0]
    assert len(out) == 12


def test_speculative_config_is_checked():
    with pytest.raises(ValueError, match="unknown key"):
        EngineArgs(speculative_config={"method": "eagle3", "model": "x", "num_speculative_tokens": 2, "draft_tp": 1})
    with pytest.raises(ValueError, match="needs 'model'"):
        EngineArgs(speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="method must be one of"):
        EngineArgs(speculative_config={"method": "medusa", "model": "x", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="not both"):
        EngineArgs(num_speculative_tokens=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    args = EngineArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    assert args.speculative_settings()["speculative_ngram_max"] == 5
    with pytest.raises(ValueError, match="speculative method"):
        EngineConfig(speculative_method="medusa")
    table = {"method": "eagle3", "model": "x", "num_speculative_tokens": 4}
    args = EngineArgs(speculative_config={**table, "num_speculative_tokens_per_batch_size": [[1, 8, 4], [9, 64, 1]]})
    assert args.speculative_settings()["num_speculative_tokens_per_batch_size"] == [[1, 8, 4], [9, 64, 1]]
    assert EngineConfig(num_speculative_tokens=4, speculative_method="eagle3", speculative_model="x",
                        num_speculative_tokens_per_batch_size=[[1, 8, 4]]).num_speculative_tokens_per_batch_size == \
        ((1, 8, 4),)
    for bad, match in (([[2, 8, 4]], "start at batch size 1"), ([[1, 8, 4], [8, 9, 1]], "not overlap"),
                       ([[1, 8, -1]], "drafts >= 0"), ([[1, 8, 1, 64, 4]], "five-item"), ([], "non-empty"),
                       ([[1, 8, 2.5]], "integers")):
        with pytest.raises(ValueError, match=match):
            EngineArgs(speculative_config={**table, "num_speculative_tokens_per_batch_size": bad})
    with pytest.raises(ValueError, match="not for 'ngram'"):
        EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                       "num_speculative_tokens_per_batch_size": [[1, 8, 2]]})


def test_sampled_tokens_keep_the_targets_distribution(target, monkeypatch):
    """Speculative sampling with a draft model: output positions 1 and 2 of sampled requests follow the target's
    own distribution (exact, from its logits at temperature T), within 5 sigma per token, while the drafts (the
    target's greedy continuation, put in place of the draft's proposals) are partly accepted and partly rejected."""
    T, n = 0.25, 1200
    prompt = [7, 3, 9, 12, 5, 8]
    vocab = target.config.text.vocab_size
    with torch.inference_mode():
        p1 = torch.softmax(target(torch.tensor(prompt))[-1].double() / T, 0)
        nxt = torch.stack([torch.softmax(target(torch.tensor(prompt + [a]))[-1].double() / T, 0) for a in range(vocab)])
    p2 = p1 @ nxt
    greedy = {(): reference_greedy(target, prompt, 2)}
    greedy.update({(a,): reference_greedy(target, prompt + [a], 1) for a in range(vocab)})
    hand_out = ModelDrafter._hand_out

    def oracle_greedy(self, reqs, counts, drafts):
        hand_out(self, reqs, counts, drafts)
        for req in reqs:
            if req.spec.proposal:
                req.spec.proposal = greedy[tuple(req.output_token_ids)][:len(req.spec.proposal)]
    monkeypatch.setattr(ModelDrafter, "_hand_out", oracle_greedy)
    fixed_plan(monkeypatch)
    reqs = {f"s{i}": (prompt, SamplingParams(temperature=T, seed=i, max_tokens=3, ignore_eos=True)) for i in range(n)}
    engine = engine_with(target, k=2, block_size=4, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=16,
                         blocks=64 * 4, enable_prefix_caching=False)
    results = run(engine, reqs)
    assert engine.num_drafts >= n and 0.2 * engine.num_draft_tokens < engine.num_accepted_tokens < 0.9 * engine.num_draft_tokens
    for pos, dist in ((0, p1), (1, p2)):
        counts = torch.bincount(torch.tensor([results[r][0][0][pos] for r in reqs]), minlength=vocab).double()
        sigma = (n * dist * (1 - dist)).sqrt()
        bad = ((counts - n * dist).abs() > 5 * sigma + 1).nonzero().flatten().tolist()
        assert not bad, f"position {pos}: tokens {bad} off (counts {counts[bad].tolist()}, expected {(n * dist)[bad].tolist()})"
