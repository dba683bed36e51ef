"""Draft checkpoints in their published layouts: they load into the modules that compute like the files say, and
a draft that does not fit the target is an error naming the mismatch."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import kimik3
from kimik3.loader.drafts import DraftError, load_dflash, load_eagle3, load_mtp
from kimik3.model.dflash import DFlashDraft
from kimik3.model.draft_attention import DraftBatch
from kimik3.model.eagle3 import Eagle3Draft
from kimik3.model.mtp import MTPDraft
from kimik3.testing import checkpoint_names, random_weights, tiny_k3_config
from kimik3.loader.writer import save_checkpoint
from kimik3.model.kimi_k3 import KimiForCausalLM
from kimik3.config import parse_config


@pytest.fixture(scope="module")
def target(tiny_ckpt):
    return kimik3.load_model(tiny_ckpt["kimi_k3"], dtype=torch.float32, language_model_only=True)


def eagle3_files(path, target, *, layer=None, drop=(), extra=None, **top):
    text = target.config.text
    layer_cfg = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                 "intermediate_size": 40, "rms_norm_eps": 1e-6, "rope_theta": 1000.0, "vocab_size": text.vocab_size,
                 "hidden_act": "silu", "num_hidden_layers": 1} | (layer or {})
    cfg = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
           "transformer_layer_config": layer_cfg, "draft_vocab_size": 16, "target_hidden_size": text.hidden_size,
           "eagle_aux_hidden_state_layer_ids": [0, 2, text.num_hidden_layers]} | top
    g = torch.Generator().manual_seed(0)
    D, Dt, V = layer_cfg["hidden_size"], cfg["target_hidden_size"], text.vocab_size
    t = {"fc.weight": torch.randn(D, 3 * Dt, generator=g), "embed_tokens.weight": torch.randn(V, D, generator=g),
         "norm.weight": torch.ones(D), "lm_head.weight": torch.randn(16, D, generator=g),
         "d2t": torch.arange(16) * 3, "t2d": torch.zeros(V, dtype=torch.bool)}
    L = "midlayer."          # EAGLE's own name of the one layer
    for n, shape in {"input_layernorm.weight": (D,), "hidden_norm.weight": (D,), "post_attention_layernorm.weight": (D,),
                     "self_attn.q_proj.weight": (32, 2 * D), "self_attn.k_proj.weight": (16, 2 * D),
                     "self_attn.v_proj.weight": (16, 2 * D), "self_attn.o_proj.weight": (D, 32),
                     "mlp.gate_proj.weight": (40, D), "mlp.up_proj.weight": (40, D), "mlp.down_proj.weight": (D, 40)}.items():
        t[L + n] = torch.randn(shape, generator=g) / 4
    for n in drop:
        del t[n]
    t |= extra or {}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(path / "model.safetensors"))
    return t


def test_eagle3_speculators_layout_loads(tmp_path, target):
    t = eagle3_files(tmp_path, target)
    m = load_eagle3(tmp_path, target)
    assert isinstance(m, Eagle3Draft) and m.cfg.aux_layer_ids == (0, 2, target.config.text.num_hidden_layers)
    assert torch.equal(m.layers[0].self_attn.k_proj.weight, t["midlayer.self_attn.k_proj.weight"])
    assert torch.equal(m.to_target(torch.tensor([1, 5])), torch.tensor([4, 20]))
    batch = DraftBatch.build([3], [0], [[1]], 4)
    logits, r = m(torch.tensor([1, 2, 3]), torch.randn(3, 32), batch, torch.zeros(2, 4, 2, 2, 8))
    assert logits.shape == (3, 16) and torch.isfinite(logits).all()


@pytest.mark.parametrize("change, match", [
    (dict(target_hidden_size=40), "width 40"),
    (dict(layer={"vocab_size": 99}), "vocab_size 99"),
    (dict(eagle_aux_hidden_state_layer_ids=[0, 50, 1]), "auxiliary layer ids"),
    (dict(drop=["lm_head.weight"]), "missing tensor.*lm_head.weight"),
    (dict(extra={"mystery.weight": torch.zeros(2)}), "unexpected tensor 'mystery.weight'"),
    (dict(extra={"fc.weight": torch.zeros(32, 7)}), r"'fc.weight' has shape \(32, 7\)"),
    (dict(extra={"d2t": torch.full((16,), 10**6)}), "d2t maps draft ids outside"),
    (dict(layer={"hidden_act": "gelu"}), "hidden_act 'gelu'"),
    (dict(layer={"rope_scaling": {"rope_type": "yarn", "factor": 4}}), "rope scaling 'yarn'"),
    (dict(speculators_model_type="dflash"), "not 'eagle3'"),
])
def test_eagle3_that_does_not_fit_is_an_error_naming_it(tmp_path, target, change, match):
    eagle3_files(tmp_path, target, **change)
    with pytest.raises(DraftError, match=match):
        load_eagle3(tmp_path, target)


def dflash_files(path, target, **top):
    text = target.config.text
    D = text.hidden_size
    cfg = {"speculators_model_type": "dflash", "block_size": 4, "mask_token_id": 5, "draft_vocab_size": text.vocab_size,
           "aux_hidden_state_layer_ids": [1, 3],
           "transformer_layer_config": {"hidden_size": D, "num_attention_heads": 2, "num_key_value_heads": 1,
                                        "head_dim": 16, "intermediate_size": 40, "num_hidden_layers": 2,
                                        "vocab_size": text.vocab_size, "rms_norm_eps": 1e-6}} | top
    m = DFlashDraft(kimik3.loader.drafts.dflash_config(cfg, target, "t"))
    t = {k: v for k, v in m.state_dict().items() if k not in ("embed_tokens.weight", "lm_head.weight", "d2t")}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))


def test_dflash_shares_the_targets_embedding_and_head(tmp_path, target):
    dflash_files(tmp_path, target)
    m = load_dflash(tmp_path, target)
    assert torch.equal(m.lm_head.weight, target.lm_head.weight)
    assert torch.equal(m.embed_tokens.weight, target.model.embed_tokens.weight)
    with pytest.raises(DraftError, match="mask_token_id 99999"):
        dflash_files(tmp_path / "bad", target, mask_token_id=99999)
        load_dflash(tmp_path / "bad", target)
    dflash_files(tmp_path / "dspark", target, speculators_model_type="dspark")     # DFlash-shaped: loads
    assert isinstance(load_dflash(tmp_path / "dspark", target), DFlashDraft)
    with pytest.raises(DraftError, match="Markov head"):
        dflash_files(tmp_path / "markov", target, speculators_model_type="dspark", markov_rank=8)
        load_dflash(tmp_path / "markov", target)


def test_a_draft_the_tensor_parallel_ranks_do_not_divide_is_refused_at_load(tmp_path, target, tiny_ckpt):
    """Under TP2 a DFlash draft with 3 query heads (or an Eagle3 draft with an odd intermediate size) cannot be split
    as its layers say: a DraftError at load naming the size and the fix, before any tensor is read."""
    from kimik3.distributed import ParallelContext
    with torch.device("meta"):
        tp2 = KimiForCausalLM(target.config, ParallelContext(tp_rank=0, tp_size=2))
    dflash_files(tmp_path / "dflash", target, transformer_layer_config={
        "hidden_size": target.config.text.hidden_size, "num_attention_heads": 3, "num_key_value_heads": 1,
        "head_dim": 16, "intermediate_size": 40, "num_hidden_layers": 1, "vocab_size": target.config.text.vocab_size})
    load_dflash(tmp_path / "dflash", target)                   # one process: loads
    with pytest.raises(DraftError, match=r"num_attention_heads \(3\) is not divisible .*2 ranks: use a "
                                         r"tensor_parallel_size that divides it"):
        load_dflash(tmp_path / "dflash", tp2)
    eagle3_files(tmp_path / "eagle3", target, layer={"intermediate_size": 41})
    with pytest.raises(DraftError, match=r"intermediate_size \(41\) is not divisible .*tensor_parallel_size"):
        load_eagle3(tmp_path / "eagle3", tp2)


def test_mtp_layers_load_from_a_k3_checkpoint(tmp_path):
    config = tiny_k3_config(vocab_size=64, vision=False)
    config["text_config"]["num_nextn_predict_layers"] = 1
    model = KimiForCausalLM(parse_config(config))
    random_weights(model, 0)
    text = model.config.text
    mtp = MTPDraft(text, 1)
    random_weights_like(mtp)
    names = list(checkpoint_names(model))
    L = text.num_hidden_layers
    layer = mtp.model.layers[str(L)]
    for name, t in layer.state_dict().items():
        if ".experts." in name:
            continue
        if "in_proj.weight" in name:
            for part in layer.self_attn.in_proj.parts:
                names.append((f"language_model.model.layers.{L}.self_attn.{part}.weight",
                              layer.self_attn.in_proj.part(part)))
        elif "gate_up_proj" in name:
            mlp = layer.block_sparse_moe.shared_experts
            for part in mlp.gate_up_proj.parts:
                names.append((f"language_model.model.layers.{L}.block_sparse_moe.shared_experts.{part}.weight",
                              mlp.gate_up_proj.part(part)))
        else:
            names.append((f"language_model.model.layers.{L}.{name}", t))
    ex = layer.block_sparse_moe.experts
    for e in range(text.num_experts):
        for which, w in (("w1", ex.w1[e]), ("w3", ex.w3[e]), ("w2", ex.w2[e])):
            names.append((f"language_model.model.layers.{L}.block_sparse_moe.experts.{e}.{which}.weight", w))
    save_checkpoint(tmp_path, config, names, mxfp4_experts=True)
    target = kimik3.load_model(tmp_path, dtype=torch.float32)      # the target skips the MTP layer's tensors
    loaded = load_mtp(tmp_path, target)
    assert torch.equal(loaded.model.layers[str(L)].eh_proj.weight, layer.eh_proj.weight)
    from kimik3.ops import mxfp4
    w = ex.w2[1].detach()
    assert torch.equal(loaded.model.layers[str(L)].block_sparse_moe.experts.w2[1], mxfp4.dequantize(*mxfp4.quantize(w), torch.float32))


def random_weights_like(module):
    g = torch.Generator().manual_seed(3)
    for p in module.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) / 8)


def test_mtp_without_layers_says_so(tiny_ckpt, target):
    with pytest.raises(DraftError, match="num_nextn_predict_layers is 0"):
        load_mtp(tiny_ckpt["kimi_k3"], target)


def _mtp_checkpoint(path, config: dict, mtp: MTPDraft, model: KimiForCausalLM) -> None:
    """The target's tensors and the MTP layers' in the K3 layout (A_log as Kimi-Linear's [1, 1, H, 1], the short
    convs as [P, W]: the shapes the target's loader accepts too)."""
    names = list(checkpoint_names(model))
    for n, t in KimiForCausalLM.checkpoint_weights(mtp):
        t = t.reshape(1, 1, -1, 1) if n.endswith("A_log") else t.squeeze(1) if "_conv1d." in n else t
        names.append((f"language_model.{n}", t))
    save_checkpoint(path, config, names, mxfp4_experts=True)


def test_mtp_kda_layer_loads_and_a_mixer_mismatch_is_named(tmp_path):
    """An MTP layer listed in kda_layers (L + 1) is a KDA block: it loads from the K3 layout, its A_log / dt_bias
    kept fp32 in a bf16 draft as the target keeps them; a checkpoint whose layer holds the other mixer's tensors
    is refused naming the layer and the kda_layers entry; kda_layers past the MTP layers stays refused."""
    config = tiny_k3_config(vocab_size=64, vision=False)
    text_cfg = config["text_config"]
    L = text_cfg["num_hidden_layers"]
    text_cfg["num_nextn_predict_layers"] = 1
    plain_layers = list(text_cfg["linear_attn_config"]["kda_layers"])
    text_cfg["linear_attn_config"]["kda_layers"] = plain_layers + [L + 1]
    model = KimiForCausalLM(parse_config(config))
    random_weights(model, 0)
    mtp = MTPDraft(model.config.text, 1)
    random_weights_like(mtp)
    assert mtp.layer(0).is_kda
    _mtp_checkpoint(tmp_path / "kda", config, mtp, model)
    target = kimik3.load_model(tmp_path / "kda", dtype=torch.float32)
    loaded = load_mtp(tmp_path / "kda", target).layer(0)
    want = mtp.layer(0).self_attn
    for name in ("A_log", "dt_bias", "conv1d.weight", "in_proj.weight", "f_b_proj.weight"):
        assert torch.equal(loaded.self_attn.get_parameter(name), want.get_parameter(name)), name
    narrow = load_mtp(tmp_path / "kda", target, dtype=torch.bfloat16).layer(0)
    assert narrow.self_attn.A_log.dtype == torch.float32 and narrow.self_attn.dt_bias.dtype == torch.float32
    assert narrow.eh_proj.weight.dtype == torch.bfloat16

    as_mla = json.loads(json.dumps(config))          # the same KDA tensors, the config makes the layer MLA
    as_mla["text_config"]["linear_attn_config"]["kda_layers"] = plain_layers
    _mtp_checkpoint(tmp_path / "mla_cfg", as_mla, mtp, model)
    with pytest.raises(DraftError, match=rf"MTP layer {L} is an MLA layer .*KDA tensors .*add {L + 1} to kda_layers"):
        load_mtp(tmp_path / "mla_cfg", kimik3.load_model(tmp_path / "mla_cfg", dtype=torch.float32))
    mla = MTPDraft(parse_config(as_mla).text, 1)     # MLA tensors, the config makes the layer KDA
    random_weights_like(mla)
    _mtp_checkpoint(tmp_path / "kda_cfg", config, mla, model)
    with pytest.raises(DraftError, match=rf"MTP layer {L} is a KDA layer .*MLA attention tensors .*remove {L + 1}"):
        load_mtp(tmp_path / "kda_cfg", target)
    text_cfg["linear_attn_config"]["kda_layers"] = plain_layers + [L + 2]
    with pytest.raises(ValueError, match=rf"outside 1..{L + 1}"):
        parse_config(config)
