"""Request fields -> constraints: ``response_format``, vLLM's ``guided_*`` and ``structured_outputs``,
and the K3 output grammar that chat answers are decoded under.

Completions are constrained to the requested JSON / regex / choice / grammar itself. A chat answer is
constrained to the K3 message it must be (``k3_answer_grammar``): with thinking on, free reasoning
text up to ``<|close|>think<|sep|>`` first (the constraint starts after the reasoning), then the
response channel holding the constrained content, then, with tools, the tools section, then
``<|close|>message<|sep|>`` (the end token follows). Tool calls are written as one
``<|open|>json type="object"<|sep|>ARGS<|close|>json<|sep|>`` block per call (a form the K3 parser
reads), ARGS constrained by that tool's ``parameters`` schema, so ``arguments`` always match it. When
the schema is a plain object (``properties`` / ``required`` only, each property typed, string properties
unconstrained), K3's own argument form is offered too: one
``<|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>`` per property in schema order,
required ones mandatory, VALUE raw text for strings and JSON under the property's schema otherwise.
"""

from __future__ import annotations

import json
from typing import Any

from kimik3.chat.k3 import escape_attr
from kimik3.engine.sample.sampling_params import StructuredOutputsParams
from kimik3.engine.sample.structured import grammar_parts, lark_json
from kimik3.serve.protocol import bad_request

MAX_PARALLEL_CALLS = 8          # tool calls one answer may hold under a tool constraint
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _params(param: str, **kw) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kw)
    except ValueError as e:
        raise bad_request(str(e).removeprefix("SamplingParams: "), param) from None


def response_format_constraint(rf: dict | None) -> StructuredOutputsParams | None:
    """``response_format`` -> a constraint (``text`` and None: none). ``json_schema.strict`` is accepted
    either way: the schema is always enforced."""
    if rf is None:
        return None
    kind = rf.get("type")
    unknown = sorted(set(rf) - {"type", "json_schema"})
    if unknown:
        raise bad_request(f"response_format.{unknown[0]} is not supported; response_format takes type and "
                          f"json_schema", f"response_format.{unknown[0]}", "unsupported_field")
    if kind == "text":
        return None
    if kind == "json_object":
        return _params("response_format", json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise bad_request("response_format.json_schema must be an object with a 'schema' object",
                              "response_format.json_schema")
        extra = sorted(set(js) - {"name", "schema", "strict", "description"})
        if extra:
            raise bad_request(f"response_format.json_schema.{extra[0]} is not supported (it takes name, "
                              f"description, schema, strict)", f"response_format.json_schema.{extra[0]}",
                              "unsupported_field")
        if "strict" in js and not isinstance(js["strict"], bool) and js["strict"] is not None:
            raise bad_request("response_format.json_schema.strict must be a bool",
                              "response_format.json_schema.strict")
        return _params("response_format.json_schema", json=js.get("schema", {}))
    raise bad_request(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                      "response_format.type")


def request_constraint(req) -> StructuredOutputsParams | None:
    """The one constraint a request asks for, from whichever field names it; 400 if it names several."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    so = req.structured_outputs
    if so is not None:
        unknown = sorted(set(so) - set(_STRUCTURED_KEYS))
        if unknown:
            raise bad_request(f"structured_outputs.{unknown[0]} is not supported; structured_outputs takes one of "
                              f"{', '.join(_STRUCTURED_KEYS)}", f"structured_outputs.{unknown[0]}",
                              "unsupported_field")
        kw = {k: v for k, v in so.items() if v is not None and v is not False}
        found.append(("structured_outputs", _params("structured_outputs", **kw)))
    for field, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(req, field)
        if value is not None:
            found.append((field, _params(field, **{key: value})))
    rf = response_format_constraint(req.response_format)
    if rf is not None:
        found.append(("response_format", rf))
    if len(found) > 1:
        raise bad_request(f"{found[0][0]} and {found[1][0]} both constrain the output; give one",
                          found[1][0], "conflicting_constraints")
    return found[0][1] if found else None


_OBJECT_KEYS = {"type", "properties", "required", "additionalProperties", "description", "title", "$schema"}
_PLAIN_STRING_KEYS = {"type", "description", "title", "default", "examples"}
_XTML_TYPES = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean", "null": "null",
               "object": "object", "array": "array"}


def _argument_form(schema: dict, name: str) -> tuple[str, list[str]] | None:
    """The argument-form body of a call (rule text, extra rules), or None if the schema is not plain."""
    if set(schema) - _OBJECT_KEYS or schema.get("type", "object") != "object":
        return None
    props = schema.get("properties") or {}
    required = schema.get("required") or []
    if (not isinstance(props, dict) or not isinstance(required, list)
            or not all(isinstance(r, str) for r in required) or set(required) - set(props)):
        return None             # not plain (a malformed one is refused when its JSON form is compiled)
    items, rules = [], []
    for j, (key, sub) in enumerate(props.items()):
        kind = _XTML_TYPES.get(sub.get("type")) if isinstance(sub, dict) and isinstance(sub.get("type"), str) else None
        if kind is None:
            return None
        if kind == "string":
            if set(sub) - _PLAIN_STRING_KEYS:
                return None
            value = "RAW?"
        else:
            value = f"{name}_{j}"
            rules.append(f"{value}: {lark_json(sub)}")
        head = f'argument key="{escape_attr(key)}" type="{kind}"'
        item = f'(<|open|> {_lit(head)} <|sep|> {value} <|close|> "argument" <|sep|>)'
        items.append(item if key in required else item + "?")
    return " ".join(items), rules


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")     # not allOf: closed branches of one object clash
_COMPOSED = ("allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas")   # keys an object may take from
_SUBSCHEMA_ONE = ("items", "additionalItems", "not", "if", "then", "else", "contains", "propertyNames")


def closed_schema(schema: Any) -> Any:
    """A tool's parameter schema with every object closed: ``additionalProperties: false`` wherever an
    object schema that lists ``properties`` does not say otherwise, at every depth (vLLM's
    rule for tool schemas); an object that takes keys from ``allOf``/``anyOf``/``oneOf``/``$ref``/``if`` is
    left as it is (closing it would refuse those keys). An open object lets a constrained call wander into extra keys until
    ``max_tokens`` and never finish."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_schema(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(v) for v in out[key]]
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed_schema(out[key])
    is_object = isinstance(out.get("properties"), dict)   # a bare {"type": "object"} is a free-form map: open
    open_keys = ("additionalProperties", "unevaluatedProperties", "patternProperties", *_COMPOSED)
    if is_object and not any(k in out for k in open_keys):
        out["additionalProperties"] = False
    elif isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed_schema(out["additionalProperties"])
    return out


def _call_rule(tools: list[dict], index: int) -> tuple[str, list[str]]:
    """The rule of call number ``index`` (1-based) to any of ``tools``, and its argument rules."""
    alts, rules = [], []
    json_head = _lit('json type="object"')
    for k, t in enumerate(tools):
        fn = t["function"]
        call_text = f'call tool="{escape_attr(fn["name"])}" index="{index}"'
        head = f"<|open|> {_lit(call_text)} <|sep|>"
        schema = closed_schema(fn.get("parameters") or {"type": "object", "properties": {}})
        name = f"args_{index}_{k}"
        rules.append(f"{name}: {lark_json(schema)}")
        body = f'<|open|> {json_head} <|sep|> {name} <|close|> "json" <|sep|>'
        plain = _argument_form(schema, name)
        if plain is not None:
            rules.extend(plain[1])
            body = f"(({body}) | ({plain[0]}))" if plain[0] else f"({body})?"
        alts.append(f'{head} {body} <|close|> "call" <|sep|>')
    return f"call_{index}: " + " | ".join(alts), rules


def k3_answer_grammar(*, thinking: bool, content: StructuredOutputsParams | None, tools: list[dict] | None,
                      tool_mode: str | None, max_calls: int) -> str:
    """The llguidance grammar (JSON text) of a K3 answer after the generation prompt.

    ``tool_mode``: None (no tools section), "auto" (content, then optionally calls), "required" (an empty
    response channel, then 1..max_calls calls). ``content``: the response channel's constraint, or None
    for free text."""
    lines = []
    head = '/(?s:.+)/? <|close|> "think" <|sep|> <|open|> "response" <|sep|> ' if thinking else ""
    # /(?s:.+)/ never matches a control token: reasoning and free content are plain text
    body = "@content" if content is not None else "TEXT?"
    close = '<|close|> "response" <|sep|>'
    end = '<|close|> "message" <|sep|>'
    if tool_mode == "required":
        lines.append(f"start: {head}{close} tools {end}")
    elif tool_mode == "auto":
        lines.append(f"start: {head}{body} {close} tools? {end}")
    else:
        lines.append(f"start: {head}{body} {close} {end}")
    lines.append("TEXT: /(?s:.+)/")
    lines.append("RAW: /(?s:([^<]|<[^|])+)/")     # a raw string argument: no '<|' (it would read as a marker)
    if tool_mode is not None:
        chain = ""
        for i in range(max_calls, 0, -1):
            chain = f"call_{i} ({chain})?" if chain else f"call_{i}"
        lines.append(f'tools: <|open|> "tools" <|sep|> {chain} <|close|> "tools" <|sep|>')
        for i in range(1, max_calls + 1):
            rule, args = _call_rule(tools, i)
            lines.append(rule)
            lines.extend(args)
    grammars: list[dict[str, Any]] = [{"lark_grammar": "\n".join(lines) + "\n"}]
    if content is not None:
        parts = grammar_parts(content)
        grammars += [{**parts[0], "name": "content"}, *parts[1:]]
    return json.dumps({"grammars": grammars}, ensure_ascii=False)
