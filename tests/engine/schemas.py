"""Random JSON schemas and regexes for the structured-output property tests (seeded, bounded so a
random model can finish them: strings have maxLength, arrays maxItems, numbers bounds and a
multipleOf)."""

from __future__ import annotations

import random

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
    kinds = ["int", "num", "str", "enum", "format", "bool", "null", "const", "array"] + (["object"] if depth < 2 else [])
    k = rng.choice(kinds)
    if k == "int":
        lo = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 5000)}
    if k == "num":
        lo = rng.uniform(-100, 100)     # multipleOf bounds the digits (and is exact in binary)
        return {"type": "number", "minimum": round(lo, 2), "maximum": round(lo + rng.uniform(0.5, 200), 2),
                "multipleOf": rng.choice([0.5, 0.25, 0.125, 1])}
    if k == "str":
        lo = rng.randint(0, 3)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 8)}
    if k == "enum":
        return {"enum": rng.sample(list(WORDS) + [1, 2.5, None, True], rng.randint(1, 4))}
    if k == "format":
        return {"type": "string", "format": rng.choice(FORMATS)}
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
