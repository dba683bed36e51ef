"""Sampler: each parameter transforms the distribution as documented (frequencies vs the analytic
distribution, fixed seeds), penalties match their formulas, seeded requests ignore batch composition."""

from __future__ import annotations

import gc
import math

import pytest
import torch

from kimik3.engine import SamplingParams
from kimik3.engine.sample.logit_controls import apply_penalties
from kimik3.engine.sample.sampler import SamplingBatch, draw, sample, seeded_uniform
from tests.engine.fake_model import FakeModel
from tests.engine.helpers import make_engine, run

LOGITS = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]
N = 40_000


def _history_from_ids(prompt_ids: list[list[int]], output_ids: list[list[int]], vocab_size: int,
                     device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(seen, counts) of ``SamplingBatch`` built directly from each row's prompt and output ids."""
    n = len(prompt_ids)
    counts = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)
    seen = torch.zeros(n, vocab_size, dtype=torch.bool, device=device)
    for i, (prompt, out) in enumerate(zip(prompt_ids, output_ids)):
        counts[i].index_add_(0, torch.tensor(out, dtype=torch.int64, device=device), torch.ones(len(out), device=device))
        seen[i, torch.tensor(prompt, dtype=torch.int64, device=device)] = True
    return seen | (counts > 0), counts


def _expected(p: SamplingParams) -> list[float]:
    """The documented pipeline in plain Python: temperature -> min_p -> top_k -> top_p."""
    z = [x / p.temperature for x in LOGITS]
    m = max(z)
    probs = [math.exp(x - m) for x in z]
    s = sum(probs)
    probs = [q / s for q in probs]
    keep = [q >= p.min_p * max(probs) for q in probs]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    if p.top_k > 0:
        for rank, i in enumerate(order):
            keep[i] = keep[i] and rank < p.top_k
    kept_mass = sum(probs[i] for i in order if keep[i])
    before = 0.0
    for i in order:
        if keep[i]:
            if before >= p.top_p:
                keep[i] = False
            before += probs[i] / kept_mass
    total = sum(q for q, k in zip(probs, keep) if k)
    return [q / total if k else 0.0 for q, k in zip(probs, keep)]


def _frequencies(p: SamplingParams, seeded: bool = False) -> list[float]:
    """N draws: from the engine generator, or one per seed (N seeded rows, one position each)."""
    logits = torch.tensor([LOGITS] * N)
    uniforms = [seeded_uniform(i, 3) for i in range(N)] if seeded else [None] * N
    b = SamplingBatch.build([p] * N, uniforms, len(LOGITS), "cpu")
    tokens = torch.tensor(sample(logits, b, torch.Generator().manual_seed(1234)).result().token_ids)
    return (torch.bincount(tokens, minlength=len(LOGITS)).float() / N).tolist()


@pytest.mark.parametrize("params", [
    dict(temperature=1.0), dict(temperature=0.5), dict(temperature=2.0), dict(top_k=3), dict(top_p=0.7),
    dict(top_p=0.3, temperature=2.0), dict(min_p=0.2), dict(min_p=0.05, top_k=5, top_p=0.9, temperature=0.8),
], ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
@pytest.mark.parametrize("seeded", [False, True], ids=["engine_rng", "seeded"])
def test_sampled_frequencies_match_the_transformed_distribution(params, seeded):
    p = SamplingParams(**params)
    want, got = _expected(p), _frequencies(p, seeded)
    for i, (w, g) in enumerate(zip(want, got)):
        if w == 0.0:
            assert g == 0.0, f"token {i} should be filtered out, sampled with frequency {g}"
        else:  # 5 standard deviations of a binomial frequency
            assert abs(g - w) < 5 * math.sqrt(w * (1 - w) / N) + 1e-4, f"token {i}: expected {w:.4f}, got {g:.4f}"


def test_seeded_rows_invert_the_cdf_at_their_uniform():
    """A seeded row's token is the first whose cumulative probability (float64, in Python) reaches
    u times the row's total; unseeded rows beside it change nothing, and neither does its row index."""
    torch.manual_seed(3)
    probs = torch.rand(6, 50).pow(3)                   # unnormalised, with near-zero entries
    probs[2, 10:] = 0.0                                # mass only on the first ten tokens
    uniforms = [seeded_uniform(7, k) if k % 2 == 0 else None for k in range(6)]
    got = draw(probs, uniforms, torch.Generator().manual_seed(0)).tolist()
    for i, u in enumerate(uniforms):
        if u is None:
            continue
        row = probs[i].double().tolist()
        total, acc, want = sum(row), 0.0, None
        for t, q in enumerate(row):
            acc += q
            if acc >= u * total:
                want = t
                break
        assert got[i] == want, (i, got[i], want)
        assert draw(probs[i:i + 1], [u], None).item() == want        # alone: the same token
    assert got[2] < 10


def test_seeded_uniforms_are_fixed_by_seed_position_and_stream():
    u = seeded_uniform(42, 5)
    assert 0.0 < u < 1.0 and u == seeded_uniform(42, 5)
    others = {seeded_uniform(43, 5), seeded_uniform(42, 6), seeded_uniform(42, 5, 1)}
    assert u not in others and len(others) == 3


def test_greedy_is_argmax_after_penalties():
    logits = torch.tensor([[3.0, 2.9, -1.0, 0.5]])
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    b = SamplingBatch.build([p], [None], 4, "cpu", _history_from_ids([[0]], [[]], 4, "cpu"))
    assert sample(logits, b).result().token_ids == [1]           # 3.0 / 2 < 2.9


def test_penalty_formulas():
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, 3.0]])
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5)
    b = SamplingBatch.build([p], [None], 5, "cpu", _history_from_ids([[0, 1]], [[2, 2, 3]], 5, "cpu"))
    got = apply_penalties(logits, b)[0].tolist()
    want = [1.0 / 1.5, -1.0 * 1.5, 2.0 / 1.5 - 0.25 * 2 - 0.5, 0.5 / 1.5 - 0.25 - 0.5, 3.0]
    assert got == pytest.approx(want)


def test_logprobs_are_the_raw_model_distribution():
    logits = torch.tensor([LOGITS, LOGITS[::-1]])
    params = [SamplingParams(temperature=0.3, top_k=2, logprobs=3), SamplingParams(temperature=0, logprobs=0)]
    b = SamplingBatch.build(params, [None, None], 8, "cpu")
    out = sample(logits, b, torch.Generator().manual_seed(0)).result()
    ref = logits.log_softmax(-1)
    assert len(out.logprobs[0]) in (3, 4) and all(v == pytest.approx(float(ref[0, t])) for t, v in out.logprobs[0].items())
    assert set(out.logprobs[0]) >= {0, 1, 2}
    assert out.token_ids[1] == 7 and out.logprobs[1] == {7: pytest.approx(float(ref[1, 7]))}


def test_seeded_request_is_independent_of_batch_composition():
    model = FakeModel(sharpness=0.4)
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=12)
    prompt = [5, 6, 7, 8]
    alone = run(make_engine(model, max_model_len=64, extra_blocks=4), {"s": (prompt, seeded)})["s"][0][0]
    others = {f"o{i}": ([i + 1] * (i + 2), SamplingParams(temperature=1.0, max_tokens=5 + i)) for i in range(5)}
    crowd_engine = make_engine(model, max_num_seqs=8, max_num_batched_tokens=5, max_model_len=64, extra_blocks=20,
                               seed=3)
    crowd = run(crowd_engine, {**others, "s": (prompt, seeded)}, arrivals={0: list(others)[:3], 2: ["s", "o3"], 4: ["o4"]})
    assert crowd["s"][0][0] == alone
    other_seed = run(make_engine(model, max_model_len=64, extra_blocks=4),
                     {"s": (prompt, SamplingParams(temperature=1.0, seed=43, max_tokens=12))})["s"][0][0]
    assert other_seed != alone


def test_seeded_request_resumed_from_its_own_output_continues_the_same():
    """12 seeded tokens in one request equal 5, then a request whose prompt is the first one's prompt
    and those 5 tokens, with the same seed, for 7 more (what the server does when it resumes a request):
    the noise is fixed by seed and position in the sequence, not by the request's own count."""
    model = FakeModel(sharpness=0.4)
    prompt = [5, 6, 7, 8]
    params = lambda n: SamplingParams(temperature=1.0, seed=42, max_tokens=n)  # noqa: E731
    whole = run(make_engine(model, max_model_len=64, extra_blocks=4), {"s": (prompt, params(12))})["s"][0][0]
    head = run(make_engine(model, max_model_len=64, extra_blocks=4), {"s": (prompt, params(5))})["s"][0][0]
    tail = run(make_engine(model, max_model_len=64, extra_blocks=4), {"s": (prompt + head, params(7))})["s"][0][0]
    assert head + tail == whole
    assert len(set(whole)) > 3                  # sampled, not a constant run


def _penalized_greedy(model, prompt: list[int], p: SamplingParams) -> list[int]:
    """Greedy decoding under the penalties, in float64 from the math: the model called on the growing
    sequence; repetition over prompt + output tokens, then frequency and presence over the output."""
    ids, out = list(prompt), []
    for _ in range(p.max_tokens):
        logits = model(torch.tensor(ids))[-1].double().tolist()
        for t in range(len(logits)):
            if t in ids:
                logits[t] = logits[t] / p.repetition_penalty if logits[t] > 0 else logits[t] * p.repetition_penalty
            n = out.count(t)
            logits[t] -= p.frequency_penalty * n + p.presence_penalty * (n > 0)
        t = max(range(len(logits)), key=lambda j: (logits[j], -j))       # the first of equal maxima
        ids.append(t)
        out.append(t)
    return out


def test_penalized_requests_follow_their_history_through_preemption_and_slot_reuse():
    """The penalties' token history is kept per live slot and brought up to date each step: requests
    that finish, are preempted and re-admitted, or take a slot another one held, still get exactly
    the greedy tokens of their penalized distribution (dyadic penalties: float32 = float64 here)."""
    model = FakeModel(sharpness=1.0)
    pen = [dict(repetition_penalty=1.5), dict(frequency_penalty=0.5, presence_penalty=0.25),
           dict(repetition_penalty=0.75, frequency_penalty=0.5), {}, dict(presence_penalty=1.0)]
    reqs = {f"p{i}": ([3 + i, 9, 3 + i, 20 + i] * (1 + i % 2), SamplingParams(temperature=0, max_tokens=14 + i,
                                                                           ignore_eos=True, **kw))
            for i, kw in enumerate(pen)}
    engine = make_engine(model, max_num_seqs=3, max_num_batched_tokens=8, block_size=4, max_model_len=40,
                         enable_prefix_caching=False, extra_blocks=2)
    got = run(engine, reqs, arrivals={0: ["p0", "p1", "p2"], 3: ["p3"], 5: ["p4"]})
    assert engine.stats().num_preemptions > 0
    for rid, (prompt, p) in reqs.items():
        assert got[rid][0][0] == _penalized_greedy(model, prompt, p), rid
    history = engine.runner.sampler.history
    assert history is not None and any(o is not None for o in history.owner)
    gc.collect()
    assert all(o is None or o() is None for o in history.owner)     # finished requests are not kept alive
