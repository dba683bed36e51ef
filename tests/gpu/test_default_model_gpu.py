"""The trained default model on CUDA (bf16, the fast kernels): greedy tokens from the engine in
each mode equal the model called directly on the growing sequence. The trained model's
distributions are peaked (held-out loss ~4.5 nats over a 4,352-token vocabulary), so the exact
comparison is meaningful where a random model's near-ties are not (``test_engine_graphs.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kimik3
from kimik3.engine import SamplingParams
from tests.engine.fake_model import reference_greedy
from tests.engine.helpers import make_engine, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HELD_OUT = (Path(__file__).resolve().parents[1] / "data" / "default_model_heldout.txt").read_text(encoding="utf-8")
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model():
    return kimik3.load_model(kimik3.DEFAULT_MODEL, device="cuda", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def prompts(model):
    tok = kimik3.load_tokenizer(kimik3.DEFAULT_MODEL)
    words = tok.encode(HELD_OUT)
    shared = words[:13]
    chosen = {"a": shared, "b": shared + words[20:27], "c": words[40:45], "d": shared[:9],
              "e": words[60:120], "f": tok.encode("Once upon a time")}
    on_cuda = lambda ids: model(ids.to("cuda"))             # noqa: E731  (reference_greedy builds CPU ids)
    with torch.inference_mode():
        return {k: (p, reference_greedy(on_cuda, p, MAX_TOKENS)) for k, p in chosen.items()}


@pytest.mark.parametrize("mode", ["eager", "graphs", "chunked_prefix_graphs", "speculative_graphs"])
def test_engine_greedy_equals_the_model_called_directly_on_cuda(model, prompts, mode):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    kw = dict(block_size=16, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=192, extra_blocks=64,
              enforce_eager=mode == "eager")
    arrivals = {0: list(prompts)}
    if mode == "chunked_prefix_graphs":
        kw.update(max_num_batched_tokens=24, kda_checkpoint_interval=1)
        arrivals = {0: ["a"], 8: ["b", "d"], 10: ["c", "e", "f"]}
    elif mode == "speculative_graphs":
        kw.update(num_speculative_tokens=3, speculative_ngram_min=1, speculative_ngram_max=3)
    engine = make_engine(model, **kw)
    results = run(engine, {k: (p, params) for k, (p, _) in prompts.items()}, arrivals)
    for rid, (_, expected) in prompts.items():
        assert results[rid][0][0] == expected, rid
    if mode != "eager":
        assert engine.runner.graphs is not None and engine.runner.num_graph_steps > 0
    if mode == "chunked_prefix_graphs":
        assert engine.kv.num_hit_tokens > 0
    if mode == "speculative_graphs":
        assert engine.num_draft_tokens > 0
