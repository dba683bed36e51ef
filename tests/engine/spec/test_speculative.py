"""Speculative decoding with n-gram drafts: the proposer against a brute-force search, and the
engine's outputs with speculation equal to plain greedy decoding (rollback of the recurrent state
after rejected drafts, stops inside accepted drafts, mixed batches, prefix-cache boundaries)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kimik3
from kimik3.engine import EngineConfig, SamplingParams
from kimik3.engine.core.memory import plan_memory
from kimik3.engine.spec.ngram import may_propose_after, propose_ngram, token_bytes
from kimik3.engine.spec.verify import accept_greedy
from tests.engine.fake_model import FakeModel, fake_config, reference_greedy
from tests.engine.helpers import check_invariants, make_engine, oracle_requests, run


def brute_force_ngram(tokens: list[int], k: int, min_n: int, max_n: int, follow: int = 1) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n + follow > len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - follow, -1, -1):  # latest occurrence with ``follow`` tokens after it
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 2, 255, 256, 65536, 2**40]), max_size=40), st.integers(0, 5),
       st.integers(1, 3), st.integers(0, 3), st.integers(1, 3))
def test_propose_ngram_matches_brute_force(tokens, k, min_n, extra, follow):
    # values whose byte patterns overlap (255/256, 2**16, 2**40) catch matches off token boundaries;
    # follow = 2 is the lookup of a draft made ahead of the previous token (``Scheduler._draft_ahead``)
    assert (propose_ngram(tokens, k, min_n, min_n + extra, follow=follow)
            == brute_force_ngram(tokens, k, min_n, min_n + extra, follow))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 2, 255, 256, 2**40]), max_size=30), st.integers(1, 3), st.integers(0, 2))
def test_may_propose_after_says_whether_any_next_token_gives_a_draft(tokens, min_n, extra):
    """Exact for min_n >= 2: False iff no next token whatever (every value that occurs, and a new one)
    makes the brute-force proposer draft; min_n = 1 is always True (the next token itself may recur)."""
    nexts = {0, 1, 2, 255, 256, 2**40, 7}
    any_draft = any(brute_force_ngram(tokens + [x], 3, min_n, min_n + extra) for x in nexts)
    if min_n == 1:
        assert may_propose_after(tokens, min_n)
    else:
        assert may_propose_after(tokens, min_n) == any_draft


def test_may_propose_after_reads_the_request_bytes():
    tokens = [4, 5, 6, 4, 9]
    assert not may_propose_after(tokens, 2)                 # 9 never occurred before: nothing can follow it
    assert may_propose_after(tokens[:4], 2)                 # 4 occurred (then 5): "4 5" may recur
    assert may_propose_after(tokens[:4], 3) is False        # "6 4" never occurred before
    data = bytearray()
    from array import array
    data.extend(array("q", tokens).tobytes())
    assert may_propose_after(tokens, 2, data=data) is False and may_propose_after(tokens, 1)


def test_token_bytes_follow_the_request_as_it_grows():
    """The proposer's int64 bytes of a request, extended call by call, equal a fresh conversion, and
    the drafts from them equal the drafts from the token list."""
    from array import array

    from kimik3.engine.core.request import Request
    req = Request("r", [5, 2**40, 255], SamplingParams(), 0.0, block_size=4)
    buf = bytearray()
    for step in ([256, 5], [], [2**40, 255, 256], [7]):
        for t in step:
            req.append_token(t)
        data = token_bytes(req.token_ids, buf)
        assert data is buf
        assert bytes(data) == array("q", req.token_ids).tobytes()
        assert propose_ngram(req.token_ids, 2, 1, 3, data=data) == propose_ngram(req.token_ids, 2, 1, 3)


def test_propose_ngram_prefers_longest_then_latest():
    tokens = [5, 6, 7, 9, 5, 6, 8, 1, 6]
    assert propose_ngram(tokens, 2, 1, 3) == [8, 1]                 # only "6" recurs: latest at index 5
    tokens = [1, 2, 3, 4, 9, 3, 5, 1, 2, 3]
    assert propose_ngram(tokens, 3, 1, 3) == [4, 9, 3]              # "1 2 3" beats the later "3"
    assert propose_ngram([1, 2, 3], 2, 1, 3) == []


def test_accept_greedy():
    assert accept_greedy([4, 5, 6], [4, 5, 7, 8]) == 2
    assert accept_greedy([4, 5], [4, 5, 9]) == 2
    assert accept_greedy([4], [3, 1]) == 0


def _engine(model, spec: int, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_num_batched_tokens", 32)
    kw.setdefault("max_model_len", 64)
    kw.setdefault("extra_blocks", 40)
    return make_engine(model, num_speculative_tokens=spec, speculative_ngram_min=1, speculative_ngram_max=3, **kw)


def test_cycling_outputs_accept_drafts_and_save_steps():
    model = FakeModel(next_from_last=True)          # outputs cycle 10, 11, 12, ...
    rng = random.Random(0)
    reqs = {f"r{i}": ([rng.randrange(61) for _ in range(rng.randint(1, 9))],
                      SamplingParams(temperature=0, max_tokens=rng.randint(8, 30), ignore_eos=True))
            for i in range(6)}
    steps = {}
    for spec in (0, 3):
        engine = _engine(model, spec)
        before = model.num_steps
        results = run(engine, reqs, check=lambda e: check_invariants(e.kv, e.scheduler.running))
        steps[spec] = model.num_steps - before
        for rid, (prompt, params) in reqs.items():
            assert results[rid][0][0] == reference_greedy(model, prompt, params.max_tokens), rid
        check_invariants(engine.kv, [])
        if spec:
            assert engine.num_accepted_tokens > 0.5 * engine.num_draft_tokens > 0
    assert steps[3] < 0.6 * steps[0], steps


def watch_schedule(first: int, end: int) -> list[int]:
    """The output positions a watching request looks up, by the documented rule: from ``first`` (the token after
    its failed verify step) a lookup records its prediction, the next one scores it; a wrong one skips the next
    4, 16, 64, then 128 lookups (``drafter.watch_pause``), each pair found wrong."""
    from kimik3.engine.spec import drafter
    looks, p, misses = [], first, 1
    while p < end:
        looks += [p, p + 1]
        misses += 1
        p += 2 + min(drafter.WATCH_PAUSE_BASE ** (misses - 1), drafter.MAX_WATCH_PAUSE)
    return [q for q in looks if q < end]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_drafts_that_fail_wait_until_predictions_come_true(monkeypatch, async_scheduling):
    """After a verify step that accepts nothing the request watches instead of drafting: its n-gram
    predictions are checked against the tokens that come (no verify steps), a wrong one pausing its lookups for
    4, 16, 64, then 128 steps, and it drafts again only after WATCH_HITS (2) right predictions in a row.
    Predictions that stay wrong: 300 tokens carry one verify step (its 3 drafts) and 11 lookups, not 300; wrong
    up to output token 50, then right: the first pair of lookups past 50 is right and the lookup after it
    drafts (a probe of one draft, then more); always right: 3 drafts per step from the start. The tokens are
    plain greedy's in every case."""
    import kimik3.engine.spec.ngram as ngram
    model = FakeModel()
    prompt = [3, 1, 4, 1, 5]
    ref = reference_greedy(model, prompt, 300)
    for wrong_until in (300, 50, 0):
        looked = []                                    # output index each lookup predicts

        def propose(token_ids, k, min_n, max_n, data=None, follow=1, wrong_until=wrong_until, looked=looked):
            done = len(token_ids) - len(prompt)       # ref[done]: the next token (ahead: the one in flight)
            looked.append(done)
            return [(t + (done < wrong_until)) % 61 for t in ref[done:done + k]]
        monkeypatch.setattr(ngram, "propose_ngram", propose)
        engine = _engine(model, 3, max_model_len=320, max_num_seqs=1, enable_prefix_caching=False,
                         async_scheduling=async_scheduling)
        verified = []                                  # (output index of the first draft, number of drafts)
        update = engine.scheduler.update

        def record(out, update=update):
            verified.extend((c.start + 1 - len(prompt), len(c.draft)) for c in out.chunks if c.draft)
            update(out)
        engine.scheduler.update = record
        results = run(engine, {"r": (prompt, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))})
        assert results["r"][0][0] == ref
        assert verified[0] == (1, 3), verified        # the first decode step drafts (ahead: guessing token 0)
        watched = watch_schedule(2, 300)              # [2, 3, 8, 9, 26, 27, 92, 93, 222, 223]
        if wrong_until == 300:
            assert engine.num_accepted_tokens == 0 and engine.num_draft_tokens == 3, verified
            assert looked[1:] == watched, looked
        elif wrong_until == 50:
            resume = next(p for p in watched[::2] if p >= 50)      # its pair's two predictions are right
            assert looked[1:looked.index(resume) + 2] == watched[:watched.index(resume) + 2], looked
            # the lookup before token resume + 2 drafts (ahead: made while that token is in flight, it guesses
            # it and drafts from the next)
            assert verified[1] == (resume + 2 + async_scheduling, 1), verified
            assert [n for _, n in verified[1:4]] == [1, 2, 3] and all(n == 3 for _, n in verified[3:-1])   # (the last:
            assert engine.num_accepted_tokens == engine.num_draft_tokens - 3 >= 3 * ((300 - resume) // 4 - 2)   # max_tokens)
        else:
            assert engine.num_accepted_tokens == engine.num_draft_tokens >= 3 * (300 // 4 - 1)


@pytest.mark.parametrize("right,expected", [
    (0, [3, 1, 1, 1, 2, 3]),     # a miss: two lookups watched, the third drafts one, growing by one a step
    (1, [3, 2, 2, 2, 2, 2]),     # the first draft right, the rest wrong: two drafts a step
    (2, [3, 3, 3, 3, 3, 3]),     # two right: the third row still pays off
])
def test_rejected_drafts_limit_the_next_drafts(monkeypatch, right, expected):
    """A verify step that accepted m of its drafts lets the next carry at most m + 1 (one more after a step
    that accepted all, up to num_speculative_tokens); the tokens stay plain greedy's."""
    import kimik3.engine.spec.ngram as ngram
    model = FakeModel()
    prompt = [3, 1, 4, 1, 5]
    ref = reference_greedy(model, prompt, 40)
    asked = []

    def propose(token_ids, k, min_n, max_n, data=None, follow=1):
        asked.append(k)
        done = len(token_ids) - len(prompt)
        good = right if len(asked) == 1 or right else k          # right == 0: only the first draft is wrong
        return [t if j < good else (t + 1) % 61 for j, t in enumerate(ref[done:done + k])]
    monkeypatch.setattr(ngram, "propose_ngram", propose)
    engine = _engine(model, 3, max_model_len=64, max_num_seqs=1, enable_prefix_caching=False)
    results = run(engine, {"r": (prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))})
    assert results["r"][0][0] == ref
    assert asked[:len(expected)] == expected, asked


def test_rejected_drafts_roll_the_state_back():
    # the default fake model's next token depends on the whole history: most drafts are wrong, and
    # the model asserts on every step that the state it is handed covers exactly the context
    model = FakeModel()
    rng = random.Random(1)
    base = [rng.randrange(61) for _ in range(5)]
    reqs = {f"r{i}": (base * 3 + [rng.randrange(61)], SamplingParams(temperature=0, max_tokens=25, ignore_eos=True))
            for i in range(3)}
    engine = _engine(model, 4)
    results = run(engine, reqs, check=lambda e: check_invariants(e.kv, e.scheduler.running))
    for rid, (prompt, params) in reqs.items():
        assert results[rid][0][0] == reference_greedy(model, prompt, params.max_tokens)
    assert engine.num_draft_tokens > engine.num_accepted_tokens


def test_stop_inside_accepted_drafts_and_mixed_batches():
    """Stops and max_tokens cut at the same token as without speculation; a greedy request with
    logprobs gets the same tokens and logprobs (each from its own row), and one with penalties
    the same outputs in a speculating batch."""
    model = FakeModel(next_from_last=True, sharpness=0.7)
    prompt = [3, 4]
    reqs = {
        "stop": (prompt, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[12], ignore_eos=True)),
        "late_stop": (prompt + [10, 11, 12, 10], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[7])),
        "exact": (prompt, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)),
        "logprobs": ([5, 6, 7], SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)),
        "penalty": ([5, 6], SamplingParams(temperature=0, max_tokens=12, presence_penalty=0.5, ignore_eos=True)),
    }
    outs = {}
    for spec in (0, 3):
        engine = _engine(model, spec, max_model_len=48)
        outs[spec] = run(engine, reqs, check=lambda e: check_invariants(e.kv, e.scheduler.running))
        check_invariants(engine.kv, [])
    assert outs[3] == outs[0]
    assert len(outs[3]["logprobs"][0][2]) == 12
    tokens, reason = outs[3]["stop"][0][:2]
    assert reason == "stop" and tokens[-1] == 12 and 12 not in tokens[:-1]
    assert len(outs[3]["exact"][0][0]) == 9
    assert outs[3]["late_stop"][0][1] == "length"


def test_logprobs_of_accepted_drafts_come_from_their_rows():
    model = FakeModel(next_from_last=True, sharpness=0.7)       # exact logits: logprobs compare exactly
    reqs = {"lp": ([5, 6, 7], SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True))}
    outs, engines = {}, {}
    for spec in (0, 3):
        engines[spec] = _engine(model, spec, max_model_len=48)
        outs[spec] = run(engines[spec], reqs)
    assert engines[3].num_accepted_tokens > 0
    tokens, _, logprobs = outs[3]["lp"][0]
    assert outs[3] == outs[0] and len(logprobs) == 12 and all(t in d for t, d in zip(tokens, logprobs))


def test_sampled_requests_keep_their_distribution():
    """Speculative sampling: the tokens at output positions 1..4 follow exactly the Markov chain
    the fake model defines (P(next | last) = softmax(-sharpness * distance / T)), within 5 sigma
    per token, while most steps carry drafts that are partly rejected."""
    sharpness, temperature, vocab, n = 0.7, 0.9, 61, 1500
    model = FakeModel(next_from_last=True, sharpness=sharpness)
    prompt = [10, 11, 12, 10, 11, 12, 10]
    reqs = {f"s{i}": (prompt, SamplingParams(temperature=temperature, seed=i, max_tokens=4, ignore_eos=True))
            for i in range(n)}
    engine = _engine(model, 3, max_num_seqs=64, max_num_batched_tokens=512, extra_blocks=64 * 4)
    results = run(engine, reqs)
    assert engine.num_accepted_tokens > 0.2 * engine.num_draft_tokens
    assert engine.num_accepted_tokens < 0.8 * engine.num_draft_tokens
    v = torch.arange(vocab, dtype=torch.float64)

    def transition(last: int) -> torch.Tensor:
        d = (v - (10 + last % 3)).abs()
        return torch.softmax(-sharpness * torch.minimum(d, vocab - d) / temperature, 0)
    step = torch.stack([transition(t) for t in range(vocab)])      # [last, next]
    dist = transition(prompt[-1])
    for pos in range(4):
        counts = torch.bincount(torch.tensor([results[r][0][0][pos] for r in reqs]), minlength=vocab).double()
        sigma = (n * dist * (1 - dist)).sqrt()
        bad = ((counts - n * dist).abs() > 5 * sigma + 1).nonzero().flatten().tolist()
        assert not bad, f"position {pos}: tokens {bad} off (counts {counts[bad].tolist()}, expected {(n * dist)[bad].tolist()})"
        dist = dist @ step


@pytest.mark.parametrize("arch", ["kimi_k3", "kimi_linear"])
def test_real_model_with_speculation_matches_reference(arch, tiny_ckpt):
    model = kimik3.load_model(tiny_ckpt[arch], device="cpu", dtype=torch.float32)
    rng = random.Random(2)
    vocab = model.config.text.vocab_size
    assert vocab <= 512
    # every token id occurs in the prompt, so each decode step finds an n-gram and carries drafts
    # (the tiny random model's continuations rarely agree with them: rollbacks are the common case)
    every = list(range(vocab))
    reqs = {}
    for i in range(3):
        rng.shuffle(every)
        reqs[f"r{i}"] = (every[:], SamplingParams(temperature=0, max_tokens=8 + 2 * i, ignore_eos=True))
    # a checkpoint every 2 blocks of 16 tokens: drafts are cut short of each boundary
    engine = make_engine(model, block_size=16, max_num_seqs=3, max_num_batched_tokens=256 + 16,
                         max_model_len=vocab + 16, kda_checkpoint_interval=2, extra_blocks=8, num_speculative_tokens=3,
                         speculative_ngram_min=1, speculative_ngram_max=3)
    results = run(engine, reqs, check=lambda e: check_invariants(e.kv, e.scheduler.running))
    for rid, (prompt, params) in reqs.items():
        assert results[rid][0][0] == reference_greedy(model, prompt, params.max_tokens), rid
    assert engine.num_draft_tokens > 0
    check_invariants(engine.kv, [])


def test_speculative_settings_are_validated_and_planned():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="speculative_ngram_min"):
        EngineConfig(speculative_ngram_min=3, speculative_ngram_max=2)
    text = fake_config().text
    plain = plan_memory(text, 100_000, 4, 3, 2, torch.float32)
    spec = plan_memory(text, 100_000, 4, 3, 2, torch.float32, num_spec_slots=6)
    assert spec.num_spec_slots == 6 and spec.num_slots - spec.num_checkpoint_slots == plain.num_slots - plain.num_checkpoint_slots + 6
    assert spec.total_bytes <= spec.budget_bytes


@pytest.mark.parametrize("arch", ["kimi_k3", "kimi_linear"])
def test_real_model_accepts_oracle_drafts(arch, tiny_ckpt, monkeypatch):
    """Drafts from an oracle (the reference continuation, every other step with its second token
    corrupted): accepted runs, bonus tokens and rollbacks on the real model, exactly greedy."""
    model = kimik3.load_model(tiny_ckpt[arch], device="cpu", dtype=torch.float32)
    reqs, futures = oracle_requests(model, monkeypatch, seed=3)
    engine = make_engine(model, block_size=4, max_num_seqs=3, max_num_batched_tokens=32, max_model_len=40,
                         kda_checkpoint_interval=2, extra_blocks=12, num_speculative_tokens=3)
    results = run(engine, reqs, check=lambda e: check_invariants(e.kv, e.scheduler.running))
    for rid, (prompt, params) in reqs.items():
        assert results[rid][0][0] == futures[tuple(prompt)], rid
    assert engine.num_accepted_tokens > 0 and engine.num_draft_tokens > engine.num_accepted_tokens
    check_invariants(engine.kv, [])


PENALTIES = dict(presence_penalty=0.3, frequency_penalty=0.4, repetition_penalty=1.3)
STRONG = dict(presence_penalty=1.0, frequency_penalty=1.5, repetition_penalty=2.0)    # far from the plain chain


def penalised_logits(model: FakeModel, prompt: list[int], out: list[int], penalties: dict = PENALTIES) -> torch.Tensor:
    """float64, from the definitions: the model's last-row logits, repetition (HF: divide positive, multiply
    negative logits of prompt and output ids), then presence (once per output id) and frequency (per occurrence)."""
    logits = model(torch.tensor(prompt + out))[-1].double()
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[prompt + out] = True
    rep = penalties["repetition_penalty"]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=logits.numel()).double()
    return logits - penalties["frequency_penalty"] * counts - penalties["presence_penalty"] * (counts > 0).double()


def test_requests_with_penalties_draft_and_keep_greedy_tokens():
    """Penalised greedy requests carry n-gram drafts (the cycling model's drafts are accepted until the penalties
    turn the output away from the cycle, then rejected) and emit exactly the float64 reference's tokens, each row
    penalised over the history and the drafts before it, as without speculation."""
    model = FakeModel(next_from_last=True, sharpness=0.7)
    reqs = {f"p{i}": (prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **PENALTIES))
            for i, prompt in enumerate(([10, 11, 12, 10, 11], [5, 6, 7], [12, 10, 11, 12]))}
    outs = {}
    for spec in (0, 3):
        engine = _engine(model, spec)
        outs[spec] = run(engine, reqs, check=lambda e: check_invariants(e.kv, e.scheduler.running))
        if spec:
            assert engine.num_accepted_tokens > 0 and engine.num_draft_tokens > engine.num_accepted_tokens
    for rid, (prompt, _) in reqs.items():
        want = []
        for _ in range(24):
            want.append(int(penalised_logits(model, prompt, want).argmax()))
        assert outs[3][rid][0][0] == want == outs[0][rid][0][0], rid
        assert len(set(want[:6])) > 1 and want[:3] != want[3:6]         # the penalties did turn the output


def test_sampled_requests_with_penalties_keep_their_distribution():
    """Speculative sampling over penalised rows: output positions 0..2 follow the exact distribution (float64,
    summed over the earlier positions' paths, each step penalised over its own history) within 5 sigma per token,
    while drafts are proposed and partly accepted."""
    temperature, vocab, n = 0.9, 61, 1200
    model = FakeModel(next_from_last=True, sharpness=0.7)
    prompt = [10, 11, 12, 10, 11, 12, 10]
    reqs = {f"s{i}": (prompt, SamplingParams(temperature=temperature, seed=i, max_tokens=3, ignore_eos=True,
                                             **STRONG)) for i in range(n)}
    engine = _engine(model, 2, max_num_seqs=64, max_num_batched_tokens=512, extra_blocks=64 * 4)
    results = run(engine, reqs)
    assert 0 < engine.num_accepted_tokens < engine.num_draft_tokens

    def probs(out: list[int]) -> torch.Tensor:
        return torch.softmax(penalised_logits(model, prompt, out, STRONG) / temperature, 0)
    first = probs([])
    paths = {(t,): first[t].item() for t in range(vocab) if first[t] > 1e-12}
    marginals = [first]
    for _ in range(2):
        nxt, marginal = {}, torch.zeros(vocab, dtype=torch.float64)
        for path, p in paths.items():
            q = probs(list(path)) * p
            marginal += q
            for t in (q > 1e-9).nonzero().flatten().tolist():
                nxt[path + (t,)] = q[t].item()
        paths = nxt
        marginals.append(marginal)
    for pos, dist in enumerate(marginals):
        counts = torch.bincount(torch.tensor([results[r][0][0][pos] for r in reqs]), minlength=vocab).double()
        sigma = (n * dist * (1 - dist)).sqrt()
        bad = ((counts - n * dist).abs() > 5 * sigma + 1).nonzero().flatten().tolist()
        assert not bad, f"position {pos}: tokens {bad} off (counts {counts[bad].tolist()}, expected {(n * dist)[bad].tolist()})"


class _Req:
    """What verify reads of a request (a weak-referenceable stand-in: ``PenaltyHistory`` keeps weak owners)."""

    def __init__(self, prompt: list[int], params: SamplingParams):
        self.prompt_token_ids, self.token_ids, self.params = prompt, list(prompt), params
        self.num_prompt_tokens = self.num_tokens = len(prompt)
        self.num_output_tokens, self.seed = 0, params.seed
        self.cache = SimpleNamespace(state_slot=1)
        self.plain_greedy = params.plain_greedy


def test_a_verify_row_is_penalised_over_the_drafts_before_it():
    """Row 1 of a chunk [t, 3, 3] would pick token 3 again without its penalties for draft 1 (3); with them
    (float64 reference: plain decoding, one token at a time) token 5: draft 1 is accepted, draft 2 rejected."""
    from kimik3.engine.sample.sampler import Sampler
    from kimik3.engine.spec.verify import verify
    params = SamplingParams(temperature=0, max_tokens=8, **PENALTIES)
    logits = torch.full((3, 8), -1.0)
    logits[0, 3], logits[0, 5] = 1.0, 0.5
    logits[1, 3], logits[1, 5] = 1.0, 0.9
    logits[2, 3], logits[2, 5] = 1.0, 0.2
    want, hist = [], [1]
    for row in logits.double():                  # plain decoding from the definitions
        rep = torch.zeros(8, dtype=torch.bool)
        rep[hist] = True
        x = torch.where(rep, torch.where(row > 0, row / 1.3, row * 1.3), row)
        counts = torch.bincount(torch.tensor(hist[1:], dtype=torch.int64), minlength=8).double()
        want.append(int((x - 0.4 * counts - 0.3 * (counts > 0).double()).argmax()))
        hist.append(want[-1])
    assert want[:2] == [3, 5]
    chunk = SimpleNamespace(req=_Req([1], params), draft=[3, 3])
    out = verify(Sampler(8, torch.device("cpu"), 0, 2), [chunk], logits, logits)
    assert out.accepted == [[3]] and out.token_ids == [5]
