"""The Eagle3 draft shipped with the embedded default model: it loads by name ("default"), is small, and drafts
that the target accepts on held-out text, with greedy output identical to plain decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kimik3
from kimik3.engine import EngineArgs, EngineConfig, SamplingParams
from kimik3.engine.core.llm_engine import LLMEngine
from kimik3.loader import DEFAULT_MODEL
from kimik3.loader.drafts import DEFAULT_DRAFT
from tests.engine.helpers import run

HELD_OUT = (Path(__file__).resolve().parents[2] / "data" / "default_model_heldout.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def target():
    return kimik3.load_model(DEFAULT_MODEL, dtype=torch.float32, language_model_only=True)


def test_shipped_draft_is_small_and_named_default():
    assert sum(f.stat().st_size for f in DEFAULT_DRAFT.iterdir()) < 4 << 20
    settings = EngineArgs(speculative_config={"method": "eagle3", "model": "default",
                                              "num_speculative_tokens": 4}).speculative_settings()
    assert settings["speculative_model"] == "default"


def test_default_draft_is_accepted_on_held_out_text(target):
    tok = kimik3.load_tokenizer(DEFAULT_MODEL)
    ids = tok.encode(HELD_OUT)
    reqs = {f"p{i}": (ids[40 * i:40 * i + 32], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
            for i in range(2)}
    common = dict(block_size=16, max_num_seqs=2, max_model_len=96, enable_prefix_caching=False)
    plain = run(LLMEngine(target, EngineConfig(**common)), reqs)
    engine = LLMEngine(target, EngineConfig(num_speculative_tokens=4, speculative_method="eagle3",
                                            speculative_model="default", **common))
    spec = run(engine, reqs)
    for rid in reqs:
        assert spec[rid][0][0] == plain[rid][0][0], rid
    assert engine.num_drafts > 0
    mean_accepted_length = 1 + engine.num_accepted_tokens / engine.num_drafts
    assert mean_accepted_length > 1.3, mean_accepted_length
