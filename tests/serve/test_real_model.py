"""The embedded tiny K3 (random weights, real tokenizer and vision tower) behind the server."""

from __future__ import annotations

import argparse

import pytest

import kimik3
from kimik3.chat import ImagePrompt
from kimik3.serve import add_serve_arguments, build_app
from kimik3.vision.preprocess import load_media_processor_config, preprocess_images
from tests.serve.conftest import LiveServer
from tests.serve.test_errors import image_msg, png_data_url


@pytest.fixture(scope="module")
def real():
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(
        ["--max-model-len", "512", "--max-num-seqs", "4", "--served-model-name", "tiny-k3"])
    s = LiveServer(build_app(args))
    yield s
    s.stop()


def test_chat_and_completion(real):
    c = real.client()
    r = c.chat.completions.create(model="tiny-k3", messages=[{"role": "user", "content": "Hello!"}], max_tokens=4,
                                  temperature=0)
    assert r.usage.completion_tokens <= 4 and r.choices[0].finish_reason in ("stop", "length")
    r = c.completions.create(model="tiny-k3", prompt="Hello", max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens == len(real.state.tokenizer.encode("Hello"))


def test_image_end_to_end(real):
    url = png_data_url(60, 40)
    msgs = image_msg(url)
    r = real.client().chat.completions.create(model="tiny-k3", messages=msgs, max_tokens=2, temperature=0)
    vision = preprocess_images([url], load_media_processor_config(kimik3.DEFAULT_MODEL), allow_paths=False)
    prompt = real.state.tokenizer.apply_chat_template(
        msgs, tokenize=True, images=[ImagePrompt(60, 40, vision.num_tokens[0])])
    assert r.usage.prompt_tokens == len(prompt)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_speculative_server_matches_plain(real):
    """``--num-speculative-tokens`` reaches the engine; greedy completions are unchanged and
    /metrics counts the drafts."""
    import httpx
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(
        ["--max-model-len", "512", "--max-num-seqs", "4", "--served-model-name", "tiny-k3",
         "--num-speculative-tokens", "3", "--speculative-ngram-min", "1"])
    spec = LiveServer(build_app(args))
    try:
        assert spec.state.engine.config.num_speculative_tokens == 3
        prompt = "one two three one two three one two three one two"
        outs = [s.client().completions.create(model="tiny-k3", prompt=prompt, max_tokens=12, temperature=0)
                for s in (real, spec)]
        assert outs[0].choices[0].text == outs[1].choices[0].text
        metrics = httpx.get(spec.url + "/metrics").text
        assert "vllm:spec_decode_num_draft_tokens_total" in metrics
        assert "vllm:spec_decode_num_accepted_tokens_total" in metrics
        assert "vllm:spec_decode_num_drafts_total" in metrics
        per_pos = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos")]
        engine = spec.state.engine
        assert len(per_pos) == len(engine.accepted_per_position)
        if per_pos:
            assert 'position="0"' in per_pos[0] and float(per_pos[0].split()[-1]) == engine.accepted_per_position[0]
    finally:
        spec.stop()
