"""Logit controls and constrained decoding in the engine, on the embedded random K3 and the fake model.

Outputs are checked by independent means: ``json`` + ``jsonschema`` for schemas (its ``pattern``,
``uuid`` and ``date`` checks made JSON Schema's: ECMA-262 regexes through ``regress``, RFC 4122 hex digits,
RFC 3339 dates from the calendar rule), ``regress``
(an ECMA-262 regex engine) for regexes, a float64 per-row loop for the logit-control arithmetic, the
plain engine for bit-identity."""

from __future__ import annotations

import json
import math
import random
import re
import unicodedata
from dataclasses import dataclass, field

import jsonschema
import pytest
import regress
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kimik3
from kimik3.engine import SamplingParams
from kimik3.engine.sample.logit_controls import BadWords, ControlRow, apply_controls
from kimik3.engine.sample.sampling_params import StructuredOutputsParams as SO
from kimik3.engine.sample.structured import GrammarCompiler, unpack_bitmask
from tests.engine.fake_model import FakeModel
from tests.engine.schemas import max_output_bytes, random_regex, random_schema, regex_max_chars

FORMATS = jsonschema.FormatChecker()
REGEX_CHAR_BYTES = 4        # a character of a regex match is at most 4 bytes of UTF-8


@FORMATS.checks("uuid")
def _uuid(text) -> bool:
    """RFC 4122's ABNF: ASCII hex digits (jsonschema's check, through ``uuid.UUID``, takes any Unicode digit)."""
    hexa = "[0-9a-fA-F]"
    return not isinstance(text, str) or re.fullmatch(f"{hexa}{{8}}(-{hexa}{{4}}){{3}}-{hexa}{{12}}", text) is not None


def _rfc3339_days(year: int, month: int) -> int:
    leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
    return [31, 29 if leap else 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31][month - 1]


@FORMATS.checks("date")
def _date(text) -> bool:
    """RFC 3339 full-date: 4-digit year (0000 included: jsonschema's check, through ``datetime``, refuses
    years before 1), month 01-12, day within the month (Feb 29 in leap years only)."""
    if not isinstance(text, str):
        return True
    m = re.fullmatch(r"([0-9]{4})-([0-9]{2})-([0-9]{2})", text)
    return m is not None and 1 <= int(m[2]) <= 12 and 1 <= int(m[3]) <= _rfc3339_days(int(m[1]), int(m[2]))


def _ecma_pattern(validator, pattern, instance, schema):
    """JSON Schema's ``pattern``: an ECMA-262 regex found anywhere in the string (jsonschema uses Python's
    ``re``, where ``\\d`` is any Unicode digit; in ECMA-262 it is [0-9])."""
    if validator.is_type(instance, "string") and regress.Regex(pattern).find(instance) is None:
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


VALIDATOR = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"pattern": _ecma_pattern})


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
    rows = [ControlRow(p_bias, [1, 2], [0, 11], None), ControlRow(p_allow, [5, 6], [0], BadWords([[6, 9], [2]]))]
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


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=4), max_size=12),
       st.lists(st.integers(0, 4), max_size=8))
def test_bad_word_index_bans_what_a_scan_of_every_word_bans(words, hist):
    want = sorted(w[-1] for w in words if len(w) == 1 or (len(hist) >= len(w) - 1 and hist[len(hist) - len(w) + 1:] == w[:-1]))
    assert sorted(BadWords(words).banned(hist)) == want


def test_apply_controls_on_every_row_leaves_the_raw_logits():
    """Every row controlled (no gather, no scatter): the result is right and the input (the raw logits,
    kept for logprobs) is not written."""
    torch.manual_seed(1)
    logits = torch.randn(2, 40)
    raw = logits.clone()
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[:, 0] = (1 << 5) | (1 << 7)                  # the grammar allows tokens 5 and 7
    rows = [ControlRow(SamplingParams(logit_bias={7: 3.0}), [], [], None), ControlRow(SamplingParams(), [], [], None)]
    out = apply_controls(logits, [0, 1], rows, bitmask)
    want = torch.full((2, 40), -math.inf, dtype=torch.float64)
    want[:, 5], want[:, 7] = raw[:, 5].double(), raw[:, 7].double()
    want[0, 7] += 3.0
    assert torch.equal(logits, raw)
    assert torch.allclose(out.double(), want, atol=1e-6)


def test_bad_words_and_min_tokens_read_the_output_and_drafts_only():
    """Over a long output: a bad word's last token is banned on each row whose output (drafts before
    the row included) ends in the word's other tokens, never by prompt tokens; min_tokens counts
    output tokens and drafts."""
    from kimik3.engine.core.request import Request
    from kimik3.engine.core.scheduler_output import ScheduledChunk
    from kimik3.engine.sample.logit_controls import controlled_logits
    from kimik3.engine.spec.verify import row_spans
    params = SamplingParams(min_tokens=502, max_tokens=1000, bad_words=["unused"])
    chunks = []
    for outputs, draft in (([9] + [1] * 497 + [5, 6], [2, 5, 6]), ([9], [])):
        req = Request("r", [7, 8], params, 0.0, eos_token_id=0, block_size=4)
        req.bad_words = BadWords([[8, 9, 3], [5, 6, 4]])     # "8 9" would straddle the prompt: never a match
        for t in outputs:
            req.append_token(t)
        chunks.append(ScheduledChunk(req, 1 + len(draft), req.num_tokens - 1, draft=draft))
    out = controlled_logits(chunks, row_spans(chunks), torch.zeros(5, 12))
    banned = [sorted(int(t) for t in torch.nonzero(row == -math.inf)) for row in out]
    # rows 0-3 follow 500 output tokens ending in 5 6, then drafts 1..j (501-503 tokens); row 4 follows [9]
    assert banned == [[0, 4], [0], [], [4], [0]]


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


@pytest.mark.parametrize("rows", [None, 4])
def test_prompt_logprobs_match_a_full_forward(rows, monkeypatch):
    """Also with at most 4 prompt positions scored a step (``scheduler.PROMPT_LOGPROB_ROWS``, 1024: it bounds the
    logits rows, as the cache plan's workspace counts them): the chunks shrink, the numbers stay."""
    if rows is not None:
        monkeypatch.setattr("kimik3.engine.core.scheduler.PROMPT_LOGPROB_ROWS", rows)
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
    if rows is not None:
        assert llm.engine.runner.num_steps >= (len(ids) - 1) // rows


def _fake_engine_llm(tok, monkeypatch):
    """An ``LLM`` over the fake model (exact, row-independent logits) with the real tokenizer: built through
    ``LLM()`` with its engine builder swapped, so every attribute ``LLM`` sets stays set."""
    import kimik3.engine.llm as llm_module
    from kimik3.engine import EngineConfig, LLMEngine
    engine = LLMEngine(FakeModel(vocab_size=tok.vocab_size, eos_token_id=tok.stop_token_ids[0]),
                       EngineConfig(max_num_seqs=16, max_model_len=256, block_size=16), tokenizer=tok)
    monkeypatch.setattr(llm_module, "build_engine", lambda args, tokenizer=None: (engine, None))
    return kimik3.LLM()


@pytest.mark.parametrize("model", ["fake", "tiny-k3"])
def test_controlled_rows_leave_plain_rows_bit_identical(llm, tok, model, monkeypatch):
    """The same batch with and without controls on three of its rows: the two plain rows get the same
    tokens and, on the fake model (whose rows do not depend on each other), bit-identical logprobs.
    (On the tiny K3 the MoE groups tokens by expert, so other rows' tokens move a row's float sums in
    the last bits: there the logprobs agree to 1e-5.) Every row runs all 16 steps."""
    if model == "fake":
        llm = _fake_engine_llm(tok, monkeypatch)
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

def _strict_object(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate keys in {keys}")
    return dict(pairs)


def _not_json(name):
    raise ValueError(f"{name} is not JSON (RFC 8259)")


def _valid(kind, spec, text) -> bool:
    """A regex: ``text`` is a full ECMA-262 match. A schema: ``text`` is RFC 8259 JSON (no NaN, no
    duplicate keys) and valid under JSON Schema 2020-12 with format assertions."""
    if kind == "regex":
        return regress.Regex(f"^(?:{spec})$").find(text) is not None
    try:
        VALIDATOR(spec, format_checker=FORMATS).validate(json.loads(text, object_pairs_hook=_strict_object,
                                                                    parse_constant=_not_json))
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def draw_cases(n: int, seed: int, max_tokens: int) -> tuple[list[tuple], int]:
    """``n`` cases ``(kind, spec, constraint, max_tokens)``, every fourth a regex, the others JSON schemas,
    and how many schemas were drawn again. A case's ``max_tokens`` is its longest valid output in bytes
    plus 1 (a token is at least a byte; the end token last), so every output can finish; a schema whose
    longest output does not fit in ``max_tokens`` is drawn again (3 in 1,000 at 440)."""
    rng = random.Random(seed)
    cases, redrawn = [], 0
    for i in range(n):
        if i % 4 == 3:
            rx = random_regex(rng)
            cases.append(("regex", rx, SO(regex=rx), REGEX_CHAR_BYTES * regex_max_chars(rx) + 1))
            continue
        while True:
            sch = random_schema(rng)
            need = max_output_bytes(sch) + 1
            if need <= max_tokens:
                break
            redrawn += 1
        cases.append(("json", sch, SO(json=sch), need))
    return cases, redrawn


@dataclass
class PropertyRun:
    count: int
    invalid: list = field(default_factory=list)     # (kind, spec, text, finish_reason): stopped, but not valid
    length: list = field(default_factory=list)      # the same, cut at max_tokens before the output was complete
    redrawn: int = 0


def property_run(llm, n: int, seed: int, max_tokens: int = 440, progress=None) -> PropertyRun:
    """``n`` generated schemas and regexes (``draw_cases``) sampled at temperature 1.0; ``progress(run)``
    after each batch of 64."""
    cases, redrawn = draw_cases(n, seed, max_tokens)
    run = PropertyRun(n, redrawn=redrawn)
    for lo in range(0, n, 64):
        part = cases[lo:lo + 64]
        outs = llm.generate([f"case {lo + k}" for k in range(len(part))],
                            [SamplingParams(max_tokens=need, temperature=1.0, seed=seed * 100_000 + lo + k,
                                            structured_outputs=so) for k, (_, _, so, need) in enumerate(part)],
                            use_tqdm=False)
        for (kind, spec, _, _), o in zip(part, outs):
            c = o.outputs[0]
            if c.finish_reason == "length":
                run.length.append((kind, spec, c.text, c.finish_reason))
            elif c.finish_reason != "stop" or not _valid(kind, spec, c.text):
                run.invalid.append((kind, spec, c.text, c.finish_reason))
        if progress is not None:
            progress(lo + len(part), run)
    return run


def test_generated_schemas_and_regexes_always_validate(llm):
    run = property_run(llm, 256, seed=7)
    assert not run.invalid and not run.length, (f"{len(run.invalid)} invalid, {len(run.length)} cut at max_tokens "
                                                f"of {run.count}, first: {(run.invalid + run.length)[:3]}")


# Decimal digits beyond ASCII: Python 3.11's (Unicode 14) and some of Unicode 15 and 16's, which Rust's
# regex crate (llguidance) knows and Python's re does not (a random model wrote U+116D3 and U+1CCF9 for \\d).
UNICODE_DIGITS = ([chr(c) for c in range(0x80, 0x110000) if unicodedata.category(chr(c)) == "Nd"]
                  + [chr(c) for c in (*range(0x11F50, 0x11F5A), *range(0x1E4F0, 0x1E4FA), *range(0x116D0, 0x116E4),
                                      *range(0x1CCF0, 0x1CCFA))])


@pytest.mark.parametrize("so,quote", [(SO(regex=r"x\d{2}"), ""), (SO(regex=r"x[\d]\w"), ""),
                                      (SO(json={"type": "string", "pattern": r"^x\d{2}$"}), '"')],
                         ids=["regex", "regex-class", "schema-pattern"])
def test_digit_classes_are_ascii_as_in_json_schema(tok, so, quote):
    """\\d is [0-9] and \\w [0-9A-Za-z_] (ECMA-262, JSON Schema's regexes) in a regex constraint as in a
    schema's pattern: the grammar takes ASCII digits and no other decimal digit."""
    m = GrammarCompiler(tok, tok.vocab_size, tok.stop_token_ids).matcher(so)
    end = [tok.stop_token_ids[0]]

    def takes(text):
        ids = tok.encode(quote + text + quote)
        return m.m.validate_tokens(ids + end) == len(ids) + 1
    assert all(takes(f"x{d}{d}") for d in "0123456789")
    taken = [d for d in UNICODE_DIGITS if takes(f"x{d}{d}") or takes(f"x{d}0") or takes(f"x0{d}")]
    assert not taken, [f"U+{ord(d):04X}" for d in taken]


def test_validator_reads_regexes_and_formats_as_json_schema():
    """The property check's side of the same semantics: ECMA-262 \\d and \\w, RFC 4122 hex digits."""
    arabic, outlined = "\u0661", "\U0001CCF9"
    assert _valid("regex", r"\d{2}", "12") and not _valid("regex", r"\d{2}", arabic * 2)
    assert not _valid("regex", r"(\d\d)?[0-9]{2}", outlined + "000") and not _valid("regex", r"\w", "\u00e9")
    pattern = {"type": "string", "pattern": r"^\d+$"}
    assert _valid("json", pattern, '"42"') and not _valid("json", pattern, json.dumps(arabic))
    uuid = {"type": "string", "format": "uuid"}
    good = "12345678-abcd-ABCD-1234-123456789abc"
    assert _valid("json", uuid, json.dumps(good)) and not _valid("json", uuid, json.dumps(arabic + good[1:]))
    assert not _valid("json", {"type": "number"}, "NaN") and not _valid("json", {"type": "object"}, '{"a": 1, "a": 2}')
    date = {"type": "string", "format": "date"}
    assert _valid("json", date, '"0000-02-29"') and _valid("json", date, '"2024-02-29"')
    assert not any(_valid("json", date, f'"{d}"') for d in ("2021-02-29", "1900-02-29", "2021-04-31", "2021-13-01"))


def test_dates_follow_the_calendar(tok):
    """A "date" format takes RFC 3339 dates: Feb 29 of leap years only (llguidance's own date grammar takes
    it in every year), every valid day of a month and no other; also where the schema nests it under a
    property named like a keyword and beside its own pattern."""
    compiler = GrammarCompiler(tok, tok.vocab_size, tok.stop_token_ids)
    end = [tok.stop_token_ids[0]]

    def takes(m, text):
        ids = tok.encode(text)
        return m.m.validate_tokens(ids + end) == len(ids) + 1
    m = compiler.matcher(SO(json={"type": "string", "format": "date"}))
    leap = [y for y in range(10_000) if _rfc3339_days(y, 2) == 29]
    assert [y for y in range(10_000) if takes(m, f'"{y:04d}-02-29"')] == leap
    for year in (0, 1900, 2000, 2021, 2024, 9999):
        days = [(mo, d) for mo in range(0, 14) for d in range(0, 33) if takes(m, f'"{year:04d}-{mo:02d}-{d:02d}"')]
        assert days == [(mo, d) for mo in range(1, 13) for d in range(1, _rfc3339_days(year, mo) + 1)], year
    nested = {"type": "object", "properties": {"enum": {"type": "array", "items": {"format": "date", "pattern": "^2"}}},
              "required": ["enum"], "additionalProperties": False}
    m = compiler.matcher(SO(json=nested))
    assert takes(m, '{"enum": ["2024-02-29"]}') and not takes(m, '{"enum": ["1024-02-29"]}')
    assert not takes(m, '{"enum": ["2023-02-29"]}')


def _longest_walk(compiler, tok, so, rng) -> int:
    """Bytes of an output written to be long: each step takes a random one of the shortest tokens the
    grammar allows (one byte), of those a backslash first (then ``u``: a ``\\uXXXX`` escape) and closers
    (``"``, ``]``, ``}``) last, an end token only when nothing else is allowed."""
    m = compiler.matcher(so)
    ends = set(compiler.end_token_ids)
    raw = [tok.token_bytes(t) if t < tok.num_base_tokens else b"" for t in range(tok.vocab_size)]
    out, escaped = 0, False
    while not m.stopped:
        rank = {b"u" if escaped else b"\\": 0, b'"': 2, b"]": 2, b"}": 2}
        mask = unpack_bitmask(compiler.fill_bitmasks([(m, [])]), tok.vocab_size, torch.device("cpu"))[0]
        allowed = [t for t in mask.nonzero().flatten().tolist() if t not in ends and raw[t]]
        if not allowed:
            assert m.consume(next(t for t in ends if mask[t]))
            break
        best = min((len(raw[t]), rank.get(raw[t], 1)) for t in allowed)
        t = rng.choice([t for t in allowed if (len(raw[t]), rank.get(raw[t], 1)) == best])
        assert m.consume(t)
        out, escaped = out + len(raw[t]), raw[t] == b"\\" and not escaped
    return out


def test_every_case_can_finish_within_its_max_tokens(tok):
    """The property run gives each case its longest output + 1 tokens: the generated schemas are
    satisfiable (every number range holds a multiple strictly inside; they compile), and outputs written
    to be as long as the grammar lets them stay within the bound."""
    from fractions import Fraction
    compiler = GrammarCompiler(tok, tok.vocab_size, tok.stop_token_ids)
    cases, _ = draw_cases(20_000, seed=3, max_tokens=440)
    assert all(need <= 440 for *_, need in cases)

    def numbers(sch):
        if sch.get("type") == "number":
            yield sch
        for sub in [*sch.get("properties", {}).values(), *([sch["items"]] if "items" in sch else [])]:
            yield from numbers(sub)
    for kind, spec, so, need in cases:
        for num in numbers(spec) if kind == "json" else ():
            lo, hi, mul = (Fraction(num[k]) for k in ("minimum", "maximum", "multipleOf"))
            assert (lo // mul + 1) * mul < hi, num
    for _, _, so, _ in cases[:400]:
        compiler.check(so)
    rng = random.Random(0)
    for kind, spec, so, need in cases[:120]:
        assert _longest_walk(compiler, tok, so, rng) + 1 <= need, spec


@pytest.mark.parametrize("so,check", [
    (SO(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    (SO(choice=["red", "green", "blue sky"]), lambda t: t in ("red", "green", "blue sky")),
    (SO(regex=r"(ab|cd){2,3}-[0-9]{2}"), lambda t: re.fullmatch(r"(ab|cd){2,3}-[0-9]{2}", t)),
    # a finite language, so that every output ends (a sampled "," num loop may outlast max_tokens)
    (SO(grammar='start: "x" num ("," num)? ("," num)? ("," num)?\nnum: /[1-9][0-9]?/\n'),
     lambda t: re.fullmatch(r"x[1-9][0-9]?(,[1-9][0-9]?){0,3}", t)),
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
    for so in (SO(regex="(unclosed"), SO(regex="ab\\"), SO(grammar="start: nothing_defined"),
               SO(json={"type": "object", "properties": {"a": {"type": "frob"}}})):
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


def test_allowed_ids_the_constraint_cannot_start_with_are_refused(llm, tok):
    """allowed_token_ids that hold none of the tokens a constraint lets the output start with leave nothing to
    sample: refused before queueing (the grammar's mask won silently, emitting ids allowed_token_ids excluded).
    ``first_allows`` is checked against the first tokens read from the token texts."""
    compiler = GrammarCompiler(tok, tok.vocab_size, tok.stop_token_ids)
    so = SO(choice=["yes", "no"])
    firsts = {t for t in range(tok.num_base_tokens) if (s := tok.decode([t])) and any(w.startswith(s) for w in
                                                                                      ("yes", "no"))}
    others = [t for t in range(tok.num_base_tokens) if t not in firsts]
    assert firsts and all(compiler.first_allows(so, [t]) for t in firsts)
    assert not compiler.first_allows(so, others) and compiler.first_allows(so, others + [max(firsts)])
    for so, text in ((SO(regex="[0-9]+"), "A"), (SO(choice=["yes", "no"]), "maybe"), (SO(json_object=True), "x")):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            llm.engine.add_request("bad", "Hi", SamplingParams(allowed_token_ids=tok.encode(text),
                                                               structured_outputs=so))
        assert not llm.engine.has_unfinished_requests()
    digits = [t for t in range(tok.num_base_tokens) if tok.decode([t]).isascii() and tok.decode([t]).isdigit()]
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=0, structured_outputs=SO(regex="[0-9]+"),
                            allowed_token_ids=tok.encode("A") + digits)
    out = _gen(llm, ["Hi"], [params])
    assert out[0].outputs[0].text.isdigit()


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
    run = property_run(kimik3.LLM(kimik3.DEFAULT_MODEL, max_num_seqs=64, max_model_len=512), count, seed=11,
                       progress=lambda done, r: print(f"{done} done, {len(r.invalid)} invalid, {len(r.length)} cut at "
                                                      f"max_tokens, {time.perf_counter() - t0:.0f} s", flush=True))
    kinds = {k: sum(1 for i in range(run.count) if (i % 4 == 3) == (k == "regex")) for k in ("json", "regex")}
    print(f"{run.count} constraints ({kinds['json']} JSON schemas, {kinds['regex']} regexes; {run.redrawn} schemas "
          f"drawn again, their longest output over 440 tokens) sampled at temperature 1.0: {len(run.invalid)} invalid, "
          f"{len(run.length)} cut at max_tokens, {time.perf_counter() - t0:.0f} s")
    for row in (run.invalid + run.length)[:10]:
        print(row)
