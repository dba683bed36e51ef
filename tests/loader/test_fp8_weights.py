"""``--quantization fp8`` at load (``kimik3.loader.fp8``): which projections turn FP8, what stays, the engine
option, and an unknown method's error."""

import pytest
import torch

import kimik3
from kimik3.engine import EngineArgs, SamplingParams
from kimik3.loader.fp8 import FP8_PROJECTIONS
from kimik3.model.layers import Linear, MergedLinear


@pytest.fixture(scope="module")
def models():
    plain = kimik3.load_model(kimik3.DEFAULT_MODEL, device="cpu", dtype=torch.float32)
    fp8 = kimik3.load_model(kimik3.DEFAULT_MODEL, device="cpu", dtype=torch.float32, quantization="fp8")
    return plain, fp8


def test_dense_projections_are_e4m3_with_channel_scales_and_the_rest_stays(models):
    plain, fp8 = models
    quantised = {n for n, m in fp8.named_modules() if getattr(m, "weight_scale", None) is not None}
    expected = {n for n, m in plain.named_modules() if isinstance(m, (Linear, MergedLinear)) and FP8_PROJECTIONS.match(n)}
    assert quantised == expected and len(expected) >= 5 * fp8.config.text.num_hidden_layers
    for name in quantised:
        m, ref = fp8.get_submodule(name), plain.get_submodule(name).weight
        assert m.weight.dtype == torch.float8_e4m3fn and m.weight_scale.shape == (ref.shape[0],)
        back = m.weight.double() * m.weight_scale.double().unsqueeze(1)
        assert ((back - ref.double()).abs() <= 2 ** -4 * ref.double().abs() + 2 ** -10 * m.weight_scale.double()
                .unsqueeze(1) * (1 + 1e-6)).all(), name
    for name in ("lm_head", "model.layers.3.self_attn.kv_b_proj", "model.embed_tokens"):    # kept as loaded
        assert torch.equal(fp8.get_submodule(name).weight, plain.get_submodule(name).weight), name


def test_fp8_model_stays_close_to_the_plain_model(models):
    plain, fp8 = models
    ids = torch.arange(40) * 37 % 4000
    a, b = plain(ids).double(), fp8(ids).double()
    assert (a.argmax(-1) == b.argmax(-1)).double().mean() >= 0.9
    assert not torch.equal(a, b)


def test_engine_option_and_unknown_methods():
    with pytest.raises(ValueError, match=r"quantization 'int4' is not supported; kimik3 takes \['fp8'\]"):
        EngineArgs(quantization="int4")
    with pytest.raises(ValueError, match=r"quantization 'awq' is not supported; kimik3 takes \['fp8'\]"):
        kimik3.load_model(kimik3.DEFAULT_MODEL, quantization="awq")
    llm = kimik3.LLM(quantization="fp8", kv_cache_dtype="fp8", max_model_len=64, max_num_seqs=2, device="cpu",
                     use_tqdm_on_load=False)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.cache.mla_latent.dtype == torch.float8_e4m3fn


def test_block_fp8_checkpoints_are_refused_by_name():
    from kimik3.config import ConfigError, parse_config
    from kimik3.testing import tiny_kimi_linear_config
    cfg = tiny_kimi_linear_config()
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    with pytest.raises(ConfigError, match=r"block-FP8 checkpoints .* not read yet; load the bf16 checkpoint with "
                                          r"--quantization fp8"):
        parse_config(cfg, "block-fp8")
