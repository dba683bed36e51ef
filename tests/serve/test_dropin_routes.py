"""vLLM's extra routes and names: /tokenize, /detokenize, /version, /ping, `reasoning`, CORS, /v1/responses
(text and tool calls, plain and streamed) and the vllm:* metrics vLLM's example Grafana dashboard queries."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import MODEL, start_fake_server
from tests.serve.test_api import ANSWER_OUTPUT, TOK, TOOL_OUTPUT, script

DASHBOARD = Path(__file__).resolve().parents[1] / "data" / "vllm_grafana_series.txt"
FLAT_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                               "days": {"type": "integer"}}}}]


@pytest.fixture(scope="module")
def server():
    s = start_fake_server(scripts={"SCRIPT_TOOL": script(TOOL_OUTPUT), "SCRIPT_ANSWER": script(ANSWER_OUTPUT)},
                          api_key="sk-1", allowed_origins=["https://ui.example"], max_queue_len=8)
    yield s
    s.stop()


def auth() -> dict:
    return {"Authorization": "Bearer sk-1"}


def test_tokenize_detokenize_version_ping(server):
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "Hello world"}, headers=auth())
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == TOK.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server.engine.config.max_model_len and body["token_strs"] is None
    msgs = [{"role": "user", "content": "Hi"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": msgs, "return_token_strs": True}, headers=auth()).json()
    assert r["tokens"] == TOK.apply_chat_template(msgs, tokenize=True)
    assert "".join(r["token_strs"]) == TOK.decode(r["tokens"])
    d = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]}, headers=auth())
    assert d.status_code == 200 and d.json() == {"prompt": "Hello world"}
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]}, headers=auth())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(server.url + "/tokenize", json={}, headers=auth()).status_code == 400
    for route in ("/tokenize", "/detokenize"):        # they do real work: behind the key (vLLM leaves them open)
        assert httpx.post(server.url + route, json={"prompt": "x", "tokens": [1]}).status_code == 401
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"},
                      headers={"Authorization": "bearer sk-1"}).status_code == 200     # the scheme in any case
    assert httpx.get(server.url + "/version").json() == {"version": importlib.metadata.version("kimik3")}
    assert httpx.get(server.url + "/ping").status_code == 200 and httpx.post(server.url + "/ping").status_code == 200


def test_rebalance_experts_needs_the_key_and_eplb(server):
    """kimik3's EPLB route: behind the API key, a 400 naming the flag on a server without EPLB (the live move itself:
    tests/parallel/test_serve_torchrun.py)."""
    assert httpx.post(server.url + "/rebalance_experts").status_code == 401
    r = httpx.post(server.url + "/rebalance_experts", headers=auth())
    assert r.status_code == 400 and r.json()["error"]["code"] == "eplb_disabled"
    assert "--enable-eplb" in r.json()["error"]["message"]


def test_reasoning_beside_reasoning_content(server):
    c = server.client(api_key="sk-1")
    msgs = [{"role": "user", "content": "SCRIPT_ANSWER 2+2?"}]
    r = c.chat.completions.create(model=MODEL, messages=msgs)
    m = r.choices[0].message
    assert m.reasoning == m.reasoning_content == "Two plus two." and m.content == "It is 4."
    streamed = [getattr(ch.delta, "reasoning", None) or "" for chunk in
                c.chat.completions.create(model=MODEL, messages=msgs, stream=True) for ch in chunk.choices]
    assert "".join(streamed) == "Two plus two."


def test_cors_preflight_is_answered_without_the_key(server):
    headers = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(server.url + "/v1/chat/completions", headers=headers)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
    r = httpx.options(server.url + "/v1/chat/completions", headers={**headers, "Origin": "https://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(server.url + "/v1/models", headers={**auth(), "Origin": "https://ui.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"


def test_responses_text_and_reasoning(server):
    c = server.client(api_key="sk-1")
    r = c.responses.create(model=MODEL, input="SCRIPT_ANSWER what is 2+2?", instructions="Be brief.")
    assert r.status == "completed" and r.output_text == "It is 4."
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Two plus two."
    prompt = TOK.apply_chat_template([{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "SCRIPT_ANSWER what is 2+2?"}], tokenize=True)
    assert r.usage.input_tokens == len(prompt) and r.usage.output_tokens == len(script(ANSWER_OUTPUT))
    short = c.responses.create(model=MODEL, input="plain words", max_output_tokens=2)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.usage.output_tokens == 2


def test_responses_streamed(server):
    c = server.client(api_key="sk-1")
    events = list(c.responses.create(model=MODEL, input="SCRIPT_ANSWER what is 2+2?", stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == "It is 4." and thought == "Two plus two."
    final = events[-1].response
    assert final.output_text == "It is 4." and final.usage.output_tokens == len(script(ANSWER_OUTPUT))


def test_responses_tool_calls(server):
    c = server.client(api_key="sk-1")
    r = c.responses.create(model=MODEL, input="SCRIPT_TOOL weather in Paris?", tools=FLAT_TOOLS)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 3}
    events = list(c.responses.create(model=MODEL, input="SCRIPT_TOOL weather in Paris?", tools=FLAT_TOOLS,
                                     stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris", "days": 3}
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert added[0].name == "get_weather"
    # the call and its output go back in as input items
    follow = c.responses.create(model=MODEL, tools=FLAT_TOOLS, max_output_tokens=2, input=[
        {"role": "user", "content": "SCRIPT_TOOL weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
         "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert follow.usage.input_tokens > r.usage.input_tokens
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        c.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError, match="function tools only"):
        c.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])


def test_metrics_serve_every_series_of_vllms_grafana_dashboard(server):
    c = server.client(api_key="sk-1")
    c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "SCRIPT_ANSWER hi"}])
    c.completions.create(model=MODEL, prompt="once", max_tokens=3)
    text = httpx.get(server.url + "/metrics").text          # open like /health, despite the API key
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    wanted = [line for line in DASHBOARD.read_text().splitlines() if line and not line.startswith("#")]
    assert len(wanted) == 21
    for name in wanted:
        assert name in samples, f"{name} missing from /metrics"
        assert any(s.labels.get("model_name") == MODEL for s in samples[name]), name
    for name, ss in samples.items():                             # model_name on every series
        assert all(s.labels.get("model_name") == MODEL for s in ss), name
    reasons = {s.labels["finished_reason"]: s.value for s in samples["vllm:request_success_total"]}
    assert reasons["stop"] >= 1 and reasons["length"] >= 1
    assert sum(s.value for s in samples["vllm:request_prompt_tokens_count"]) >= 2
    gen = sum(s.value for s in samples["vllm:generation_tokens_total"])
    assert gen >= len(script(ANSWER_OUTPUT)) + 3


def test_limit_mm_per_prompt_on_the_server():
    from tests.serve.test_errors import png_data_url
    s = start_fake_server(limit_mm_per_prompt={"image": 1})
    try:
        part = {"type": "image_url", "image_url": {"url": png_data_url()}}
        msgs = [{"role": "user", "content": [part, part, {"type": "text", "text": "two"}]}]
        r = httpx.post(s.url + "/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 1})
        assert r.status_code == 400 and "limit-mm-per-prompt image=1" in r.json()["error"]["message"]
    finally:
        s.stop()
