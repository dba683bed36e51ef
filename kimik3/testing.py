"""Tiny checkpoints in the exact release layouts, with random weights (tests, the embedded
default model, benchmarks). ``make_tiny_checkpoint`` writes what ``load_model`` reads. Also the deep grammars the
grammar-worker tests and ``benchmarks/serve_hostile.py`` send (``object_chain``, ``rule_chain``)."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import torch

from kimik3.config import parse_config
from kimik3.loader.writer import save_checkpoint
from kimik3.model.kimi_k3 import KimiForCausalLM
from kimik3.ops import mxfp4

MXFP4_QUANTIZATION = {
    "config_groups": {"group_0": {
        "format": "mxfp4-pack-quantized", "input_activations": None, "output_activations": None,
        "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32,
                    "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8",
                    "strategy": "group", "symmetric": True, "type": "float", "zp_dtype": None}}},
    "format": "mxfp4-pack-quantized", "global_compression_ratio": None,
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}


def _layer_lists(num_layers: int, mla_every: int = 4) -> tuple[list[int], list[int]]:
    """K3's pattern, 1-based: MLA at every ``mla_every``-th layer and at the last layer."""
    full = [i for i in range(1, num_layers + 1) if i % mla_every == 0 or i == num_layers]
    return [i for i in range(1, num_layers + 1) if i not in full], full


TINY_VISION = {
    "_attn_implementation": "flash_attention_2", "activation_func": "gelu_pytorch_tanh", "attn_bias": False,
    "init_pos_emb_height": 8, "init_pos_emb_time": 4, "init_pos_emb_width": 8, "linear_bias": False,
    "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mlp_type": "mlp2", "mm_hidden_size": 32,
    "mm_projector_type": "patchmergerv2", "norm_type": "rmsnorm", "patch_embed_proj_bias": False, "patch_size": 14,
    "pos_emb_interpolation_mode": "bilinear", "pos_emb_type": "divided_fixed", "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5, "qkv_hidden_size": 48, "vt_hidden_size": 32, "vt_intermediate_size": 64,
    "vt_num_attention_heads": 2, "vt_num_hidden_layers": 2,
}


def tiny_k3_config(vocab_size: int = 256, num_layers: int = 6, hidden: int = 64, block_size: int = 2,
                   num_experts: int = 8, top_k: int = 2, bos: int = 1, eos: int = 2, pad: int = 3,
                   media: int = 4, vision: bool = True, num_heads: int = 2) -> dict[str, Any]:
    """A K3 ``config.json`` (top level ``kimi_k3``) with every K3 feature on (vision tower
    included unless ``vision=False``), at toy widths. ``num_heads``: KDA and MLA heads (4 lets
    tensor-parallel tests cut them 4 ways)."""
    kda, full = _layer_lists(num_layers)
    text = {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": 96,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads, "num_key_value_heads": num_heads,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "initializer_range": 0.02, "use_cache": True,
        "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
        "mla_use_nope": True, "mla_use_output_gate": True,
        "linear_attn_config": {"kda_layers": kda, "full_attn_layers": full, "num_heads": num_heads, "head_dim": 16,
                               "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True},
        "num_experts": num_experts, "num_experts_per_token": top_k, "num_shared_experts": 2,
        "moe_intermediate_size": 32, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 1.0, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "use_grouped_topk": True,
        "routed_expert_hidden_size": 32, "latent_moe_use_norm": True, "attn_res_block_size": block_size,
        "num_nextn_predict_layers": 0, "max_position_embeddings": 1048576,
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
        "quantization_config": copy.deepcopy(MXFP4_QUANTIZATION), "dtype": "bfloat16",
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "dtype": "bfloat16",
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "ignore_index": -100,
        "media_placeholder_token_id": media, "image_placeholder": "<|kimi_image_placeholder|>",
        "tie_word_embeddings": False, "text_config": text,
        **({"vision_config": {**copy.deepcopy(TINY_VISION), "text_hidden_size": hidden}} if vision else {}),
    }


def tiny_kimi_linear_config(vocab_size: int = 256, num_layers: int = 5, hidden: int = 48,
                            num_experts: int = 8, top_k: int = 2, num_heads: int = 2) -> dict[str, Any]:
    """A bare ``kimi_linear`` config.json: plain q_proj, low-rank KDA gate, softplus decay,
    no attention residuals, no latent MoE, SiLU, bf16 experts, routed_scaling_factor 2.446."""
    kda, full = _layer_lists(num_layers)
    return {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": 80, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_heads, "head_dim": 72, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "q_lora_rank": None, "kv_lora_rank": 16,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "mla_use_nope": True,
        "linear_attn_config": {"kda_layers": kda, "full_attn_layers": full, "num_heads": num_heads, "head_dim": 16,
                               "short_conv_kernel_size": 4},
        "num_experts": num_experts, "num_experts_per_token": top_k, "num_shared_experts": 1,
        "moe_intermediate_size": 24, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 2.446, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_expert_group": 1, "topk_group": 1, "model_max_length": 1048576,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3,
    }


def random_weights(model: KimiForCausalLM, seed: int = 0) -> None:
    """Fill a model with random weights of sensible scale. For MXFP4 checkpoints the expert
    weights lie on the MXFP4 grid (E2M1 codes times powers of two): storage round-trips exactly."""
    on_grid = model.config.text.expert_quantization == "mxfp4"
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        shape = p.shape
        if name.endswith("A_log"):
            value = torch.log(torch.empty(shape).uniform_(1.0, 16.0, generator=g))
        elif name.endswith("dt_bias"):
            value = 0.5 * torch.randn(shape, generator=g)
        elif name.endswith("e_score_correction_bias"):
            value = 0.1 * torch.randn(shape, generator=g)
        elif "conv1d" in name:
            value = 0.5 * torch.randn(shape, generator=g)
        elif ".experts.w" in name and on_grid:
            value = _mxfp4_grid(shape, g)
        elif p.dim() == 1:                                     # norm weights
            value = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("embed_tokens.weight"):
            value = torch.randn(shape, generator=g)
        else:
            value = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        p.data.copy_(value)


def _mxfp4_grid(shape: torch.Size, g: torch.Generator) -> torch.Tensor:
    E, N, K = shape
    codes = torch.randint(0, 16, (E * N, K), generator=g, dtype=torch.uint8)
    # scale ~ 1/(2 sqrt(K)) so expert outputs stay O(1)
    base = 127 - round(math.log2(2 * math.sqrt(K)))
    scale = (base + torch.randint(-1, 2, (E * N, K // mxfp4.GROUP), generator=g)).to(torch.uint8)
    return mxfp4.dequantize(mxfp4.pack_codes(codes), scale).view(E, N, K)


def checkpoint_names(model: KimiForCausalLM):
    """(release checkpoint name, tensor) for the model's weights in its architecture's layout."""
    prefix = model.config.weight_prefix
    for name, tensor in model.checkpoint_weights():
        if name.startswith("vision."):
            yield name[len("vision."):], tensor
            continue
        if name.endswith(".A_log") and model.config.architecture == "kimi_linear":
            tensor = tensor.view(1, 1, -1, 1)                 # Kimi-Linear stores [1, 1, H, 1]
        yield prefix + name, tensor


def make_tiny_checkpoint(path: str | Path, arch: str = "kimi_k3", seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                         config: dict | None = None, max_shard_bytes: int = 1 << 20, **overrides) -> Path:
    """Write a random tiny checkpoint of ``arch`` ("kimi_k3" or "kimi_linear") to ``path``.
    ``overrides`` go to the tiny config builder; ``config`` replaces it entirely."""
    if config is None:
        builders = {"kimi_k3": tiny_k3_config, "kimi_linear": tiny_kimi_linear_config}
        if arch not in builders:
            raise ValueError(f"arch must be one of {sorted(builders)}, got {arch!r}")
        config = builders[arch](**overrides)
    parsed = parse_config(config, "tiny config")
    with torch.device("meta"):
        model = KimiForCausalLM(parsed)
    model.to_empty(device="cpu")
    random_weights(model, seed)
    model.cast(dtype)
    return save_checkpoint(path, config, checkpoint_names(model),
                           mxfp4_experts=parsed.text.expert_quantization == "mxfp4", max_shard_bytes=max_shard_bytes)


def object_chain(n: int) -> dict:
    """A JSON schema whose ``$defs`` chain ``n`` objects (d_i has one property referring to d_{i+1})."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def rule_chain(n: int) -> str:
    """A Lark grammar of ``n + 1`` rules, each naming the next."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'
