"""The embedded default model: a trained tiny Kimi-K3 in the release layout.

It is trained by ``scripts/train_default_model.py`` on Jane Austen's novels (the run is not
repeated here): held-out text scores well below the random model, its MXFP4 experts round-trip
exactly, and the engine's greedy tokens equal the model called directly in every batching mode.
"""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import kimik3
from kimik3.engine import SamplingParams
from kimik3.ops import mxfp4
from tests.engine.fake_model import reference_greedy
from tests.engine.helpers import make_engine, run

ROOT = Path(__file__).resolve().parents[1]
MODEL = kimik3.DEFAULT_MODEL
# Held-out: paragraphs of the validation split (the last 2% of each novel, never trained on).
HELD_OUT = (ROOT / "tests" / "data" / "default_model_heldout.txt").read_text(encoding="utf-8")


def _script():
    spec = importlib.util.spec_from_file_location("train_default_model", ROOT / "scripts" / "train_default_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model():
    return kimik3.load_model(MODEL, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def tok():
    return kimik3.load_tokenizer(MODEL)


def test_default_model_is_a_k3_release_layout_with_everything_on():
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3" and "vision_config" in cfg
    text = cfg["text_config"]
    assert text["attn_res_block_size"] and text["latent_moe_use_norm"] and text["mla_use_output_gate"]
    assert text["num_hidden_layers"] % text["attn_res_block_size"] != 0            # a partial last block, as K3
    assert text["hidden_act"] == "situ" and text["linear_attn_config"]["gate_lower_bound"] == -5.0
    assert text["linear_attn_config"]["use_full_rank_gate"] and text["mla_use_nope"] and text["num_shared_experts"]
    assert text["quantization_config"]["format"] == "mxfp4-pack-quantized"
    index = json.loads((MODEL / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(k.endswith("experts.0.w1.weight_packed") for k in index)
    assert any(k.startswith("vision_tower.") for k in index) and any(k.startswith("mm_projector.") for k in index)
    assert len(set(index.values())) == 2                                          # sharded
    size = sum(f.stat().st_size for f in MODEL.iterdir())
    assert size < 20 << 20                                                        # small enough to ship
    tok = kimik3.load_tokenizer(MODEL)
    assert tok.chat_format == "k3" and tok.convert_tokens_to_ids("<|media_pad|>") == cfg["media_placeholder_token_id"]
    assert tok.vocab_size == text["vocab_size"]


def test_config_is_the_training_scripts():
    """The committed config is what the training script builds for the committed tokenizer."""
    from kimik3.tokenizer_build import model_token_ids
    tok = kimik3.load_tokenizer(MODEL)
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg == _script().model_config(model_token_ids(tok.num_base_tokens, "k3"))


def test_held_out_loss_is_three_nats_below_the_random_model(model, tok):
    ids = tok.encode(HELD_OUT)
    assert len(ids) >= 300
    logits = model(torch.tensor(ids)).double()                                    # [T, vocab]
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    loss = -logp[:-1].gather(1, torch.tensor(ids[1:]).view(-1, 1)).mean().item()
    random_model = math.log(model.config.text.vocab_size)                         # uniform prediction
    assert loss <= random_model - 3.0, f"held-out loss {loss:.3f} nats/token, random {random_model:.3f}"


def test_mxfp4_experts_round_trip_exactly(model):
    """Stored codes decoded from the E2M1/E8M0 definition (float64) are the loaded weights, and
    quantising those weights again gives the same values: nothing was lost to storage."""
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    index = json.loads((MODEL / "model.safetensors.index.json").read_text())["weight_map"]
    checked = 0
    for name, shard in sorted(index.items()):
        if not name.endswith(".weight_packed"):
            continue
        with safe_open(str(MODEL / shard), "pt") as f:
            packed = f.get_tensor(name)
        with safe_open(str(MODEL / index[name.replace("_packed", "_scale")]), "pt") as f:
            scale = f.get_tensor(name.replace("_packed", "_scale"))
        codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()  # low nibble first
        value = magnitudes[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).double()
        value = value * torch.exp2(scale.double() - 127).repeat_interleave(32, dim=-1)
        parts = name.split(".")            # language_model.model.layers.L.block_sparse_moe.experts.E.wN.weight_packed
        layer, expert, which = parts[3], int(parts[6]), parts[7]
        loaded = getattr(model.get_submodule(f"model.layers.{layer}.block_sparse_moe.experts"), which)[expert]
        assert torch.equal(loaded.double(), value), name
        again = mxfp4.dequantize(*mxfp4.quantize(loaded), torch.float64)
        assert torch.equal(again, value), name
        checked += 1
    assert checked == 3 * model.config.text.num_experts * sum(
        model.config.text.is_moe_layer(i) for i in range(model.config.text.num_hidden_layers))


@pytest.fixture(scope="module")
def prompts(model, tok) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (prompt, greedy continuation from calling the model on the growing sequence)."""
    words = tok.encode(HELD_OUT)
    shared = words[:13]                                                           # a common prefix
    chosen = {"a": shared, "b": shared + words[20:27], "c": words[40:45], "d": shared[:9],
              "e": words[60:90], "f": tok.encode("Once upon a time")}
    return {k: (p, reference_greedy(model, p, 8)) for k, p in chosen.items()}


@pytest.mark.parametrize("mode", ["one_at_a_time", "batched", "chunked_preempt", "prefix_cache", "speculative"])
def test_engine_greedy_equals_the_model_called_directly(model, prompts, mode):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kw = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=48, extra_blocks=40)
    arrivals = {0: list(prompts)}
    if mode == "one_at_a_time":
        kw["max_num_seqs"] = 1
    elif mode == "chunked_preempt":
        kw.update(max_num_batched_tokens=7, extra_blocks=4)                        # chunks of 7, cache too small
    elif mode == "prefix_cache":
        kw.update(kda_checkpoint_interval=1)
        arrivals = {0: ["a"], 12: ["b", "d"], 14: ["c", "e", "f"]}                 # "a" cached before the rest
    elif mode == "speculative":
        kw.update(num_speculative_tokens=3, speculative_ngram_min=1, speculative_ngram_max=3)
    engine = make_engine(model, **kw)
    results = run(engine, {k: (p, params) for k, (p, _) in prompts.items()}, arrivals)
    for rid, (_, expected) in prompts.items():
        tokens, reason, _ = results[rid][0]
        assert reason == "length" and tokens == expected, rid
    if mode == "chunked_preempt":
        assert engine.scheduler.num_preemptions > 0
    if mode == "prefix_cache":
        assert engine.kv.num_hit_tokens > 0
    if mode == "speculative":
        assert engine.num_draft_tokens > 0


def test_once_upon_a_time_continues_in_words(model, tok):
    """The CLI's default (greedy) continuation is made of whole words: each word, punctuation
    stripped, is one of the tokenizer's whole-word tokens (" word"). A random model strings
    sub-word pieces together ("springready", "quiteted") and fails this."""
    whole = set()
    for i in range(tok.num_base_tokens):
        piece = tok.decode([i])
        if piece.startswith(" ") and piece[1:].isalpha():
            whole.add(piece[1:])
    out = tok.decode(reference_greedy(model, tok.encode("Once upon a time"), 24))
    words = [w.strip(".,;:!?\"'-()_") for w in out.split()]
    words = [w for w in words if w]
    assert len(words) >= 8, out
    known = [w for w in words if w in whole or w.lower() in whole]
    assert len(known) >= 0.9 * len(words), out
