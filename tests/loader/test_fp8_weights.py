"""``--quantization fp8`` at load (``kimik3.loader.fp8``): which projections turn FP8, what stays, the engine
option, and an unknown method's error."""

import re

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


def _to_block_fp8(path):
    """Rewrite a checkpoint folder as block FP8 (the DeepSeek / Kimi layout): every projection and routed-expert
    matrix E4M3 with a float32 weight_scale_inv per 128 x 128 block; returns {name: (codes, scale_inv)}."""
    import json

    from safetensors.torch import load_file, save_file
    from kimik3.ops import fp8
    stored = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors = load_file(str(f))
        out = {}
        for name, t in tensors.items():
            if t.dim() == 2 and re.search(r"(_proj|_proj_with_mqa|\.w[123])\.weight$", name):
                codes, inv = fp8.quantize_weight(t.float(), 128)
                out[name], out[name + "_scale_inv"] = codes, inv
                stored[name] = (codes, inv)
            else:
                out[name] = t
        save_file(out, str(f))
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update({k + "_scale_inv": v for k, v in data["weight_map"].items() if k in stored})
        index.write_text(json.dumps(data))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(cfg))
    return stored


def test_block_fp8_checkpoint_loads_as_stored(tmp_path):
    """Every E4M3 matrix dequantised exactly (code x scale_inv) where the model keeps its dtype; the dense
    projections whose parts are all FP8 and start on 128-row boundaries keep the file's codes and block scales,
    bit for bit, and run through fp8_linear."""
    from kimik3.ops import fp8
    from kimik3.testing import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path / "kl", arch="kimi_linear", dtype=torch.float32, hidden=128,
                                max_shard_bytes=1 << 30)
    plain = kimik3.load_model(path, dtype=torch.float32)
    stored = _to_block_fp8(path)
    model = kimik3.load_model(path, dtype=torch.float32)
    kept = {n: m for n, m in model.named_modules() if getattr(m, "weight_scale", None) is not None}
    assert "model.layers.0.mlp.down_proj" in kept and any(n.endswith("o_proj") for n in kept)
    for name, m in kept.items():
        assert m.weight.dtype == torch.float8_e4m3fn and m.weight_scale.dim() == 2
        if isinstance(m, Linear):
            codes, inv = stored[name + ".weight"]
            assert torch.equal(m.weight.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(m.weight_scale, inv)
    checked = 0
    for name, p in model.checkpoint_weights():
        if name in stored and p.dtype != torch.float8_e4m3fn:
            codes, inv = stored[name]
            assert torch.equal(p.float(), fp8.dequantize_weight(codes, inv, torch.float64).float()), name
            checked += 1
    assert checked > 0
    for name, (codes, inv) in stored.items():          # the plain model with the checkpoint's values
        plain.load_weight(name, fp8.dequantize_weight(codes, inv, torch.float64))
    ids = torch.arange(12) * 7 % 200                    # up to FP8_GEMV_MAX_ROWS rows: x as it is
    a, b = plain(ids).double(), model(ids).double()
    assert torch.isfinite(b).all() and (a - b).norm() / a.norm() < 1e-5


def test_block_fp8_checkpoints_of_other_layouts_are_refused_by_name():
    from kimik3.config import ConfigError, parse_config
    from kimik3.testing import tiny_kimi_linear_config
    cfg = tiny_kimi_linear_config()
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [64, 64]}
    with pytest.raises(ConfigError, match=r"FP8 checkpoints are read with weight_block_size \[128, 128\]"):
        parse_config(cfg, "block-fp8")


# ---- routed experts: Kimi-Linear's bf16 experts turn FP8; K3's MXFP4 ones stay (W4A8 keeps them packed) ------
@pytest.fixture(scope="module")
def kimi_linear_dir(tmp_path_factory):
    from kimik3.testing import make_tiny_checkpoint
    path = tmp_path_factory.mktemp("kl")
    make_tiny_checkpoint(path, "kimi_linear", hidden=64)
    return path


def test_bf16_experts_load_as_e4m3_with_channel_scales(kimi_linear_dir):
    """Each expert matrix E4M3 with one scale per output row, within E4M3's bound of the bf16 weights; the MoE
    blocks' routed experts near the plain ones; the forward runs on the FP8 experts."""
    from kimik3.model.moe import Experts
    plain = kimik3.load_model(kimi_linear_dir, dtype=torch.float32)
    fp8 = kimik3.load_model(kimi_linear_dir, dtype=torch.float32, quantization="fp8")
    pairs = [(p, q) for p, q in zip(plain.modules(), fp8.modules()) if isinstance(q, Experts)]
    assert len(pairs) == plain.config.text.num_hidden_layers - 1
    for p, q in pairs:
        assert q.fp8 and not p.fp8
        for which in ("w13", "w2"):
            codes, scale, ref = getattr(q, which), getattr(q, f"{which}_scale"), getattr(p, which).double()
            assert codes.dtype == torch.float8_e4m3fn and scale.shape == ref.shape[:2]
            back = codes.double() * scale.double().unsqueeze(-1)
            assert ((back - ref).abs() <= 2 ** -4 * ref.abs() + 2 ** -10 * scale.double().unsqueeze(-1) * (1 + 1e-6)).all()
            assert torch.equal(scale, ref.abs().amax(-1).float() / 448)            # amax / 448 in float32
    moe_p, moe_q = plain.model.layers[1].block_sparse_moe, fp8.model.layers[1].block_sparse_moe
    x = torch.randn(40, plain.config.text.hidden_size, generator=torch.Generator().manual_seed(0))
    weights, ids = moe_p.route(x)
    u_p, u_q = moe_p.run_experts(x, weights, ids), moe_q.run_experts(x, weights, ids)
    assert 1e-4 < ((u_p - u_q).norm() / u_p.norm()).item() < 0.05
    assert torch.isfinite(fp8(torch.arange(20) * 7 % 250)).all()


def test_offloaded_experts_are_fp8_too(kimi_linear_dir, caplog):
    """``--quantization fp8`` with ``--cpu-offload-gb``: the host pool holds the E4M3 codes and their channel scales,
    the GPU pool (its rows) the same, and the logits are the resident FP8 model's bit for bit."""
    from kimik3.model.expert_offload import ExpertOffloadConfig
    from kimik3.model.moe import Experts
    resident = kimik3.load_model(kimi_linear_dir, dtype=torch.float32, quantization="fp8")
    model = kimik3.load_model(kimi_linear_dir, dtype=torch.float32, quantization="fp8",
                              expert_offload=ExpertOffloadConfig.from_gib(0.0001))
    assert all(m.fp8 for m in model.modules() if isinstance(m, Experts))
    o = model.expert_offload
    assert o.staging_size > 0 and o.kinds == ["w13", "w2", "w13_scale", "w2_scale"]
    assert o.pool["w13"].dtype == torch.float8_e4m3fn and o.pool["w13_scale"].dtype == torch.float32
    host = model.moe_blocks()[0].experts
    assert torch.equal(o.pool["w2_scale"][:o.cache_size], host.w2_scale[o.cached[0]])
    assert "stay in the model dtype" not in caplog.text
    assert any(getattr(m, "weight_scale", None) is not None for m in model.modules())       # projections FP8
    ids = torch.arange(20) * 7 % 250
    assert torch.equal(model(ids), resident(ids))


def test_mxfp4_experts_stay_mxfp4_and_w4a8_keeps_them_packed_on_the_cpu():
    from kimik3.model.moe import Experts
    from kimik3.ops.options import KernelOptions, use_kernel_options
    fp8 = kimik3.load_model(kimik3.DEFAULT_MODEL, dtype=torch.float32, quantization="fp8")
    assert not any(m.fp8 or m.mxfp4 for m in fp8.modules() if isinstance(m, Experts))       # dense (dequantised)
    with use_kernel_options(KernelOptions(w4a8_moe=True)):
        packed = kimik3.load_model(kimik3.DEFAULT_MODEL, dtype=torch.float32)
        assert all(m.mxfp4 for m in packed.modules() if isinstance(m, Experts))
        ids = torch.arange(64) * 37 % 4000
        a, b = fp8(ids).double(), packed(ids).double()
    assert torch.isfinite(b).all() and not torch.equal(a, b)
    assert EngineArgs(enable_w4a8_moe=True).kernel_options().w4a8_moe
    assert not EngineArgs().kernel_options().w4a8_moe and not EngineArgs(enable_w4a8_moe=False).kernel_options().w4a8_moe


def test_llm_serves_a_kimi_linear_checkpoint_with_fp8_experts(kimi_linear_dir):
    """``LLM(quantization="fp8")`` serves FP8 experts; with ``cpu_offload_gb`` too (part of them in host memory, codes
    and scales), the same greedy tokens."""
    from kimik3.model.moe import Experts
    kw = dict(model=str(kimi_linear_dir), quantization="fp8", max_model_len=64, max_num_seqs=2, device="cpu",
              use_tqdm_on_load=False, tokenizer=str(kimik3.DEFAULT_MODEL))
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 3, 11]}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = kimik3.LLM(**kw)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert [len(t) for t in out] == [4, 4]
    assert all(m.fp8 for m in llm.engine.model.modules() if isinstance(m, Experts))
    offloaded = kimik3.LLM(cpu_offload_gb=0.00005, **kw)
    o = offloaded.engine.model.expert_offload
    assert 0 < o.staging_size < o.num_experts and o.pool["w13"].dtype == torch.float8_e4m3fn
    assert [r.outputs[0].token_ids for r in offloaded.generate(prompts, params)] == out
    assert o.stats()["staged_experts"] + o.stats()["host_pairs"] > 0
