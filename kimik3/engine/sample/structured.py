r"""Constrained decoding on llguidance: grammars from StructuredOutputsParams, per-request matchers,
and token bitmasks for the sampler.

Each constrained request owns an ``llguidance.LLMatcher`` over the engine's tokenizer (built once
from its ``tiktoken.Encoding``). Before a step samples, ``fill_bitmasks`` writes one int32 bitmask row
per logits row on the host (all matchers of the step in one parallel ``LLExecutor`` call); the sampler
copies it to the device and turns the bits of the masked-out tokens into -inf, after the logits
(so a CUDA-graph decode step stays a graph). After the step, each emitted token is consumed by its
request's matcher. Speculative rows: drafts are cut to the longest prefix the grammar accepts
(``valid_prefix``); the mask of the row after draft j is computed by consuming drafts 1..j and rolling
them back, so a verify step emits exactly the tokens plain constrained decoding gives. When a
matcher stops (its grammar is complete and it took an end token), the request finishes with "stop".

JSON schemas compile with compact separators (``", "`` and ``": "``, no free whitespace) unless the
schema's own ``x-guidance`` says otherwise: outputs stay short and every token counts.

A ``regex`` constraint has the semantics of a JSON Schema ``pattern`` (ECMA-262): ``\d`` is ``[0-9]`` and
``\w`` is ``[0-9A-Za-z_]``, as llguidance already reads the patterns inside schemas. (Handed over as is,
llguidance's regexes follow Rust's ``regex`` crate, where ``\d`` is any Unicode decimal digit: a random
model wrote U+116D3 and U+1CCF9, Unicode 16 digits that Python 3.11's ``re`` does not know.)
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from kimik3.engine.sample.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = {"type": "object"}
# RFC 3339 full-date with its day-of-month rule (llguidance's "date" takes Feb 29 of any year): a leap year
# ends in a multiple of 4 other than 00, or is a multiple of 400
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)"
DATE_PATTERN = ("^(?:[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
                f"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)$")
_DATA_KEYWORDS = ("enum", "const", "default", "examples")      # JSON values, not schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")   # name -> schema


def _strict_dates(node):
    """``node`` with every ``"format": "date"`` schema also under ``DATE_PATTERN`` (an ``allOf`` when the
    schema has its own pattern; llguidance intersects them)."""
    if isinstance(node, list):
        return [_strict_dates(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: _strict_dates(sub) for name, sub in v.items()}
        else:
            out[k] = v if k in _DATA_KEYWORDS else _strict_dates(v)
    if out.get("format") == "date":
        if "pattern" not in out:
            out["pattern"] = DATE_PATTERN
        else:
            out["allOf"] = [*out.get("allOf", []), {"pattern": DATE_PATTERN}]
    return out


def _llg():
    try:
        import llguidance     # (not llguidance.torch: importing it runs torch.compile, seconds)
    except ImportError as e:  # pragma: no cover - the test extra installs it
        raise ValueError(f"structured outputs need the llguidance package (a kimik3 dependency): "
                         f"pip install llguidance ({e})") from None
    return llguidance


def json_schema_for_llguidance(schema: dict | str) -> dict:
    """The schema with kimik3's JSON options (the schema's own ``x-guidance`` wins) and dates held to
    RFC 3339's calendar (``_strict_dates``)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    schema = _strict_dates(schema)
    return {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}


def lark_json(schema: dict | str) -> str:
    """A Lark ``%json`` item for ``schema`` (to embed JSON in a larger grammar)."""
    try:
        return "%json " + json.dumps(json_schema_for_llguidance(schema), ensure_ascii=False)
    except RecursionError:
        raise ValueError("a JSON schema is nested too deeply; flatten it") from None


def grammar_text(so: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet checked against a tokenizer)."""
    M = _llg().LLMatcher
    if so.json is not None or so.json_object:
        return M.grammar_from_json_schema(json_schema_for_llguidance(ANY_JSON_OBJECT if so.json_object else so.json))
    if so.regex is not None:
        if (len(so.regex) - len(so.regex.rstrip("\\"))) % 2:      # regex_to_lark would drop it silently
            raise ValueError("structured_outputs: the regex ends in a lone backslash")
        return M.grammar_from_lark(f"start: /{_llg().regex_to_lark(so.regex, 'dw')}/")    # ECMA-262 \d, \w
    if so.choice is not None:
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in so.choice))
    text = so.grammar
    if text.lstrip().startswith("{"):       # llguidance's own JSON form ({"grammars": [...]})
        return text
    if not text.lstrip().startswith(("start:", "%", "//")) and "::=" in text:
        from llguidance.gbnf_to_lark import any_to_lark
        try:
            text = any_to_lark(text)
        except Exception as e:
            raise ValueError(f"the grammar is neither Lark nor valid GBNF: {e}") from None
    return M.grammar_from_lark(text)


def constraint_text(so: StructuredOutputsParams | str) -> str:
    """``grammar_text`` (a text is taken as it is), with a schema nested too deeply for Python's recursion a
    ValueError too."""
    if isinstance(so, str):
        return so
    try:
        return grammar_text(so)
    except RecursionError:
        raise ValueError("structured_outputs: the constraint is nested too deeply; flatten it") from None


def grammar_parts(so: StructuredOutputsParams) -> list[dict]:
    """The constraint as llguidance's top-level grammar list (the first one is the start), so that a
    larger grammar can embed it as ``@name``."""
    text = constraint_text(so)
    if text.lstrip().startswith("{"):
        try:
            parts = json.loads(text)["grammars"]
        except RecursionError:
            raise ValueError("structured_outputs: the constraint is nested too deeply; flatten it") from None
        except (KeyError, TypeError):
            parts = None
        if not isinstance(parts, list) or not parts or not all(isinstance(p, dict) for p in parts):
            raise ValueError('structured_outputs: a JSON grammar must be {"grammars": [{...}, ...]}')
        return parts
    return [{"lark_grammar": text}]


class GrammarCompiler:
    """The llguidance tokenizer of one engine (built on first use) and matchers over it; thread-safe.

    A constraint compiles once per distinct grammar, not once per sample: ``prepare`` checks it in a worker
    process (``grammar_worker``: time and memory budget, a crash there is this request's ValueError), then
    builds a template matcher here with its first mask computed (its lexer states are then shared by every
    copy) and keeps it by the grammar's hash (``cache_size`` most recent). The server calls ``prepare`` off the
    engine thread with the number of samples; ``matcher`` on the engine thread then only hands out the copies
    made ahead (``so._kimik3_copies``), or copies the cached template.

    Token masks are computed on the engine thread before each step, so their cost is every stream's: a
    request whose samples' first masks together take more than ``step_mask_budget`` seconds is refused (the
    regex ``x{1000000}`` takes ~50 ms a mask on a dev CPU, so n=64 of it would hold each step ~3 s)."""

    def __init__(self, tokenizer, vocab_size: int, end_token_ids: list[int], *, timeout: float = 5.0,
                 memory_bytes: int = 2 << 30, num_workers: int = 2, cache_size: int = 64,
                 step_mask_budget: float = 0.1):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.end_token_ids = sorted(set(end_token_ids))
        self._ll_tokenizer = None
        self._executor = None
        self.words = (vocab_size + 31) // 32
        self.timeout, self.memory_bytes, self.num_workers = timeout, memory_bytes, num_workers
        self.cache_size = cache_size
        self.step_mask_budget = step_mask_budget
        self._workers = None
        self._lock = threading.Lock()
        self._templates: OrderedDict[bytes, object] = OrderedDict()
        self._building: dict[bytes, threading.Event] = {}

    def _encoding(self):
        enc = getattr(self.tokenizer, "_encoding", None)
        if enc is None:
            raise ValueError("structured outputs need the checkpoint's tiktoken tokenizer")
        return enc

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                llg = _llg()
                from llguidance.tiktoken import lltokenizer_from_encoding
                self._ll_tokenizer = lltokenizer_from_encoding(self._encoding(), n_vocab=self.vocab_size,
                                                               eos_token=self.end_token_ids)
                self._executor = llg.LLExecutor()       # llguidance's default: 80% of the CPUs, up to 32 threads
            return self._ll_tokenizer

    @property
    def workers(self):
        from kimik3.engine.sample.grammar_worker import GrammarWorkers
        with self._lock:
            if self._workers is None:
                self._workers = GrammarWorkers(self._encoding(), self.vocab_size, self.end_token_ids,
                                               timeout=self.timeout, memory_bytes=self.memory_bytes,
                                               limits={}, num_workers=self.num_workers)
            return self._workers

    def prepare(self, so: StructuredOutputsParams | str, copies: int = 0, cached_only: bool = False) -> bool:
        """Compile ``so`` (checked in a worker first; cached by grammar) and, for a StructuredOutputsParams, make
        ``copies`` fresh matchers that ``matcher`` hands out later; ValueError naming what is wrong. ``cached_only``:
        only if it is compiled already (False, nothing done, if not)."""
        if (entry := self._template(constraint_text(so), cached_only)) is None:
            return False
        template, mask_s, _ = entry
        if copies * mask_s > self.step_mask_budget:
            raise ValueError(f"structured_outputs: one token mask of this constraint took {mask_s * 1e3:.1f} ms; "
                             f"{copies} sample(s) would hold every step of the engine for about "
                             f"{copies * mask_s * 1e3:.0f} ms, over the {self.step_mask_budget * 1e3:.0f} ms budget; "
                             f"ask for fewer samples (n) or simplify the constraint")
        if copies and isinstance(so, StructuredOutputsParams):
            made = [template.deep_copy() for _ in range(copies)]
            with self._lock:
                so.__dict__.setdefault("_kimik3_copies", []).extend(made)
        return True

    def _template(self, text: str, cached_only: bool = False):
        key = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
        while True:
            with self._lock:
                if key in self._templates:
                    self._templates.move_to_end(key)
                    return self._templates[key]
                if cached_only:
                    return None
                event = self._building.get(key)
                if event is None:
                    event = self._building[key] = threading.Event()
                    break
            event.wait()        # another thread compiles the same grammar: take its result (or retry its error)
        try:
            self.workers.validate(text)
            m = _llg().LLMatcher(self.ll_tokenizer, text, log_level=0)
            if m.is_error():
                raise ValueError(f"structured_outputs: the constraint does not compile: {m.get_error()}")
            first = m.compute_bitmask()     # builds the lexer states every copy shares
            start = time.perf_counter()
            m.deep_copy().compute_bitmask()     # what each sample costs a step (its first step)
            entry = (m, time.perf_counter() - start, first)
            with self._lock:
                self._templates[key] = entry
                while len(self._templates) > self.cache_size:
                    self._templates.popitem(last=False)
            return entry
        finally:
            with self._lock:
                del self._building[key]
            event.set()

    def matcher(self, so: StructuredOutputsParams | str) -> Matcher:
        """A fresh matcher for a constraint (or an llguidance grammar text); ValueError naming what is wrong."""
        if isinstance(so, StructuredOutputsParams):
            with self._lock:
                made = so.__dict__.get("_kimik3_copies")
                if made:
                    return Matcher(made.pop(), self)
        return Matcher(self._template(constraint_text(so))[0].deep_copy(), self)

    def first_allows(self, so: StructuredOutputsParams | str, token_ids: list[int]) -> bool:
        """Whether the constraint lets its first token be one of ``token_ids`` (its first mask, kept with the
        compiled template)."""
        words = np.frombuffer(self._template(constraint_text(so))[2], dtype="<u4")
        ids = (ids := np.asarray(token_ids, dtype=np.int64))[ids < 32 * len(words)]
        return bool(((words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).any())

    def check(self, so: StructuredOutputsParams | str) -> None:
        if isinstance(so, StructuredOutputsParams) and so.__dict__.get("_kimik3_copies"):
            return
        self._template(constraint_text(so))

    def close(self) -> None:
        if self._workers is not None:
            self._workers.close()

    def fill_bitmasks(self, rows: list[tuple[Matcher | None, list[int]]]) -> torch.Tensor:
        """int32 bitmask [len(rows), words] (host): row i allows the tokens its matcher allows after
        consuming ``rows[i][1]`` (draft tokens, rolled back afterwards); every token without a matcher.
        Matchers without drafts are filled in one parallel call."""
        # pinned, so the copy to the device does not wait for the step; rows without a matcher allow
        # every token, filled one row at a time (a whole-tensor fill of this size runs on torch's CPU
        # thread pool, whose threads can then compete with llguidance's for the cores)
        mask = torch.empty((len(rows), self.words), dtype=torch.int32, pin_memory=torch.cuda.is_available())
        for i, (m, _) in enumerate(rows):
            if m is None:
                mask[i].fill_(-1)
        row_bytes = self.words * 4
        plain = [(m.m, i) for i, (m, pending) in enumerate(rows) if m is not None and not pending]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, mask.data_ptr(), row_bytes, len(rows))
        for i, (m, pending) in enumerate(rows):
            if m is not None and pending:
                if not m.m.consume_tokens(pending):
                    raise RuntimeError(f"grammar refused draft tokens {pending} it had accepted: {m.m.get_error()}")
                m.m.unsafe_compute_mask_ptr(mask.data_ptr() + i * row_bytes, row_bytes)
                m.m.rollback(len(pending))
        return mask


@dataclass
class Matcher:
    """One request's grammar state."""

    m: object
    compiler: GrammarCompiler

    def consume(self, token_id: int) -> bool:
        """Advance by an emitted token; False (and a warning) if the grammar refused it."""
        if self.m.is_stopped():
            return True
        ok = self.m.consume_token(token_id)
        if not ok:
            logger.warning("structured outputs: token %d refused by the grammar: %s", token_id, self.m.get_error())
        return ok

    @property
    def stopped(self) -> bool:
        return self.m.is_stopped()

    def valid_prefix(self, draft: list[int]) -> int:
        """How many leading draft tokens the grammar accepts (state unchanged)."""
        return self.m.validate_tokens(draft) if draft else 0


def unpack_bitmask(mask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """int32 bitmask [n, words] -> bool [n, vocab] on ``device`` (True = allowed); one copy, tensor ops."""
    dev = mask.to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (dev[:, :, None] >> shifts) & 1
    return bits.reshape(mask.shape[0], -1)[:, :vocab_size].bool()


def fill_bitmasks(rows: list[tuple[Matcher | None, list[int]]]) -> torch.Tensor:
    """``GrammarCompiler.fill_bitmasks`` of the compiler the rows' matchers come from."""
    compiler = next(m.compiler for m, _ in rows if m is not None)
    return compiler.fill_bitmasks(rows)
