"""Draft models with recurrent (KDA) layers: K3's MTP layers where ``linear_attn_config.kda_layers`` lists them
(``model/mtp.py``). The draft keeps its states under the target's slot numbers (``ModelDrafter._slot``) and they
only ever see committed rows: through chunked prefill, prefix hits (the draft's own checkpoints, taken where the
target's are), preemption (recomputed from a reset), rejected drafts (the target's rollback copies are its own)
and async scheduling, every draft and the draft's live state at every drafting step equal the draft run once, in
float64, over the request's whole history from a zero state; and greedy output is plain decoding's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kimik3
from kimik3.engine import EngineConfig
from kimik3.engine.core.llm_engine import LLMEngine
from kimik3.engine.spec.draft_model import ModelDrafter
from kimik3.model.batch import ForwardBatch
from kimik3.model.mtp import MTPDraft
from tests.engine.fake_model import reference_greedy
from tests.engine.helpers import budget_for, check_invariants, run
from tests.engine.spec.test_draft_model import MODES, fixed_plan, oracle, random_module, requests

F64 = torch.float64

# the MTP layers' mixers, layer L first; each layout's drafts (k) that a from-scratch run defines: a layer past the
# first sees only its own chain's rows (a KDA one starts each chain from a zero state; an MLA one attends over what
# earlier chains left in its cache, so the drafts it gives are not compared)
LAYOUTS = {"kda": ((True,), 3, 3), "mla+kda": ((False, True), 2, 2), "kda+mla": ((True, False), 2, 1)}


@pytest.fixture(scope="module")
def target(tiny_ckpt):
    return kimik3.load_model(tiny_ckpt["kimi_k3"], dtype=torch.float32, language_model_only=True)


def mtp_draft(target, kinds: tuple[bool, ...], seed: int = 3) -> MTPDraft:
    """A random float64 MTP draft whose layer L + j is KDA where ``kinds[j]``."""
    text = target.config.text
    L = text.num_hidden_layers
    listed = tuple(L + 1 + j for j, kda in enumerate(kinds) if kda)
    cfg = dataclasses.replace(text, kda=dataclasses.replace(text.kda, kda_layers=text.kda.kda_layers + listed),
                              num_nextn_predict_layers=len(kinds))
    draft = random_module(MTPDraft(cfg, len(kinds)), seed).to(F64)
    for j, kda in enumerate(kinds):       # a decay near 0.9 a row: the state remembers ~10 rows (a wrong one shows)
        if kda:
            draft.layer(j).self_attn.A_log.data.fill_(0.0)
            draft.layer(j).self_attn.dt_bias.data.fill_(-4.0)
    assert [draft.layer(j).is_kda for j in range(len(kinds))] == list(kinds)
    return draft


def engine_for(target, draft, k: int, blocks: int = 8, **kw) -> LLMEngine:
    kw.setdefault("kda_checkpoint_interval", 1)
    cfg = EngineConfig(num_speculative_tokens=k, speculative_method="mtp", speculative_model="test", **kw)
    need = -(-cfg.max_model_len // cfg.block_size) + blocks
    interval = cfg.kda_checkpoint_interval if cfg.enable_prefix_caching else None
    seqs = cfg.max_num_seqs
    slots = 1 + 2 * seqs + (-(-need // interval) if interval else 0)      # null, live, checkpoint and scratch slots
    cfg.cache_memory_bytes = (budget_for(target, cfg.block_size, seqs, need, interval, k)
                              + (need + 1 + seqs * 3) * ModelDrafter.bytes_per_block(draft, cfg.block_size)
                              + slots * ModelDrafter.bytes_per_slot(draft))
    return LLMEngine(target, cfg, draft=draft)


def from_scratch(target, draft, tokens: list[int], n: int):
    """The draft over the whole history of a request whose last token is at P = len(tokens) - 1, in float64 from a
    zero state: the target's pre-norm states of positions < P (one forward), the tokens after them, then the chain
    (draft j + 1 from the row at P + j - 1 fed draft j). -> (its first ``n`` drafts, KDA states and conv windows
    after the P rows)."""
    P = len(tokens) - 1
    cache = target.allocate_cache(2, 2, P)
    with torch.inference_mode():
        _, aux = target.forward_step(torch.tensor(tokens[:P]), ForwardBatch.build([P], [0], [1], [[1]], P), cache,
                                     draft.aux_layer_ids)
        own = draft.allocate_cache(2, 2, 64, F64)
        logits, h = draft(0, torch.tensor(tokens[1:P + 1]), aux[0].to(F64), torch.arange(P),
                          ForwardBatch.build([P], [0], [1], [[0, 1]], 64), own)
        state, conv = own.kda_state[:, 1].clone(), own.kda_conv[:, 1].clone()
        want, h = [int(logits[-1].argmax())], h[-1:]
        for j in range(1, n):
            logits, h = draft(j, torch.tensor(want[-1:]), h, torch.tensor([P + j - 1]),
                              ForwardBatch.build([1], [P + j - 1], [1], [[0, 1]], 64), own)
            want.append(int(logits[-1].argmax()))
    return want, state, conv


def record_drafts(monkeypatch) -> list:
    """Each drafting request's history, its drafts (the draft model's own) and the draft's live KDA state and conv
    window for it (float64 on the CPU), as ``_hand_out`` gets them."""
    seen = []
    hand_out = ModelDrafter._hand_out

    def record(self, reqs, counts, drafts):
        for req, d in zip(reqs, drafts):
            slot = self._slot(req.cache.state_slot)
            seen.append((list(req.token_ids), list(d), self.cache.kda_state[:, slot].to("cpu", F64, copy=True),
                         self.cache.kda_conv[:, slot].to("cpu", F64, copy=True)))
        hand_out(self, reqs, counts, drafts)
    monkeypatch.setattr(ModelDrafter, "_hand_out", record)
    return seen


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# (async scheduling runs a draft model's requests synchronously: its drafts follow the committed tokens)
CASES = [("kda", m) for m in ("chunked", "prefix", "preempt")] + [("mla+kda", "prefix"), ("kda+mla", "chunked")]
_FUTURES: dict[tuple[int, ...], list[int]] = {}


def plain_greedy(target, prompt: list[int], n: int) -> list[int]:
    """Plain decoding's tokens (``reference_greedy``), once per prompt for the module's cases."""
    if tuple(prompt) not in _FUTURES:
        _FUTURES[tuple(prompt)] = reference_greedy(target, prompt, n)
    return _FUTURES[tuple(prompt)]


@pytest.mark.parametrize("layout, mode", CASES)
def test_recurrent_draft_states_follow_committed_rows(target, monkeypatch, layout, mode):
    check_recurrent_draft(target, monkeypatch, layout, mode)


@pytest.mark.parametrize("layout, mode", [("kda", "prefix"), ("kda", "preempt"), ("mla+kda", "chunked"),
                                          ("kda+mla", "prefix")])
def test_recurrent_draft_on_graphs(target, monkeypatch, layout, mode):
    """The same on the CUDA-graph branch, emulated (``tests/engine/run/test_draft_graphs_cpu.py``): the target's
    decode / verify graphs and the draft's own (``model/draft_graphs.py``: a KDA first layer's catch-up in rounds
    where the step allows, else eagerly, then its positions' graphs on the live and scratch slots)."""
    check_recurrent_draft(target, monkeypatch, layout, mode, graphs=True)


def check_recurrent_draft(target, monkeypatch, layout: str, mode: str, graphs: bool = False) -> None:
    """A request's drafts and the draft's live state at every drafting step against ``from_scratch``; greedy output
    plain decoding's. ``graphs``: on emulated graphs, which replay draft steps."""
    kinds, k, compared = LAYOUTS[layout]
    draft = mtp_draft(target, kinds)
    reqs = requests(target, seed=len(mode), shared=8 if mode == "prefix" else 0, max_tokens=10)
    futures = {tuple(p): plain_greedy(target, p, sp.max_tokens) for p, sp in reqs.values()}
    seen = record_drafts(monkeypatch)
    oracle(monkeypatch, futures, target.config.text.vocab_size)     # accepted runs and rejections (rollbacks)
    fixed_plan(monkeypatch)
    kw = dict(MODES[mode])
    engine = engine_for(target, draft, k, **kw)
    if graphs:
        from tests.engine.run.test_draft_graphs_cpu import graphed
        graphed(engine, k)
    arrivals = {0: ["r0"], 3: ["r1", "r2"]} if mode == "prefix" else None
    results = run(engine, reqs, arrivals=arrivals, check=lambda e: check_invariants(e.kv, e.scheduler.running))
    for rid, (prompt, _) in reqs.items():
        assert results[rid][0][0] == futures[tuple(prompt)], (rid, layout, mode)
    assert engine.num_accepted_tokens > 0 and engine.num_draft_tokens > engine.num_accepted_tokens   # rollbacks ran
    if mode == "prefix":
        assert engine.stats().num_hit_tokens > 0
    if mode == "preempt":
        assert engine.scheduler.num_preemptions > 0
    assert len(seen) >= 10
    worst = 0.0
    for tokens, drafts, state, conv in seen:
        want, ref_state, ref_conv = from_scratch(target, draft, tokens, min(compared, len(drafts)))
        assert drafts[:len(want)] == want, (len(tokens), drafts, want)
        worst = max(worst, rel(state, ref_state), rel(conv, ref_conv))
    assert worst < 1e-4, worst          # float32 target states; a missing, repeated or stale row is O(1)
    if graphs:
        draft_graphs = engine.scheduler.drafter.executor.graphs
        steps = {key for key in draft_graphs.replayed if key[0] == "step"}
        assert {key[4] for key in steps} == {0, 1, 2} if k > 2 else {0, 1}, steps   # the live slots, then scratch
        rounds = [key for key in draft_graphs.replayed if key[0] == "rounds"]
        assert bool(rounds) == kinds[0], rounds     # a KDA first layer's catch-up in graphs too (some steps)
