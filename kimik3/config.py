"""Model configuration: parse a released Kimi-K3 or Kimi-Linear ``config.json``.

Kimi-K3 ships a top-level ``kimi_k3`` config holding ``text_config`` (a ``kimi_linear``
config) and ``vision_config``; Kimi-Linear ships a bare ``kimi_linear`` config. Every branch
of the model is chosen from these fields, never from the model name (spec README §7).

Load-bearing keys (those whose absence would silently change the computed function) are
required: a missing or ill-typed one raises ``ConfigError`` naming the key and the file.
Hugging Face's generic ``PretrainedConfig`` keys are ignored; other unknown keys are logged.

The numeric switches of spec README §4 live in ``Numerics``: the defaults reproduce
Moonshot's official code, the alternatives reproduce vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config file is missing a load-bearing key, or a key has the wrong type/value."""


# Keys every Hugging Face PretrainedConfig serialises; they carry no model semantics here.
_HF_GENERIC_KEYS = frozenset(
    """
    _name_or_path add_cross_attention architectures auto_map bad_words_ids begin_suppress_tokens
    chunk_size_feed_forward cross_attention_hidden_size decoder_start_token_id diversity_penalty
    do_sample dtype torch_dtype early_stopping encoder_no_repeat_ngram_size
    exponential_decay_length_penalty finetuning_task forced_bos_token_id forced_eos_token_id
    id2label label2id is_decoder is_encoder_decoder length_penalty max_length min_length
    no_repeat_ngram_size num_beam_groups num_beams num_return_sequences output_attentions
    output_hidden_states output_scores prefix problem_type pruned_heads remove_invalid_values
    repetition_penalty return_dict return_dict_in_generate sep_token_id suppress_tokens
    task_specific_params temperature tf_legacy_loss tie_encoder_decoder tokenizer_class top_k
    top_p torchscript transformers_version typical_p use_bfloat16 model_type
    initializer_range use_cache ignore_index _attn_implementation
    """.split()
)

# Keys the text model knows but does not need for the forward pass (documented, not used).
_TEXT_INFORMATIONAL_KEYS = frozenset(
    """
    num_key_value_heads head_dim rope_theta rope_scaling rope_parameters
    model_max_length topk_method use_grouped_topk quantization_config pad_token_id bos_token_id
    eos_token_id num_nextn_predict_layers
    """.split()
)


class _Reader:
    """Typed access to one JSON object, with errors that name the key and the file."""

    def __init__(self, data: dict[str, Any], source: str, where: str = ""):
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: {where or 'config'} must be a JSON object, got {type(data).__name__}")
        self.data = data
        self.source = source
        self.where = where
        self.used: set[str] = set()

    def _name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def _fail(self, key: str, msg: str) -> ConfigError:
        return ConfigError(f"{self.source}: key '{self._name(key)}' {msg}")

    def has(self, key: str) -> bool:
        return key in self.data

    def get(self, key: str, kind: type | tuple, *, required: bool = True, default: Any = None,
            nullable: bool = False) -> Any:
        self.used.add(key)
        if key not in self.data:
            if required:
                raise self._fail(key, "is required but missing")
            return default
        value = self.data[key]
        if value is None:
            if nullable or not required:
                return None if nullable else default
            raise self._fail(key, "must not be null")
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if bool not in kinds and isinstance(value, bool):
            raise self._fail(key, f"must be {_kind_name(kinds)}, got bool {value!r}")
        if not isinstance(value, kinds):
            raise self._fail(key, f"must be {_kind_name(kinds)}, got {type(value).__name__} {value!r}")
        return value

    def int_list(self, key: str) -> tuple[int, ...]:
        value = self.get(key, list)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise self._fail(key, f"must be a list of integers, got {value!r}")
        return tuple(value)

    def child(self, key: str, *, required: bool = True) -> _Reader | None:
        value = self.get(key, dict, required=required, nullable=not required)
        if value is None:
            return None
        return _Reader(value, self.source, self._name(key))

    def warn_unknown(self, known: frozenset[str] = frozenset()) -> None:
        for key in sorted(set(self.data) - self.used - _HF_GENERIC_KEYS - known):
            logger.info("%s: ignoring unknown config key '%s'", self.source, self._name(key))


def _kind_name(kinds: tuple) -> str:
    return " or ".join({int: "an integer", float: "a number", str: "a string", bool: "a boolean",
                        list: "a list", dict: "an object"}.get(k, k.__name__) for k in kinds)


@dataclass(frozen=True)
class Numerics:
    """Named numeric switches (spec README §4). Defaults = Moonshot's official code."""

    mla_latent_norm_eps: float = 1e-6      # D1: q_a/kv_a layernorm eps; vLLM uses 1e-5
    attn_res_fused_norm: bool = False      # D2: vLLM's fp32 fused AttnRes + RMSNorm
    f32_param_policy: str = "checkpoint"   # D4: "hf_remote" rounds conv/o_norm/router bias to bf16
    router_renorm_eps: float = 1e-20       # D5: vLLM uses 0
    moe_combine_fp32: bool = True          # D6: fp32 accumulation of expert outputs

    def __post_init__(self) -> None:
        if self.f32_param_policy not in ("checkpoint", "hf_remote"):
            raise ConfigError(
                f"f32_param_policy must be 'checkpoint' or 'hf_remote', got {self.f32_param_policy!r}")


@dataclass(frozen=True)
class KDAConfig:
    num_heads: int
    head_dim: int
    conv_size: int
    kda_layers: tuple[int, ...]            # 1-based, as in config.json
    use_full_rank_gate: bool               # K3: g_proj [P, D]; Kimi-Linear: g_a_proj/g_b_proj
    gate_lower_bound: float | None         # K3: -5 (bounded sigmoid gate); None: softplus gate


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    hidden_act: str                        # "situ" or "silu"
    situ_beta: float
    situ_linear_beta: float | None
    intermediate_size: int                 # dense MLP width (layers < first_k_dense_replace)
    # MLA
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_output_gate: bool
    # KDA
    kda: KDAConfig
    # MoE (num_experts None -> every layer uses the dense MLP)
    num_experts: int | None
    num_experts_per_token: int
    moe_intermediate_size: int
    num_shared_experts: int
    moe_renormalize: bool
    moe_router_activation_func: str
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int
    num_expert_group: int
    topk_group: int
    routed_expert_hidden_size: int | None  # latent MoE width (K3: 3584), None: experts on D
    latent_moe_use_norm: bool
    # Attention residuals (None: ordinary pre-norm residual stream)
    attn_res_block_size: int | None
    # Checkpoint storage of routed experts: "mxfp4" (compressed-tensors) or None (dense bf16)
    expert_quantization: str | None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    max_position_embeddings: int | None = None   # the longest sequence the model was built for
    num_nextn_predict_layers: int = 0      # MTP layers stored after the model's (a draft: loader/drafts.py)
    numerics: Numerics = field(default_factory=Numerics)
    # Ranks the MLA latent cache's token positions are striped over (decode context parallelism): set by the
    # model in the config that sizes one rank's cache (``KimiForCausalLM.cache_text_config``), never read
    # from config.json. Each rank then holds 1/stripes of every cache block.
    mla_cache_stripes: int = 1
    # Checkpoint storage of the weights: "fp8-block" (E4M3 with 128 x 128 ``weight_scale_inv``; kimik3.loader.fp8)
    weight_quantization: str | None = None
    # The layer ids whose state one rank caches (pipeline parallelism: its stage's); None: all. Set by the
    # model like ``mla_cache_stripes``.
    cache_layers: tuple[int, ...] | None = None

    # ---- derived schedule -------------------------------------------------------------
    def is_kda_layer(self, i: int) -> bool:
        """0-based layer i uses KDA iff i+1 is listed in the 1-based ``kda_layers``."""
        return (i + 1) in self.kda.kda_layers

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts is not None and i >= self.first_k_dense_replace
                and i % self.moe_layer_freq == 0)

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple("kda" if self.is_kda_layer(i) else "mla" for i in range(self.num_hidden_layers))

    @property
    def kda_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_kda_layer(i))

    @property
    def mla_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_kda_layer(i))

    def cached_layer_ids(self, kind: str) -> tuple[int, ...]:
        """The "kda" or "mla" layers whose state this config's cache holds (``cache_layers``)."""
        ids = self.kda_layer_ids if kind == "kda" else self.mla_layer_ids
        return ids if self.cache_layers is None else tuple(i for i in ids if i in self.cache_layers)

    @property
    def num_attn_res_blocks(self) -> int:
        """Completed-block slots of the AttnRes state (embedding block included)."""
        assert self.attn_res_block_size is not None
        return math.ceil(self.num_hidden_layers / self.attn_res_block_size)

    @property
    def mla_cache_dim(self) -> int:
        """Values per token per MLA layer in the latent cache: [c_kv | k_pe]."""
        return self.kv_lora_rank + self.qk_rope_head_dim



@dataclass(frozen=True)
class VisionConfig:
    patch_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    qkv_hidden_size: int
    intermediate_size: int
    init_pos_emb_height: int
    init_pos_emb_width: int
    init_pos_emb_time: int
    merge_kernel_size: tuple[int, int]
    pos_emb_interpolation_mode: str
    projector_ln_eps: float
    text_hidden_size: int
    vit_norm_eps: float = 1.1920929e-07    # D9/D24: torch's float32 default, pinned


@dataclass(frozen=True)
class ModelConfig:
    """A whole checkpoint's config: the text model plus, for K3, the vision tower."""

    architecture: str                      # "kimi_k3" or "kimi_linear"
    text: TextConfig
    vision: VisionConfig | None = None
    media_placeholder_token_id: int | None = None
    source: str = ""

    @property
    def weight_prefix(self) -> str:
        """Prefix of the text model's tensors in the checkpoint."""
        return "language_model." if self.architecture == "kimi_k3" else ""


# ---------------------------------------------------------------------------------------

def _parse_kda(r: _Reader) -> KDAConfig:
    kda_layers = r.int_list("kda_layers")
    r.int_list("full_attn_layers")  # validated to be present, never used to build layers
    lower = r.get("gate_lower_bound", float, required=False, nullable=True)
    if lower is not None and not (-5.0 <= lower < 0.0):
        raise r._fail("gate_lower_bound", f"must lie in [-5, 0), got {lower}")
    cfg = KDAConfig(
        num_heads=r.get("num_heads", int),
        head_dim=r.get("head_dim", int),
        conv_size=r.get("short_conv_kernel_size", int),
        kda_layers=kda_layers,
        use_full_rank_gate=r.get("use_full_rank_gate", bool, required=False, default=False),
        gate_lower_bound=lower,
    )
    r.warn_unknown()
    return cfg


def _parse_quantization(qc: dict | None, source: str) -> str | None:
    if qc is None:
        return None
    fmt = qc.get("format")
    if qc.get("quant_method") == "fp8":               # DeepSeek / Kimi block FP8: E4M3 weights, weight_scale_inv
        if qc.get("weight_block_size") != [128, 128] or qc.get("fmt", "e4m3") != "e4m3" or \
                qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ConfigError(
                f"{source}: FP8 checkpoints are read with weight_block_size [128, 128], fmt e4m3 and dynamic "
                f"activations; this one has weight_block_size {qc.get('weight_block_size')}, fmt {qc.get('fmt')!r}, "
                f"activation_scheme {qc.get('activation_scheme')!r}")
        return "fp8-block"
    if qc.get("quant_method") != "compressed-tensors" or fmt != "mxfp4-pack-quantized":
        raise ConfigError(
            f"{source}: unsupported quantization_config (quant_method={qc.get('quant_method')!r}, "
            f"format={fmt!r}); kimik3 reads compressed-tensors 'mxfp4-pack-quantized' or unquantized weights")
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if w.get("num_bits") != 4 or w.get("group_size") != 32 or w.get("type") != "float":
            raise ConfigError(f"{source}: quantization group '{name}' is not MXFP4 (4-bit float, group 32): {w}")
    return "mxfp4"


def check_untied(r: _Reader) -> None:
    """Both models keep a separate ``lm_head``: a tied checkpoint is refused, not loaded wrong."""
    if r.get("tie_word_embeddings", bool, required=False, default=False):
        raise r._fail("tie_word_embeddings", "is true, but kimik3 implements Kimi-K3 and Kimi-Linear, whose "
                                             "lm_head is its own weight (untied); this is not such a checkpoint")


def parse_text_config(data: dict, source: str, *, where: str = "",
                      quantization: dict | None = None) -> TextConfig:
    r = _Reader(data, source, where)
    if r.get("mla_use_nope", bool, required=False, default=True) is not True:
        raise r._fail("mla_use_nope", "must be true: kimik3 implements the NoPE MLA of Kimi models only")
    check_untied(r)
    lin = r.child("linear_attn_config")
    kda = _parse_kda(lin)
    n_layers = r.get("num_hidden_layers", int)
    # the MTP layers (indices n_layers .. n_layers + nextn - 1) are KDA blocks where listed (``model/mtp.py``)
    n_mtp = r.get("num_nextn_predict_layers", int, required=False, nullable=True) or 0
    bad = [i for i in kda.kda_layers if not 1 <= i <= n_layers + n_mtp]
    if bad:
        raise lin._fail("kda_layers", f"holds layers outside 1..{n_layers + n_mtp} (num_hidden_layers "
                        f"{n_layers} + num_nextn_predict_layers {n_mtp}): {bad}")

    hidden_act = r.get("hidden_act", str)
    if hidden_act not in ("situ", "silu"):
        raise r._fail("hidden_act", f"must be 'situ' or 'silu', got {hidden_act!r}")
    situ_beta, situ_lin = 1.0, None
    if hidden_act == "situ":
        situ_beta = r.get("activation_situ_beta", float, nullable=True)
        situ_beta = 1.0 if situ_beta is None else situ_beta
        situ_lin = r.get("activation_situ_linear_beta", float, nullable=True)

    num_experts = r.get("num_experts", int, nullable=True)
    moe_keys: dict[str, Any] = {}
    if num_experts is not None:
        act = r.get("moe_router_activation_func", str)
        if act not in ("sigmoid", "softmax"):
            raise r._fail("moe_router_activation_func", f"must be 'sigmoid' or 'softmax', got {act!r}")
        moe_keys = dict(
            num_experts_per_token=r.get("num_experts_per_token", int),
            moe_intermediate_size=r.get("moe_intermediate_size", int),
            num_shared_experts=r.get("num_shared_experts", int),
            moe_renormalize=r.get("moe_renormalize", bool),
            moe_router_activation_func=act,
            routed_scaling_factor=r.get("routed_scaling_factor", float),
            first_k_dense_replace=r.get("first_k_dense_replace", int),
            moe_layer_freq=r.get("moe_layer_freq", int, required=False, default=1),
            num_expert_group=r.get("num_expert_group", int, required=False, default=1),
            topk_group=r.get("topk_group", int, required=False, default=1),
            routed_expert_hidden_size=r.get("routed_expert_hidden_size", int, required=False, nullable=True),
            latent_moe_use_norm=r.get("latent_moe_use_norm", bool, required=False, default=False),
        )
        if moe_keys["num_expert_group"] > 1 and num_experts % moe_keys["num_expert_group"]:
            raise r._fail("num_expert_group", f"must divide num_experts={num_experts}")
        if not 1 <= moe_keys["num_experts_per_token"] <= num_experts:
            raise r._fail("num_experts_per_token", f"must lie in 1..{num_experts}")
        if moe_keys["latent_moe_use_norm"] and moe_keys["routed_expert_hidden_size"] is None:
            raise r._fail("latent_moe_use_norm", "is true but routed_expert_hidden_size is null: the latent norm "
                          "acts on the latent sum, and without a latent width there is none (spec §3.5)")
    else:
        moe_keys = dict(num_experts_per_token=0, moe_intermediate_size=0, num_shared_experts=0,
                        moe_renormalize=True, moe_router_activation_func="sigmoid",
                        routed_scaling_factor=1.0, first_k_dense_replace=n_layers, moe_layer_freq=1,
                        num_expert_group=1, topk_group=1, routed_expert_hidden_size=None,
                        latent_moe_use_norm=False)
    needs_dense = num_experts is None or moe_keys["first_k_dense_replace"] > 0
    attn_res = r.get("attn_res_block_size", int, required=False, nullable=True)
    if attn_res is not None and attn_res <= 0:
        raise r._fail("attn_res_block_size", f"must be positive, got {attn_res}")
    qc = r.get("quantization_config", dict, required=False, nullable=True) or quantization
    storage = _parse_quantization(qc, source)          # "mxfp4" experts, "fp8-block" weights, or None

    cfg = TextConfig(
        vocab_size=r.get("vocab_size", int),
        hidden_size=r.get("hidden_size", int),
        num_hidden_layers=n_layers,
        rms_norm_eps=r.get("rms_norm_eps", float),
        hidden_act=hidden_act,
        situ_beta=situ_beta,
        situ_linear_beta=situ_lin,
        intermediate_size=r.get("intermediate_size", int) if needs_dense else 0,
        num_attention_heads=r.get("num_attention_heads", int),
        q_lora_rank=r.get("q_lora_rank", int, required=False, nullable=True),
        kv_lora_rank=r.get("kv_lora_rank", int),
        qk_nope_head_dim=r.get("qk_nope_head_dim", int),
        qk_rope_head_dim=r.get("qk_rope_head_dim", int),
        v_head_dim=r.get("v_head_dim", int),
        mla_use_output_gate=r.get("mla_use_output_gate", bool, required=False, default=False),
        kda=kda,
        num_experts=num_experts,
        attn_res_block_size=attn_res,
        expert_quantization=storage if storage == "mxfp4" else None,
        weight_quantization=storage if storage == "fp8-block" else None,
        bos_token_id=r.get("bos_token_id", int, required=False, nullable=True),
        eos_token_id=r.get("eos_token_id", int, required=False, nullable=True),
        pad_token_id=r.get("pad_token_id", int, required=False, nullable=True),
        max_position_embeddings=r.get("max_position_embeddings", int, required=False, nullable=True),
        num_nextn_predict_layers=r.get("num_nextn_predict_layers", int, required=False, nullable=True) or 0,
        **moe_keys,
    )
    r.warn_unknown(_TEXT_INFORMATIONAL_KEYS)
    return cfg


def parse_vision_config(data: dict, source: str, text_hidden_size: int) -> VisionConfig:
    r = _Reader(data, source, "vision_config")
    checks = {"merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2", "norm_type": "rmsnorm",
              "mlp_type": "mlp2", "pos_emb_type": "divided_fixed", "activation_func": "gelu_pytorch_tanh"}
    for key, expected in checks.items():
        value = r.get(key, str, required=False, default=expected)
        if value != expected:
            raise r._fail(key, f"must be {expected!r} (the only variant kimik3 implements), got {value!r}")
    for key in ("attn_bias", "linear_bias", "patch_embed_proj_bias"):
        if r.get(key, bool, required=False, default=False):
            raise r._fail(key, "must be false: the K3 tower has no biases")
    mode = r.get("pos_emb_interpolation_mode", str, required=False, default="bilinear")
    if mode not in ("bilinear", "bicubic"):
        raise r._fail("pos_emb_interpolation_mode", f"must be 'bilinear' or 'bicubic', got {mode!r}")
    merge = r.int_list("merge_kernel_size") if r.has("merge_kernel_size") else (2, 2)
    if len(merge) != 2:
        raise r._fail("merge_kernel_size", f"must have two entries, got {merge}")
    cfg = VisionConfig(
        patch_size=r.get("patch_size", int),
        hidden_size=r.get("vt_hidden_size", int),
        num_hidden_layers=r.get("vt_num_hidden_layers", int),
        num_attention_heads=r.get("vt_num_attention_heads", int),
        qkv_hidden_size=r.get("qkv_hidden_size", int),
        intermediate_size=r.get("vt_intermediate_size", int),
        init_pos_emb_height=r.get("init_pos_emb_height", int),
        init_pos_emb_width=r.get("init_pos_emb_width", int),
        init_pos_emb_time=r.get("init_pos_emb_time", int),
        merge_kernel_size=(merge[0], merge[1]),
        pos_emb_interpolation_mode=mode,
        projector_ln_eps=r.get("projector_ln_eps", float),
        text_hidden_size=text_hidden_size,  # forced to the text width, as the official class does
    )
    r.get("text_hidden_size", int, required=False)
    r.get("mm_hidden_size", int, required=False, nullable=True)
    r.get("projector_hidden_act", str, required=False)
    if cfg.qkv_hidden_size % cfg.num_attention_heads:
        raise r._fail("qkv_hidden_size", f"must be divisible by vt_num_attention_heads={cfg.num_attention_heads}")
    r.warn_unknown(frozenset({"video_attn_type"}))
    return cfg


def parse_config(data: dict, source: str = "config.json", **switches: Any) -> ModelConfig:
    """Parse a config dict (K3 top level or bare Kimi-Linear). ``switches`` set ``Numerics``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: config must be a JSON object")
    model_type = data.get("model_type")
    numerics = Numerics(**switches)
    if model_type == "kimi_k3":
        r = _Reader(data, source)
        tc = r.child("text_config")
        text = parse_text_config(tc.data, source, where="text_config",
                                 quantization=data.get("quantization_config"))
        r.get("quantization_config", dict, required=False, nullable=True)
        vc = r.get("vision_config", dict, required=False, nullable=True)
        vision = parse_vision_config(vc, source, text.hidden_size) if vc else None
        top = ModelConfig(
            architecture="kimi_k3",
            text=dataclasses.replace(
                text, numerics=numerics,
                bos_token_id=r.get("bos_token_id", int, required=False, default=text.bos_token_id),
                eos_token_id=r.get("eos_token_id", int, required=False, default=text.eos_token_id),
                pad_token_id=r.get("pad_token_id", int, required=False, default=text.pad_token_id)),
            vision=vision,
            media_placeholder_token_id=r.get("media_placeholder_token_id", int, required=vision is not None),
            source=source,
        )
        check_untied(r)
        # the display-only image placeholder text: kimik3.chat.k3.IMAGE_PLACEHOLDER renders it (a known key)
        r.get("image_placeholder", str, required=False)
        r.warn_unknown()
        return top
    if model_type == "kimi_linear":
        text = parse_text_config(data, source)
        return ModelConfig(architecture="kimi_linear", text=dataclasses.replace(text, numerics=numerics),
                           source=source)
    raise ConfigError(f"{source}: key 'model_type' must be 'kimi_k3' or 'kimi_linear', got {model_type!r}")


def load_config(path: str | Path, **switches: Any) -> ModelConfig:
    """Read ``config.json`` from a checkpoint directory (or the file itself)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"no config.json at {file}")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    return parse_config(data, str(file), **switches)
