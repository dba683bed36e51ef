"""Loading: release layouts, MXFP4 experts, and every bad-checkpoint path with a clear error."""

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimik3 import load_model
from kimik3.loader.safetensors_files import CheckpointError
from kimik3.loader.writer import save_checkpoint
from kimik3.testing import checkpoint_names, make_tiny_checkpoint, tiny_k3_config

IDS = torch.tensor([5, 17, 200, 3, 99, 42, 7])


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def rewrite(path, fn):
    """Apply fn(name -> tensor dict) to every shard, keeping the index in sync."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for f in sorted(path.glob("*.safetensors")):
        tensors = fn(load_file(str(f)))
        save_file(tensors, str(f))
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != f.name}
        index["weight_map"].update({k: f.name for k in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_release_layout_is_sharded_with_mxfp4_experts(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "k3", "kimi_k3", max_shard_bytes=64 << 10)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed" in index
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_scale" in index
    assert "language_model.lm_head.weight" in index and "language_model.model.embed_tokens.weight" in index
    tensors = {}
    for f in set(index.values()):
        tensors.update(load_file(str(path / f)))
    assert tensors["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"].dtype == torch.uint8
    # as in the release: conv, A_log, dt_bias, o_norm and the router bias are F32, the rest BF16
    p = "language_model.model.layers."
    for name in ("0.self_attn.q_conv1d.weight", "0.self_attn.A_log", "0.self_attn.dt_bias", "0.self_attn.o_norm.weight",
                 "1.block_sparse_moe.gate.e_score_correction_bias"):
        assert tensors[p + name].dtype == torch.float32, name
    assert tensors[p + "0.self_attn.q_proj.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("arch", ["kimi_k3", "kimi_linear"])
def test_write_load_round_trip_gives_identical_logits(tiny_ckpt, tmp_path, arch):
    model = load_model(tiny_ckpt[arch], dtype=torch.float32)
    again = save_checkpoint(tmp_path / "again", json.loads((tiny_ckpt[arch] / "config.json").read_text()),
                            checkpoint_names(model), mxfp4_experts=arch == "kimi_k3", max_shard_bytes=32 << 10)
    reloaded = load_model(again, dtype=torch.float32)
    assert torch.equal(reloaded(IDS), model(IDS))
    for (n1, t1), (n2, t2) in zip(model.checkpoint_weights(), reloaded.checkpoint_weights()):
        assert n1 == n2 and torch.equal(t1, t2), n1


def test_mxfp4_experts_dequantize_to_the_stored_grid(tiny_ckpt):
    model = load_model(tiny_ckpt["kimi_k3"], dtype=torch.float32)
    tensors = {}
    for f in tiny_ckpt["kimi_k3"].glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    p = "language_model.model.layers.2.block_sparse_moe.experts.5.w2."
    packed, scale = tensors[p + "weight_packed"], tensors[p + "weight_scale"]
    lut = [0, .5, 1, 1.5, 2, 3, 4, 6]
    w = model.model.layers[2].block_sparse_moe.experts.w2[5]
    for n in range(0, w.shape[0], 7):
        for k in range(0, w.shape[1], 5):
            code = int(packed[n, k // 2]) >> (4 * (k % 2)) & 15
            value = (-1 if code & 8 else 1) * lut[code & 7] * 2.0 ** (int(scale[n, k // 32]) - 127)
            assert w[n, k].item() == value


def test_single_file_checkpoint_and_vllm_prefix_alias(tiny_ckpt, tmp_path):
    ref = load_model(tiny_ckpt["kimi_k3"])(IDS)
    path = tmp_path / "single"
    path.mkdir()
    shutil.copy(tiny_ckpt["kimi_k3"] / "config.json", path)
    tensors = {}
    for f in tiny_ckpt["kimi_k3"].glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    renamed = {k.replace("language_model.model.layers.", "language_model.layers."): v for k, v in tensors.items()}
    save_file(renamed, str(path / "model.safetensors"))
    assert torch.equal(load_model(path)(IDS), ref)


def test_a_log_accepts_legacy_and_longer_shapes(tiny_ckpt, tmp_path, caplog):
    path = copy_ckpt(tiny_ckpt["kimi_k3"], tmp_path / "alog")
    ref = load_model(path)(IDS)
    key = "language_model.model.layers.0.self_attn.A_log"

    def longer(t):
        if key in t:
            t[key] = torch.cat([t[key], torch.tensor([0.0, 1.0])])
        return t
    rewrite(path, longer)
    with caplog.at_level(logging.WARNING):
        assert torch.equal(load_model(path)(IDS), ref)
    assert any("discarded tail is non-zero" in r.getMessage() for r in caplog.records)


def test_missing_shard_is_named(tiny_ckpt, tmp_path):
    path = copy_ckpt(tiny_ckpt["kimi_k3"], tmp_path / "c")
    victim = sorted(path.glob("*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_model(path)


def test_truncated_file_is_named(tiny_ckpt, tmp_path):
    path = copy_ckpt(tiny_ckpt["kimi_k3"], tmp_path / "c")
    victim = sorted(path.glob("*.safetensors"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{victim.name}: truncated"):
        load_model(path)


def test_wrong_shape_names_tensor_and_file(tiny_ckpt, tmp_path):
    path = copy_ckpt(tiny_ckpt["kimi_k3"], tmp_path / "c")
    key = "language_model.model.layers.3.self_attn.kv_b_proj.weight"

    def bad(t):
        if key in t:
            t[key] = t[key][:, :-1].contiguous()
        return t
    rewrite(path, bad)
    with pytest.raises(ValueError, match=r"kv_b_proj\.weight.*has shape \(32, 15\).*expects \(32, 16\)"):
        load_model(path)


def test_unexpected_and_missing_tensors(tiny_ckpt, tmp_path):
    path = copy_ckpt(tiny_ckpt["kimi_k3"], tmp_path / "u")
    rewrite(path, lambda t: {**t, "language_model.model.layers.0.self_attn.bogus.weight": torch.zeros(2)}
            if "language_model.model.norm.weight" in t else t)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.bogus\.weight'"):
        load_model(path)
    path = copy_ckpt(tiny_ckpt["kimi_k3"], tmp_path / "m")
    rewrite(path, lambda t: {k: v for k, v in t.items() if not k.endswith("layers.2.mlp_res_norm.weight")})
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): model\.layers\.2\.mlp_res_norm\.weight"):
        load_model(path)
    path = copy_ckpt(tiny_ckpt["kimi_k3"], tmp_path / "p")
    rewrite(path, lambda t: {k: v for k, v in t.items() if not k.endswith("experts.3.w3.weight_scale")})
    with pytest.raises(CheckpointError, match=r"experts\.3\.w3\.weight_packed' has no matching"):
        load_model(path)


def test_merged_projections_load_by_their_checkpoint_names(tiny_ckpt, tmp_path):
    """The merged input projection of a KDA layer holds q_proj's rows first, then k, v, f_a, b and the
    gate, each the checkpoint tensor of its name; its own name is no checkpoint tensor (refused)."""
    from safetensors.torch import load_file
    path = tiny_ckpt["kimi_k3"]
    model = load_model(path, dtype=torch.float32)
    stored = {}
    for f in sorted(path.glob("*.safetensors")):
        stored.update(load_file(f))
    attn = model.model.layers[0].self_attn
    p = "language_model.model.layers.0.self_attn."
    want = torch.cat([stored[p + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", "g_proj")])
    assert torch.equal(attn.in_proj.weight.data, want.float())
    assert "model.layers.0.self_attn.in_proj.weight" not in model.expected_weights()
    path = copy_ckpt(path, tmp_path / "merged")
    rewrite(path, lambda t: {**t, p + "in_proj.weight": attn.in_proj.weight.data.bfloat16()}
            if "language_model.model.norm.weight" in t else t)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.in_proj\.weight'"):
        load_model(path)


def test_bad_arguments(tiny_ckpt, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(tiny_ckpt["kimi_k3"], dtype=torch.int32)
    model = load_model(tiny_ckpt["kimi_k3"])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 256\)"):
        model(torch.tensor([1, 256]))
    with pytest.raises(ValueError, match="non-empty 1-D"):
        model(torch.tensor([[1, 2]]))
    with pytest.raises(CheckpointError, match="no safetensors files"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "config.json").write_text(json.dumps(tiny_k3_config()))
        load_model(tmp_path / "empty")
