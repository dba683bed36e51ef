"""Random JSON schemas and regexes for the structured-output property tests (seeded, bounded so a
random model can finish them: strings have maxLength, arrays maxItems, numbers bounds and a
multipleOf), and the longest output each one admits (``max_output_bytes``), so a run can give every
case a ``max_tokens`` that any valid output fits in."""

from __future__ import annotations

import json
import random
import re._parser as sre_parse

FORMATS = ("date", "uuid", "ipv4")
WORDS = ("alpha", "beta", "gamma", "x y", "é", "{}", "quo\"te")


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema: 1-4 properties (1-2 when nested) of integers / numbers with bounds, bounded strings, enums,
    formats, booleans, nulls, consts, bounded arrays and (up to depth 2) nested objects."""
    props = {}
    for i in range(rng.randint(1, 4 if depth == 0 else 2)):
        props[f"k{i}_{rng.choice(WORDS)}"] = _value(rng, depth)
    required = [k for k in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _value(rng: random.Random, depth: int) -> dict:
    kinds = ["int", "num", "str", "enum", "format", "pattern", "bool", "null", "const", "array"] + (
        ["object"] if depth < 2 else [])
    k = rng.choice(kinds)
    if k == "int":
        lo = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 5000)}
    if k == "num":
        lo = rng.uniform(-100, 100)     # multipleOf bounds the digits (and is exact in binary)
        # wider than 1.99 (after rounding): some multiple lies strictly inside, so the schema is satisfiable
        return {"type": "number", "minimum": round(lo, 2), "maximum": round(lo + rng.uniform(2, 200), 2),
                "multipleOf": rng.choice([0.5, 0.25, 0.125, 1])}
    if k == "str":
        lo = rng.randint(0, 3)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 8)}
    if k == "enum":
        return {"enum": rng.sample(list(WORDS) + [1, 2.5, None, True], rng.randint(1, 4))}
    if k == "format":
        return {"type": "string", "format": rng.choice(FORMATS)}
    if k == "pattern":      # anchored: a pattern matches anywhere in the string (ECMA-262 search)
        return {"type": "string", "pattern": f"^{random_regex(rng)}$"}
    if k == "bool":
        return {"type": "boolean"}
    if k == "null":
        return {"type": "null"}
    if k == "const":
        return {"const": rng.choice(WORDS)}
    if k == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": _value(rng, depth + 1), "minItems": lo, "maxItems": lo + rng.randint(0, 3)}
    return random_schema(rng, depth + 1)


def random_regex(rng: random.Random) -> str:
    """A regex of 1-4 pieces: literals, classes with bounded counts, alternations, optional groups."""
    pieces = []
    for _ in range(rng.randint(1, 4)):
        k = rng.randrange(5)
        if k == 0:
            pieces.append(rng.choice(["abc", "-", "x_y", r"\.", "K3"]))
        elif k == 1:
            lo = rng.randint(1, 3)
            pieces.append(rng.choice(["[a-z]", "[0-9]", r"\d", "[A-F0-9]", "[ -~]"]) + f"{{{lo},{lo + rng.randint(0, 4)}}}")
        elif k == 2:
            pieces.append("(" + "|".join(rng.sample(["cat", "dog", "emu", "ox", "42"], rng.randint(2, 4))) + ")")
        elif k == 3:
            pieces.append("(" + rng.choice(["ab", "[xyz]", r"\d\d"]) + ")?")
        else:
            pieces.append(rng.choice(["[a-c]", "[0-9]"]) + "{" + str(rng.randint(1, 3)) + "}")
    return "".join(pieces)


# ---- the longest valid output -------------------------------------------------------------------
# Bytes of the longest text a constraint admits, as kimik3 compiles it (JSON with ", " / ": " and no
# free whitespace). A token is at least one byte, so ``max_output_bytes(...) + 1`` tokens (the end
# token last) always let an output finish. One character of a free JSON string is at most 6 bytes
# (4 bytes of UTF-8, or a \uXXXX escape); keys, enums and consts are written as json.dumps writes them;
# a number under multipleOf has at most that multiple's decimals (at least one: "3.0").

CHAR_BYTES = 6


def _literal_bytes(value) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(", ", ": ")).encode())


def regex_max_chars(rx: str) -> int:
    """The most characters a full match of ``rx`` has (Python's parser; the generated regexes read
    the same in ECMA-262)."""
    return sre_parse.parse(rx).getwidth()[1]


def _decimals(x: float) -> int:
    text = repr(float(x))
    return 0 if text.endswith(".0") else len(text.split(".")[1])


def max_output_bytes(schema: dict) -> int:
    """Bytes of the longest JSON text valid under ``schema`` (one of the generated ones; any other
    keyword is an error, so the bound is never silently wrong)."""
    known = {"type", "properties", "required", "additionalProperties", "minimum", "maximum", "multipleOf",
             "minLength", "maxLength", "format", "pattern", "enum", "const", "items", "minItems", "maxItems"}
    if set(schema) - known:
        raise ValueError(f"no length bound for {sorted(set(schema) - known)}")
    if "enum" in schema:
        return max(_literal_bytes(v) for v in schema["enum"])
    if "const" in schema:
        return _literal_bytes(schema["const"])
    kind = schema["type"]
    if kind == "boolean":
        return len("false")
    if kind == "null":
        return len("null")
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind == "number":
        whole = max(len(str(int(abs(schema["minimum"])))), len(str(int(abs(schema["maximum"])))))
        return 1 + whole + 1 + max(1, _decimals(schema["multipleOf"]))          # sign, digits, ".", decimals
    if kind == "string":
        if "format" in schema:
            return 2 + {"date": 10, "uuid": 36, "ipv4": 15}[schema["format"]]
        if "pattern" in schema:
            return 2 + CHAR_BYTES * regex_max_chars(schema["pattern"])
        return 2 + CHAR_BYTES * schema["maxLength"]
    if kind == "array":
        n = schema["maxItems"]
        return 2 + n * max_output_bytes(schema["items"]) + 2 * max(0, n - 1)
    if kind == "object":
        props = schema["properties"]
        return 2 + sum(_literal_bytes(k) + 2 + max_output_bytes(v) for k, v in props.items()) + 2 * (len(props) - 1)
    raise ValueError(f"no length bound for type {kind!r}")
