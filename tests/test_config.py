"""Config parsing: the release file as is, the derived schedule, and clear errors."""

import copy
import json
import logging
from pathlib import Path

import pytest

from kimik3.config import ConfigError, load_config, parse_config
from kimik3.testing import tiny_kimi_linear_config

RELEASE = Path(__file__).resolve().parent / "data" / "kimi-k3-release.config.json"


@pytest.fixture(scope="module")
def release():
    return json.loads(RELEASE.read_text())


def test_release_config_parses_with_the_spec_schedule(release):
    cfg = parse_config(release, "release")
    t = cfg.text
    assert cfg.architecture == "kimi_k3" and cfg.weight_prefix == "language_model."
    assert sum(t.is_kda_layer(i) for i in range(93)) == 69
    assert t.mla_layer_ids == tuple(range(3, 92, 4)) + (92,)           # 91 and 92 both MLA
    assert [t.is_moe_layer(i) for i in range(3)] == [False, True, True]  # dense only at layer 0
    assert t.num_attn_res_blocks == 8 and t.attn_res_block_size == 12
    assert t.kda.use_full_rank_gate and t.kda.gate_lower_bound == -5.0
    assert t.mla_use_output_gate and t.q_lora_rank == 1536 and t.mla_cache_dim == 576
    assert t.routed_expert_hidden_size == 3584 and t.latent_moe_use_norm
    assert (t.hidden_act, t.situ_beta, t.situ_linear_beta) == ("situ", 4.0, 25.0)
    assert t.expert_quantization == "mxfp4"
    assert cfg.vision.patch_size == 14 and cfg.vision.text_hidden_size == 7168
    assert cfg.media_placeholder_token_id == 163605 and t.eos_token_id == 163586 and t.pad_token_id == 163839
    assert t.numerics.mla_latent_norm_eps == 1e-6                       # D1 official default


def test_unknown_keys_are_logged_generic_hf_keys_are_not(release, caplog):
    data = copy.deepcopy(release)
    data["text_config"]["my_new_feature"] = 3
    with caplog.at_level(logging.INFO, logger="kimik3.config"):
        parse_config(data, "x.json")
    msgs = [r.getMessage() for r in caplog.records]
    assert any("text_config.my_new_feature" in m for m in msgs)
    assert not any("top_p" in m or "id2label" in m for m in msgs)


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "rms_norm_eps", "kv_lora_rank",
                                 "routed_scaling_factor", "activation_situ_linear_beta", "linear_attn_config",
                                 "num_experts_per_token"])
def test_missing_load_bearing_key_names_key_and_file(release, key):
    data = copy.deepcopy(release)
    del data["text_config"][key]
    with pytest.raises(ConfigError, match=rf"cfg\.json: key 'text_config\.{key}' is required"):
        parse_config(data, "cfg.json")


def test_ill_typed_key_is_an_error(release):
    data = copy.deepcopy(release)
    data["text_config"]["hidden_size"] = "7168"
    with pytest.raises(ConfigError, match=r"'text_config\.hidden_size' must be an integer, got str"):
        parse_config(data, "cfg.json")
    data = copy.deepcopy(release)
    data["text_config"]["linear_attn_config"]["kda_layers"] = [1, "2"]
    with pytest.raises(ConfigError, match="kda_layers"):
        parse_config(data, "cfg.json")


def test_bad_values_are_rejected(release):
    data = copy.deepcopy(release)
    data["text_config"]["mla_use_nope"] = False
    with pytest.raises(ConfigError, match="mla_use_nope"):
        parse_config(data, "c")
    data = copy.deepcopy(release)
    data["text_config"]["linear_attn_config"]["gate_lower_bound"] = -6.0
    with pytest.raises(ConfigError, match="gate_lower_bound"):
        parse_config(data, "c")
    with pytest.raises(ConfigError, match="model_type"):
        parse_config({"model_type": "llama"}, "c")
    data = copy.deepcopy(release)
    data["text_config"]["routed_expert_hidden_size"] = None        # a latent norm with no latent width
    with pytest.raises(ConfigError, match="latent_moe_use_norm.*routed_expert_hidden_size is null"):
        parse_config(data, "c")


@pytest.mark.parametrize("where", ["top", "text_config"])
def test_tied_embeddings_are_refused(release, where):
    data = copy.deepcopy(release)
    (data if where == "top" else data["text_config"])["tie_word_embeddings"] = True
    key = "tie_word_embeddings" if where == "top" else "text_config.tie_word_embeddings"
    with pytest.raises(ConfigError, match=rf"key '{key}' is true, but .*untied"):
        parse_config(data, "c")
    linear = tiny_kimi_linear_config()
    linear["tie_word_embeddings"] = True
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        parse_config(linear, "kl")


def test_kimi_linear_branches_selected_from_fields():
    cfg = parse_config(tiny_kimi_linear_config(), "kl")
    t = cfg.text
    assert cfg.architecture == "kimi_linear" and cfg.weight_prefix == ""
    assert t.attn_res_block_size is None and t.routed_expert_hidden_size is None
    assert t.kda.gate_lower_bound is None and not t.kda.use_full_rank_gate
    assert t.q_lora_rank is None and not t.mla_use_output_gate and t.hidden_act == "silu"
    assert t.routed_scaling_factor == 2.446 and t.expert_quantization is None


def test_load_config_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)


def test_numeric_switches():
    cfg = parse_config(tiny_kimi_linear_config(), "kl", mla_latent_norm_eps=1e-5, moe_combine_fp32=False)
    assert cfg.text.numerics.mla_latent_norm_eps == 1e-5 and not cfg.text.numerics.moe_combine_fp32
    with pytest.raises(ConfigError, match="f32_param_policy"):
        parse_config(tiny_kimi_linear_config(), "kl", f32_param_policy="bogus")
