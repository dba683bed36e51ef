"""/v1/responses through the official client's stream helper (``client.responses.stream()``), every event and
the response object validated against ``openai.types.responses`` (pydantic validation, not the client's
lenient construction), usage details, and the request fields implemented or refused with a reason."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from kimik3.serve.responses_api import ResponsesRequest, to_chat_request
from tests.serve.conftest import MODEL, start_fake_server
from tests.serve.test_api import ANSWER_OUTPUT, TOK, TOOL_OUTPUT, script
from tests.serve.test_dropin_routes import FLAT_TOOLS

EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def server():
    s = start_fake_server(scripts={"SCRIPT_TOOL": script(TOOL_OUTPUT), "SCRIPT_ANSWER": script(ANSWER_OUTPUT)})
    yield s
    s.stop()


def raw_events(server, **body) -> list[dict]:
    """The SSE stream as sent (each ``data:`` parsed), checking every ``event:`` name matches its type."""
    out = []
    with httpx.stream("POST", server.url + "/v1/responses", json={"model": MODEL, "stream": True, **body},
                      timeout=60) as r:
        assert r.status_code == 200
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                out.append(data)
    return out


def reasoning_token_count(output: str) -> int:
    """Tokens up to and including the think channel's close marker (what the model spent thinking)."""
    think = output[:output.index("<|close|>think<|sep|>") + len("<|close|>think<|sep|>")]
    return len(TOK.encode(think, allow_special=True))


def test_stream_helper_accepts_the_stream_and_every_event_validates(server):
    c = server.client()
    with c.responses.stream(model=MODEL, input="SCRIPT_ANSWER what is 2+2?") as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == "It is 4." and [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "Two plus two."
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "It is 4."
    raw = raw_events(server, input="SCRIPT_ANSWER what is 2+2?")
    for e in raw:
        EVENT.validate_python(e)                      # raises on a field the typed model rejects
    assert [e["sequence_number"] for e in raw] == list(range(len(raw)))
    # the lifecycle events carry the response as it was then: no output yet
    assert raw[0]["type"] == "response.created" and raw[0]["response"]["output"] == []
    added = [e for e in raw if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == [0, 1]
    assert all(e["item"]["content"] == [] for e in added)
    done = Response.model_validate(raw[-1]["response"])
    assert done.status == "completed" and done.output_text == "It is 4."
    usage = done.usage
    assert usage.output_tokens == len(script(ANSWER_OUTPUT))
    assert usage.output_tokens_details.reasoning_tokens == reasoning_token_count(ANSWER_OUTPUT)
    assert usage.input_tokens_details.cache_write_tokens >= 0


def test_stream_helper_with_a_tool_call(server):
    c = server.client()
    with c.responses.stream(model=MODEL, input="SCRIPT_TOOL weather in Paris?", tools=FLAT_TOOLS) as stream:
        list(stream)
        final = stream.get_final_response()
    calls = [i for i in final.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].status == "completed"
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 3}
    for e in raw_events(server, input="SCRIPT_TOOL weather in Paris?", tools=FLAT_TOOLS):
        EVENT.validate_python(e)


def test_async_stream_helper(server):
    import asyncio

    async def go():
        async with server.async_client().responses.stream(model=MODEL, input="SCRIPT_ANSWER 2+2?") as stream:
            async for _ in stream:
                pass
            return await stream.get_final_response()
    assert asyncio.run(go()).output_text == "It is 4."


def test_incomplete_stream(server):
    c = server.client()
    with c.responses.stream(model=MODEL, input="plain words", max_output_tokens=2) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.usage.output_tokens == 2


def test_create_validates_and_reports_cache_use(server):
    c = server.client()
    long_input = "SCRIPT_ANSWER " + "the same long prefix " * 40
    first = c.responses.create(model=MODEL, input=long_input)
    second = c.responses.create(model=MODEL, input=long_input)
    for r in (first, second):
        Response.model_validate(r.model_dump(mode="json"))
    unit = server.engine.kv.block_size * server.engine.kv.interval
    kept = first.usage.input_tokens // unit * unit
    assert kept > 0
    d1, d2 = first.usage.input_tokens_details, second.usage.input_tokens_details
    assert d1.cached_tokens + d1.cache_write_tokens == kept or d1.cached_tokens > 0
    assert d2.cached_tokens > 0 and d2.cached_tokens + d2.cache_write_tokens == kept


def test_text_format_becomes_the_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req = ResponsesRequest.model_validate({"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "thing", "schema": schema, "strict": True}}})
    chat = to_chat_request(req)
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema,
                                                                            "strict": True}}
    plain = to_chat_request(ResponsesRequest.model_validate({"input": "hi", "text": {"format": {"type": "text"}}}))
    assert plain.response_format is None
    obj = to_chat_request(ResponsesRequest.model_validate({"input": "hi", "text": {"format": {"type": "json_object"}}}))
    assert obj.response_format == {"type": "json_object"}


def test_text_format_is_echoed(server):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = server.client().responses.create(model=MODEL, input="give json", max_output_tokens=2, text={
        "format": {"type": "json_schema", "name": "thing", "schema": schema}})
    assert r.text.format.type == "json_schema" and r.text.format.schema_ == schema
    # enforcement is checked on the tiny model: tests/serve/test_structured.py


@pytest.mark.parametrize("field,value,match", [
    ("background", True, "stores none"), ("truncation", "auto", "never truncated"),
    ("include", ["reasoning.encrypted_content"], "nothing is encrypted"), ("store", True, "stores no responses"),
    ("top_logprobs", 3, "chat/completions"), ("max_tool_calls", 2, "parallel_tool_calls"),
    ("service_tier", "flex", "one tier"), ("text", {"verbosity": "low"}, "verbosity"),
    ("stream_options", {"include_obfuscation": True}, "no padding"),
    ("conversation", "conv_1", "conversation")])
def test_unserved_fields_are_refused_with_the_reason(server, field, value, match):
    with pytest.raises(openai.BadRequestError, match=match) as e:
        server.client().responses.create(model=MODEL, input="hi", max_output_tokens=2, **{field: value})
    assert e.value.body["param"].split(".")[0] == field


def test_what_kimik3_does_is_accepted(server):
    r = server.client().responses.create(
        model=MODEL, input="hi", max_output_tokens=2, background=False, truncation="disabled", include=[],
        store=False, prompt_cache_key="k", safety_identifier="u1", service_tier="auto", metadata={"a": "b"},
        stream_options=None)
    assert r.service_tier == "auto" and r.metadata == {"a": "b"} and r.truncation == "disabled"


def test_errors_name_the_input_item_not_the_chat_message(server):
    """A bad part is named by where it is in the request (``input[1].content[0]``), not by the chat message it
    became (``messages[2].content[1]``: the instructions are message 0)."""
    for url, match in (("https://example.com/a.png", "remote image URLs"), ("data:image/png;base64,AAAA", "")):
        r = httpx.post(server.url + "/v1/responses", timeout=60, json={
            "model": MODEL, "instructions": "be brief", "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"role": "user", "content": [{"type": "input_text", "text": "and"},
                                             {"type": "input_image", "image_url": url}]}]})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "input[1].content[1]", err
        assert match in err["message"] and "messages[" not in err["message"], err
