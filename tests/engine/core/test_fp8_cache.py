"""The FP8 MLA latent cache (``--kv-cache-dtype fp8``) in the engine: the plan counts its bytes (one per
value plus a float32 scale per token row, KDA states unchanged), and the engine's greedy tokens over it
equal the model called directly with FP8 latents, in every batching mode (the trained default model)."""

import pytest
import torch

import kimik3
from kimik3.config import load_config
from kimik3.engine import EngineConfig, SamplingParams
from kimik3.engine.core.cache_budget import plan_cache
from kimik3.model.batch import ForwardBatch, HybridCache
from kimik3.ops.fp8 import FP8
from tests.engine.helpers import make_engine, run

ROOT = kimik3.DEFAULT_MODEL.parents[1]


def test_latent_bytes_halve_and_kda_states_stay():
    """Hand-computed: K3's 24 MLA layers x 576 values, 2 bytes each in bf16 (27,648 B/token, the issue's
    figure), 1 byte + a 4-byte scale in FP8 (13,920 B/token); the KDA state bytes do not change."""
    text = load_config(ROOT / "tests" / "data" / "kimi-k3-release.config.json").text
    assert len(text.mla_layer_ids) == 24 and text.mla_cache_dim == 576
    assert HybridCache.bytes_per_block(text, 1, torch.bfloat16) == 24 * 576 * 2 == 27_648
    assert HybridCache.bytes_per_block(text, 1, torch.bfloat16, FP8) == 24 * (576 + 4) == 13_920
    assert HybridCache.bytes_per_block(text, 64, torch.bfloat16, FP8) == 64 * 13_920
    assert HybridCache.bytes_per_slot(text, torch.bfloat16) == HybridCache.bytes_per_slot(text, torch.bfloat16)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        HybridCache.bytes_per_block(text, 1, torch.bfloat16, torch.float8_e5m2)


def test_plan_holds_about_twice_the_tokens_in_fp8():
    """One budget, both dtypes: the FP8 plan's blocks cost (D_c + 4) / (2 D_c) of the bf16 ones, the state
    pool is the same, and the plan's bytes stay within the budget."""
    text = load_config(kimik3.DEFAULT_MODEL).text
    cfg = dict(max_num_seqs=4, max_model_len=256, block_size=16, cache_memory_bytes=8 << 20, enable_prefix_caching=False)
    bf16 = plan_cache(EngineConfig(**cfg), text, torch.bfloat16, torch.device("cpu"))
    fp8 = plan_cache(EngineConfig(**cfg, kv_cache_dtype="fp8"), text, torch.bfloat16, torch.device("cpu"))
    D = text.mla_cache_dim
    assert fp8.bytes_per_block == len(text.mla_layer_ids) * 16 * (D + 4)
    assert bf16.bytes_per_block == len(text.mla_layer_ids) * 16 * 2 * D
    assert fp8.bytes_per_slot == bf16.bytes_per_slot and fp8.num_slots == bf16.num_slots
    state = bf16.num_slots * bf16.bytes_per_slot                   # null + live slots (no checkpoints)
    for plan in (bf16, fp8):                   # budget - states - the null block, in whole usable blocks
        assert plan.num_blocks - 1 == ((8 << 20) - state - plan.bytes_per_block) // plan.bytes_per_block
        assert plan.total_bytes <= 8 << 20
    assert (fp8.num_blocks - 1) / (bf16.num_blocks - 1) > 1.9


@pytest.fixture(scope="module")
def model():
    return kimik3.load_model(kimik3.DEFAULT_MODEL, device="cpu", dtype=torch.float32)


def fp8_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of the model called directly on the growing sequence (one prefill each), its MLA latents
    written to and read from an FP8 cache."""
    ids = list(prompt)
    for _ in range(n):
        T = len(ids)
        cache = HybridCache.allocate(model.cache_text_config, 2, 2, T, model.dtype, model.device, latent_dtype=FP8)
        batch = ForwardBatch.build([T], [0], [1], [[1]], block_size=T)
        logits = model.compute_logits(model.forward_step(torch.tensor(ids), batch, cache))
        ids.append(int(logits[-1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("mode", ["batched", "chunked_prefix_cache"])
def test_engine_over_an_fp8_cache_equals_the_model_with_fp8_latents(model, mode):
    tok = kimik3.load_tokenizer(kimik3.DEFAULT_MODEL)
    words = tok.encode((ROOT / "tests" / "data" / "default_model_heldout.txt").read_text(encoding="utf-8"))
    prompts = {"a": words[:13], "b": words[:13] + words[20:31], "c": words[40:45], "d": words[60:90]}
    expected = {k: fp8_greedy(model, p, 6) for k, p in prompts.items()}
    kw = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=48, extra_blocks=30,
              kv_cache_dtype="fp8")
    arrivals = {0: list(prompts)}
    if mode == "chunked_prefix_cache":            # chunks of 7 tokens; "b" starts from "a"'s cached prefix
        kw.update(max_num_batched_tokens=7, kda_checkpoint_interval=1)
        arrivals = {0: ["a"], 10: ["b", "c", "d"]}
    engine = make_engine(model, **kw)
    assert engine.cache.mla_latent.dtype == FP8 and engine.cache.mla_scale.dtype == torch.float32
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = run(engine, {k: (p, params) for k, p in prompts.items()}, arrivals)
    for rid in prompts:
        assert results[rid][0][0] == expected[rid], rid
    written = engine.cache.mla_scale != 1.0
    assert written.any() and (engine.cache.mla_scale[written] > 0).all()
    if mode == "chunked_prefix_cache":
        assert engine.kv.num_hit_tokens >= 12                        # "b" read "a"'s first 3 blocks from the cache
