"""The embedded default model: rebuilt by its script byte for byte, and in the release layout."""

import hashlib
import importlib.util
import json
from pathlib import Path

import kimik3

ROOT = Path(__file__).resolve().parents[1]


def digest(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_script_rebuilds_the_committed_checkpoint_exactly(tmp_path):
    spec = importlib.util.spec_from_file_location("make_default_model", ROOT / "scripts" / "make_default_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.build(tmp_path / "rebuilt")
    assert digest(tmp_path / "rebuilt") == digest(kimik3.DEFAULT_MODEL)


def test_default_model_is_a_k3_release_layout_with_everything_on():
    cfg = json.loads((kimik3.DEFAULT_MODEL / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3" and "vision_config" in cfg
    text = cfg["text_config"]
    assert text["attn_res_block_size"] and text["latent_moe_use_norm"] and text["mla_use_output_gate"]
    assert text["hidden_act"] == "situ" and text["linear_attn_config"]["gate_lower_bound"] == -5.0
    assert text["quantization_config"]["format"] == "mxfp4-pack-quantized"
    index = json.loads((kimik3.DEFAULT_MODEL / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(k.endswith("experts.0.w1.weight_packed") for k in index)
    assert any(k.startswith("vision_tower.") for k in index) and any(k.startswith("mm_projector.") for k in index)
    size = sum(f.stat().st_size for f in kimik3.DEFAULT_MODEL.iterdir())
    assert size < 4 << 20                                  # small enough to ship in the package
    tok = kimik3.load_tokenizer(kimik3.DEFAULT_MODEL)
    assert tok.chat_format == "k3" and tok.convert_tokens_to_ids("<|media_pad|>") == cfg["media_placeholder_token_id"]
