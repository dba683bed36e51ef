"""Hostile constraints cost one request a ValueError (the server's 400), never the process: grammars that crash
llguidance's compiler (signal 11), overrun the time or memory budget, nest too deeply, or would make every
engine step compute dozens of expensive masks. Each grammar is compiled once (checked in the worker, then
one template here) however many samples use it."""

from __future__ import annotations

import time

import pytest

import kimik3
from kimik3.engine.sample.sampling_params import StructuredOutputsParams as SO
from kimik3.engine.sample.structured import GrammarCompiler
from kimik3.testing import object_chain, rule_chain


@pytest.fixture(scope="module")
def tok():
    return kimik3.load_tokenizer(kimik3.DEFAULT_MODEL)


@pytest.fixture(scope="module")
def compiler(tok):
    c = GrammarCompiler(tok, tok.vocab_size, tok.stop_token_ids, timeout=2.0)
    c.prepare(SO(choice=["warm"]))        # the worker and the tokenizer are up before any budget is timed
    yield c
    c.close()


HOSTILE = {
    "defs_chain_1000": (SO(json=object_chain(1000)), "the grammar compiler failed"),     # llguidance: signal 11
    "rule_chain_3000": (SO(grammar=rule_chain(3000)), "the grammar compiler failed"),    # signal 11
    "allof_22_patterns": (SO(json={"type": "string",
                                   "allOf": [{"pattern": f"^(.*a.*){{{i}}}$"} for i in range(1, 23)]}),
                          "within the 2 s budget"),                                     # ~25 s alone
    "json_text_nested_600": (SO(json='{"type":"object","properties":{"a":' * 600 + "{}" + "}}" * 600),
                             "nested too deeply"),
    "grammars_list_nested": (SO(grammar='{"grammars": ' + "[" * 5000 + "]" * 5000 + "}"), "does not compile"),
    "grammars_list_missing": (SO(grammar='{"no": 1}'), "does not compile"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_constraints_are_errors_within_budget(compiler, name):
    so, message = HOSTILE[name]
    start = time.monotonic()
    with pytest.raises(ValueError, match=message):
        compiler.prepare(so, copies=1)
    assert time.monotonic() - start < compiler.timeout + 8.0      # the budget, a worker restart, a loaded CI
    m = compiler.matcher(SO(regex="[0-9]+"))        # the compiler still works (a crashed worker is replaced)
    assert m.consume(tok_id(compiler, "7"))


def tok_id(compiler, text: str) -> int:
    (t,) = compiler.tokenizer.encode(text)
    return t


def test_memory_budget(tok):
    """A grammar whose compile + first mask needs more than the worker's memory budget is refused;
    a cheap one is not."""
    c = GrammarCompiler(tok, tok.vocab_size, tok.stop_token_ids, memory_bytes=32 << 20)
    try:
        with pytest.raises(ValueError, match="32 MiB budget"):
            c.prepare(SO(regex="x{1000000}"))
        c.prepare(SO(regex="[a-z]{1,3}"))
    finally:
        c.close()


def test_many_samples_of_an_expensive_mask_are_refused(tok):
    """``x{1000000}`` with n=64: each step would compute 64 masks of ~50 ms on the engine thread (the
    compile itself takes ~2 s, so the time budget is generous here)."""
    c = GrammarCompiler(tok, tok.vocab_size, tok.stop_token_ids, timeout=60.0)
    try:
        with pytest.raises(ValueError, match=r"64 sample\(s\) would hold every step .* ask for fewer samples"):
            c.prepare(SO(regex="x{1000000}"), copies=64)
    finally:
        c.close()


def test_one_compile_per_grammar_and_independent_copies(compiler, tok, monkeypatch):
    so = SO(json={"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]})
    calls = []
    validate = compiler.workers.validate
    monkeypatch.setattr(compiler.workers, "validate", lambda text: (calls.append(text), validate(text))[1])
    compiler.prepare(so, copies=8)
    again = SO(json={"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]})
    compiler.prepare(again, copies=8)      # an equal schema: the cached template
    assert len(calls) == 1
    a, b = compiler.matcher(so), compiler.matcher(so)
    assert a.m is not b.m
    for t in tok.encode('{"k": 1'):
        assert a.consume(t)
    assert not a.stopped and b.m.validate_tokens(tok.encode('{"k": 2}')) == len(tok.encode('{"k": 2}'))
    assert len(so.__dict__["_kimik3_copies"]) == 6

