"""An MTP draft with a KDA first layer in a CUDA engine (the target's decode / verify graphs, the KDA layer's CUDA
kernels in the draft's catch-up: chunked rows with prefix checkpoints, short rounds, one-row decode steps): greedy
output is plain decoding's, and at every drafting step the draft's live KDA state equals the draft run once over
the request's history in float64 on the CPU (its drafts too, but for near ties). The exact orchestration is tested
on the CPU in float64 (tests/engine/spec/test_recurrent_draft.py)."""

from __future__ import annotations

import copy

import pytest
import torch

import kimik3
from tests.engine.spec.test_draft_model import MODES, fixed_plan, oracle, requests
from tests.engine.spec.test_recurrent_draft import (LAYOUTS, engine_for, from_scratch, mtp_draft, plain_greedy,
                                                   record_drafts, rel)
from tests.engine.helpers import check_invariants, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STATE_BOUND = 2e-3      # fp32 CUDA kernels (chunked, short-round and decode KDA) against float64 from scratch


def recurrent_draft_case(tiny_ckpt, monkeypatch, mode: str, device: str) -> None:
    cpu_target = kimik3.load_model(tiny_ckpt["kimi_k3"], dtype=torch.float32, language_model_only=True)
    target = kimik3.load_model(tiny_ckpt["kimi_k3"], dtype=torch.float32, language_model_only=True, device=device)
    kinds, k, compared = LAYOUTS["kda"]
    ref_draft = mtp_draft(cpu_target, kinds)                       # float64 on the CPU
    draft = copy.deepcopy(ref_draft).float().to(device)
    reqs = requests(cpu_target, seed=len(mode), shared=8 if mode == "prefix" else 0, max_tokens=10)
    futures = {tuple(p): plain_greedy(cpu_target, p, sp.max_tokens) for p, sp in reqs.values()}
    seen = record_drafts(monkeypatch)
    oracle(monkeypatch, futures, cpu_target.config.text.vocab_size)
    fixed_plan(monkeypatch)
    engine = engine_for(target, draft, k, **MODES[mode])
    arrivals = {0: ["r0"], 3: ["r1", "r2"]} if mode == "prefix" else None
    results = run(engine, reqs, arrivals=arrivals, check=lambda e: check_invariants(e.kv, e.scheduler.running))
    for rid, (prompt, _) in reqs.items():
        assert results[rid][0][0] == futures[tuple(prompt)], (rid, mode)
    assert engine.num_accepted_tokens > 0 and engine.num_draft_tokens > engine.num_accepted_tokens
    if mode == "prefix":
        assert engine.stats().num_hit_tokens > 0
    assert len(seen) >= 10
    worst, same = 0.0, 0
    for tokens, drafts, state, conv in seen:
        want, ref_state, ref_conv = from_scratch(cpu_target, ref_draft, tokens, min(compared, len(drafts)))
        same += drafts[:len(want)] == want
        worst = max(worst, rel(state, ref_state), rel(conv, ref_conv))
    assert worst < STATE_BOUND, worst             # a missing, repeated or stale row: 0.05 .. 0.2 on the CPU
    assert same >= 0.9 * len(seen), (same, len(seen))


@pytest.mark.parametrize("mode", ["chunked", "prefix", "preempt"])
def test_kda_mtp_draft_on_cuda(tiny_ckpt, monkeypatch, mode):
    recurrent_draft_case(tiny_ckpt, monkeypatch, mode, "cuda")
