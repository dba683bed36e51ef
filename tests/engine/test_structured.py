"""Logit controls and constrained decoding in the engine, on the embedded random K3 and the fake model.

Outputs are checked by independent means: ``json`` + ``jsonschema`` for schemas, Python's ``re`` for
regexes, a float64 per-row loop for the logit-control arithmetic, the plain engine for bit-identity."""

from __future__ import annotations

import json
import math
import random
import re

import jsonschema
import pytest
import torch

import kimik3
from kimik3.engine import SamplingParams
from kimik3.engine.logit_controls import ControlRow, apply_controls
from kimik3.engine.sampling_params import StructuredOutputsParams as SO
from kimik3.engine.structured import GrammarCompiler, unpack_bitmask
from tests.engine.fake_model import FakeModel
from tests.engine.schemas import random_regex, random_schema

FORMATS = jsonschema.FormatChecker()


@pytest.fixture(scope="module")
def llm():
    return kimik3.LLM(kimik3.DEFAULT_MODEL, max_num_seqs=64, max_model_len=512)


@pytest.fixture(scope="module")
def tok(llm):
    return llm.engine.get_tokenizer()


def _gen(llm, prompts, params):
    return llm.generate(prompts, params)


# ---- logit controls -----------------------------------------------------------------------------

def test_apply_controls_matches_a_float64_loop():
    """Bias, bans (min_tokens, bad words) and allowed ids rewrite exactly the controlled rows."""
    torch.manual_seed(0)
    vocab = 50
    logits = torch.randn(4, vocab)
    p_bias = SamplingParams(logit_bias={3: 5.0, 7: -2.5}, min_tokens=4)
    p_allow = SamplingParams(allowed_token_ids=[1, 2, 9], bad_words=["x"])
    rows = [ControlRow(p_bias, [1, 2], [0, 11], []), ControlRow(p_allow, [5, 6], [0], [[6, 9], [2]])]
    out = apply_controls(logits, [1, 3], rows, None)
    want = logits.double().clone()
    want[1, 3] += 5.0
    want[1, 7] -= 2.5
    want[1, 0] = want[1, 11] = -math.inf        # 2 tokens < min_tokens=4: the end ids are banned
    keep = {1}                                   # of 1, 2, 9: 2 is a one-token bad word, 9 ends "6 9"
    for t in range(vocab):
        if t not in keep:
            want[3, t] = -math.inf
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.allclose(out.double(), want, atol=1e-6, equal_nan=False)


def test_logit_bias_forces_a_token(llm):
    outs = _gen(llm, ["Hello", "Hello"], [SamplingParams(max_tokens=8, temperature=0, logit_bias={77: 100}),
                                          SamplingParams(max_tokens=8, temperature=1.0, seed=3, logit_bias={77: 100})])
    for o in outs:
        assert o.outputs[0].token_ids == [77] * 8


def test_allowed_bad_words_min_tokens(llm, tok):
    eos = llm.engine.model.config.text.eos_token_id
    allowed = [65, 66, 67, eos]
    outs = _gen(llm, ["Hi"] * 3, [
        SamplingParams(max_tokens=30, temperature=1.0, seed=1, allowed_token_ids=allowed),
        SamplingParams(max_tokens=12, temperature=0, logit_bias={eos: 30.0}, min_tokens=5),
        SamplingParams(max_tokens=40, temperature=1.0, seed=2, bad_words=["the", "a"]),
    ])
    assert set(outs[0].outputs[0].token_ids) <= set(allowed)
    ids = outs[1].outputs[0].token_ids
    assert eos not in ids[:5] and ids[5] == eos and len(ids) == 6
    banned = [tok.encode(w) for w in ("the", " the", "a", " a")]
    got = outs[2].outputs[0].token_ids
    for w in banned:
        assert not any(got[i:i + len(w)] == w for i in range(len(got))), w


def test_include_stop_str_in_output(llm, tok):
    plain = _gen(llm, ["Hello"], SamplingParams(max_tokens=20, temperature=0))[0].outputs[0].text
    stop = plain[5:8]
    cut = _gen(llm, ["Hello"], SamplingParams(max_tokens=20, temperature=0, stop=[stop]))[0].outputs[0]
    kept = _gen(llm, ["Hello"], SamplingParams(max_tokens=20, temperature=0, stop=[stop],
                                               include_stop_str_in_output=True))[0].outputs[0]
    i = plain.find(stop)
    assert cut.text == plain[:i] and kept.text == plain[:i + len(stop)] and kept.stop_reason == stop


def test_prompt_logprobs_match_a_full_forward():
    llm = kimik3.LLM(kimik3.DEFAULT_MODEL, max_num_seqs=4, max_model_len=256, max_num_batched_tokens=7,
                     enable_prefix_caching=True, dtype=torch.float64)
    ids = list(range(40, 70))
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=2))     # cached: must not be reused
    o = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))[0]
    with torch.inference_mode():
        ref = llm.engine.model(torch.tensor(ids)).double().log_softmax(-1)
    assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        d = o.prompt_logprobs[p]
        assert abs(d[ids[p]] - ref[p - 1, ids[p]].item()) < 1e-9
        top = ref[p - 1].topk(3)
        assert set(top.indices.tolist()) <= set(d)


def _fake_engine_llm(tok):
    """An LLM-like driver over the fake model (exact, row-independent logits) with the real tokenizer."""
    from kimik3.engine import EngineConfig, LLMEngine
    engine = LLMEngine(FakeModel(vocab_size=tok.vocab_size, eos_token_id=tok.stop_token_ids[0]),
                       EngineConfig(max_num_seqs=16, max_model_len=256, block_size=16), tokenizer=tok)
    llm = kimik3.LLM.__new__(kimik3.LLM)
    llm.engine, llm._ids = engine, iter(range(10**9))
    return llm


@pytest.mark.parametrize("model", ["fake", "tiny-k3"])
def test_controlled_rows_leave_plain_rows_bit_identical(llm, tok, model):
    """The same batch with and without controls on three of its rows: the two plain rows get the same
    tokens and, on the fake model (whose rows do not depend on each other), bit-identical logprobs.
    (On the tiny K3 the MoE groups tokens by expert, so other rows' tokens move a row's float sums in
    the last bits: there the logprobs agree to 1e-5.) Every row runs all 16 steps."""
    if model == "fake":
        llm = _fake_engine_llm(tok)
    plain = [SamplingParams(max_tokens=16, temperature=0, logprobs=2, ignore_eos=True),
             SamplingParams(max_tokens=16, temperature=1.0, seed=5, logprobs=1, ignore_eos=True)]
    prompts = ["Hello there", "Once upon", "x", "y", "z"]
    free = [SamplingParams(max_tokens=16, temperature=1.0, seed=1, ignore_eos=True),
            SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=16, temperature=1.0, seed=2, ignore_eos=True)]
    controlled = [SamplingParams(max_tokens=16, temperature=1.0, seed=1, structured_outputs=SO(regex="[a-z]{200}")),
                  SamplingParams(max_tokens=16, temperature=0, logit_bias={5: 50.0}, bad_words=["is"], ignore_eos=True),
                  SamplingParams(max_tokens=16, temperature=1.0, seed=2, allowed_token_ids=[70, 71])]
    alone = _gen(llm, prompts, plain + free)
    mixed = _gen(llm, prompts, plain + controlled)
    for a, m in zip(alone[:2], mixed[:2]):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids
        if model == "fake":
            assert a.outputs[0].logprobs == m.outputs[0].logprobs       # floats, compared exactly
        else:
            for x, y in zip(a.outputs[0].logprobs, m.outputs[0].logprobs):
                assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-5 for t in x)
    assert all(len(o.outputs[0].token_ids) == 16 for o in alone + mixed)
    assert re.fullmatch("[a-z]+", mixed[2].outputs[0].text) and set(mixed[4].outputs[0].token_ids) <= {70, 71}


# ---- constrained decoding -------------------------------------------------------------------------

def _valid(kind, spec, text) -> bool:
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    try:
        jsonschema.validate(json.loads(text), spec, format_checker=FORMATS)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def property_run(llm, n: int, seed: int, max_tokens: int = 440, progress=None) -> tuple[int, list]:
    """``n`` generated schemas and regexes sampled at temperature 1.0: (count, invalid outputs);
    ``progress(done, invalid)`` after each batch."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        if i % 4 == 3:
            rx = random_regex(rng)
            cases.append(("regex", rx, SO(regex=rx)))
        else:
            sch = random_schema(rng)
            cases.append(("json", sch, SO(json=sch)))
    bad = []
    for lo in range(0, n, 64):
        part = cases[lo:lo + 64]
        outs = llm.generate([f"case {lo + k}" for k in range(len(part))],
                            [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed * 100_000 + lo + k,
                                            structured_outputs=so) for k, (_, _, so) in enumerate(part)])
        for (kind, spec, _), o in zip(part, outs):
            c = o.outputs[0]
            if c.finish_reason != "stop" or not _valid(kind, spec, c.text):
                bad.append((kind, spec, c.text, c.finish_reason))
        if progress is not None:
            progress(lo + len(part), bad)
    return n, bad


def test_generated_schemas_and_regexes_always_validate(llm):
    n, bad = property_run(llm, 256, seed=7)
    assert not bad, f"{len(bad)} of {n} invalid, first: {bad[:3]}"


@pytest.mark.parametrize("so,check", [
    (SO(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    (SO(choice=["red", "green", "blue sky"]), lambda t: t in ("red", "green", "blue sky")),
    (SO(regex=r"(ab|cd){2,3}-[0-9]{2}"), lambda t: re.fullmatch(r"(ab|cd){2,3}-[0-9]{2}", t)),
    (SO(grammar='start: "x" num ("," num)*\nnum: /[1-9][0-9]?/\n'), lambda t: re.fullmatch(r"x[1-9][0-9]?(,[1-9][0-9]?)*", t)),
    (SO(grammar='root ::= "a" [0-9] "b"'), lambda t: re.fullmatch(r"a[0-9]b", t)),
], ids=["json_object", "choice", "regex", "lark", "gbnf"])
def test_each_mode(llm, tok, so, check):
    # a random model writes any JSON object for ever; allowed_token_ids (a few one-character tokens and
    # the end token) keeps its keys and values short, the grammar still decides what is valid
    small = [t for t in range(tok.num_base_tokens) if tok.decode([t]) in set('{}":1a')]
    extra = {"allowed_token_ids": small + [llm.engine.model.config.text.eos_token_id]} if so.json_object else {}
    outs = llm.generate(["Hi"] * 4, [SamplingParams(max_tokens=300, temperature=1.0, seed=s, structured_outputs=so,
                                                    **extra) for s in range(4)])
    for o in outs:
        assert o.outputs[0].finish_reason == "stop" and check(o.outputs[0].text), o.outputs[0].text


def test_bad_constraints_are_refused_before_queueing(llm):
    for so in (SO(regex="(unclosed"), SO(json={"type": "object", "properties": {"a": {"type": "frob"}}}),
               SO(grammar="start: nothing_defined")):
        with pytest.raises(ValueError, match="structured_outputs"):
            llm.engine.add_request("bad", "Hi", SamplingParams(structured_outputs=so))
        assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="exactly one"):
        SO(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=SO(regex="a"))


def test_bitmask_unpacks_to_the_matchers_tokens(tok):
    compiler = GrammarCompiler(tok, tok.vocab_size, tok.stop_token_ids)
    m = compiler.matcher(SO(choice=["yes", "no"]))
    allowed = unpack_bitmask(compiler.fill_bitmasks([(m, []), (None, [])]), tok.vocab_size, torch.device("cpu"))
    firsts = {t for t in range(tok.vocab_size) if any(w.startswith(tok.decode([t])) and tok.decode([t])
                                              for w in ("yes", "no")) and t < tok.num_base_tokens}
    assert set(allowed[0].nonzero().flatten().tolist()) == firsts
    assert bool(allowed[1].all())


def test_speculation_with_a_constraint_gives_the_same_greedy_tokens():
    schema = {"type": "array", "items": {"enum": ["ab", "ab", "cd"]}, "minItems": 8, "maxItems": 8}
    schema["items"] = {"enum": ["ab", "cd"]}
    prompt = '["ab", "ab", "ab", "ab", "ab", "ab", "ab", "ab"] and again '
    outs, engines = {}, {}
    for spec in (0, 3):
        llm = kimik3.LLM(kimik3.DEFAULT_MODEL, max_num_seqs=8, max_model_len=512, num_speculative_tokens=spec)
        params = [SamplingParams(max_tokens=80, temperature=0, structured_outputs=SO(json=schema)),
                  SamplingParams(max_tokens=40, temperature=0, structured_outputs=SO(regex=r"(ab ){10}"))]
        outs[spec] = [o.outputs[0].token_ids for o in llm.generate([prompt, prompt + "ab ab ab "], params)]
        engines[spec] = llm.engine
    assert outs[3] == outs[0]
    assert engines[3].num_draft_tokens > 0 and engines[3].num_accepted_tokens > 0


def test_constraints_survive_chunked_prefill_preemption_and_prefix_hits(tok):
    """Greedy constrained requests in a cache too small for all of them (preemptions), 5-token prefill
    chunks and a shared prompt (prefix hits) give the tokens of a roomy one-chunk run, all valid."""
    from tests.engine.helpers import make_engine, run
    model = kimik3.load_model(kimik3.DEFAULT_MODEL, dtype=torch.float64)
    schema = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 99},
                                                      "minItems": 12, "maxItems": 12},
                                               "w": {"enum": ["alpha", "beta"]}},
              "required": ["xs", "w"], "additionalProperties": False}
    shared = tok.encode("a shared prompt that is long enough to fill a few cache blocks, " * 2)
    rx = r"([a-z]{2,5} ){16}"
    reqs = {f"r{i}": ((shared if i < 3 else tok.encode(f"another prompt {i} " * 6)) + tok.encode(f" number {i}"),
                      SamplingParams(max_tokens=70, temperature=0, structured_outputs=SO(json=schema)
                                     if i % 2 == 0 else SO(regex=rx)))
            for i in range(6)}
    roomy = run(make_engine(model, tokenizer=tok, max_num_seqs=8, max_model_len=128), reqs)
    tight_engine = make_engine(model, tokenizer=tok, max_num_seqs=8, max_model_len=128, max_num_batched_tokens=5,
                               enable_prefix_caching=True, extra_blocks=1)
    tight = run(tight_engine, reqs)
    assert tight_engine.scheduler.num_preemptions > 0 and tight_engine.kv.num_hit_tokens > 0
    for rid, (_, params) in reqs.items():
        ids = tight[rid][0][0]
        assert ids == roomy[rid][0][0], rid
        text = tok.decode(ids[:-1] if ids[-1] in tok.stop_token_ids else ids)
        if params.structured_outputs.json is not None:
            jsonschema.validate(json.loads(text), schema)
        else:
            assert re.fullmatch(rx, text), text


if __name__ == "__main__":      # the 10,000 target: python -m tests.engine.test_structured 10000
    import sys
    import time
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    t0 = time.perf_counter()
    total, invalid = property_run(kimik3.LLM(kimik3.DEFAULT_MODEL, max_num_seqs=64, max_model_len=512), count, seed=11,
                                  progress=lambda done, bad: print(f"{done} done, {len(bad)} invalid, "
                                                                   f"{time.perf_counter() - t0:.0f} s", flush=True))
    kinds = {k: sum(1 for i in range(total) if (i % 4 == 3) == (k == "regex")) for k in ("json", "regex")}
    print(f"{total} constraints ({kinds['json']} JSON schemas, {kinds['regex']} regexes) sampled at temperature 1.0: "
          f"{len(invalid)} invalid, {time.perf_counter() - t0:.0f} s")
    for row in invalid[:10]:
        print(row)
