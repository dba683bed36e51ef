"""Architecture summary of a checkpoint (``kimik3 inspect``), without loading any weights.

Parameter counts come from the model built on the meta device; stored bytes from the
safetensors headers when the checkpoint has them, else predicted from the release dtypes
(MXFP4 routed experts, F32 conv/A_log/dt_bias/o_norm/router bias, BF16 elsewhere).
"""

from __future__ import annotations

import json
import re
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kimik3.config import ModelConfig, load_config
from kimik3.model.batch import HybridCache

_COMPONENTS = [
    ("vision tower + projector", re.compile(r"^vision\.")),
    ("routed experts", re.compile(r"\.experts\.")),
    ("latent MoE projections", re.compile(r"routed_expert_(down|up)_proj|routed_expert_norm")),
    ("shared experts", re.compile(r"shared_experts\.")),
    ("router", re.compile(r"\.gate\.(weight|e_score_correction_bias)")),
    ("dense MLP", re.compile(r"\.mlp\.")),
    ("KDA", re.compile(r"^model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|g_proj|g_a_proj|g_b_proj|f_a_proj|"
                       r"f_b_proj|b_proj|[qkv]_conv1d|A_log|dt_bias|o_norm|o_proj)")),
    ("MLA", re.compile(r"^model\.layers\.\d+\.self_attn\.")),
    ("attention residuals", re.compile(r"_res_(norm|proj)")),
    ("embedding", re.compile(r"embed_tokens")),
    ("LM head", re.compile(r"^lm_head")),
    ("norms", re.compile(r"norm\.weight$")),
]
_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "U8": 1, "I8": 1, "I32": 4, "I64": 8}
_F32_STORED = re.compile(r"([qkv]_conv1d\.weight|A_log|dt_bias|o_norm\.weight|e_score_correction_bias)$")


@dataclass
class Summary:
    config: ModelConfig
    params: Counter = field(default_factory=Counter)          # component -> parameter count
    stored_bytes: Counter = field(default_factory=Counter)    # dtype -> bytes
    bytes_source: str = "predicted from the release dtypes"

    @property
    def total_params(self) -> int:
        return sum(self.params.values())


def component(name: str) -> str:
    for label, pattern in _COMPONENTS:
        if pattern.search(name):
            return label
    return "other"


def meta_model(config: ModelConfig):
    """The model built on the meta device: exact parameter shapes, no memory."""
    from kimik3.model.kimi_k3 import KimiForCausalLM

    with torch.device("meta"):
        return KimiForCausalLM(config)


def stored_bytes(name: str, numel: int, mxfp4_experts: bool) -> tuple[str, int]:
    """(dtype label, bytes) of a parameter as the release stores it."""
    if ".experts." in name:
        return ("U8 (MXFP4)", numel // 2 + numel // 32) if mxfp4_experts else ("BF16", 2 * numel)
    return ("F32", 4 * numel) if _F32_STORED.search(name) else ("BF16", 2 * numel)


def summarize(path: str | Path) -> Summary:
    """``path``: a checkpoint directory, or a bare ``config.json`` (bytes are then predicted)."""
    path = Path(path)
    config = load_config(path)
    summary = Summary(config)
    mxfp4 = config.text.expert_quantization == "mxfp4"
    for name, p in meta_model(config).checkpoint_weights():
        summary.params[component(name)] += p.numel()
        label, nbytes = stored_bytes(name, p.numel(), mxfp4)
        summary.stored_bytes[label] += nbytes
    headers = _header_bytes(path) if path.is_dir() else None
    if headers:
        summary.stored_bytes, summary.bytes_source = headers, "read from the safetensors headers"
    return summary


def _header_bytes(path: Path) -> Counter | None:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    out: Counter = Counter()
    for f in files:
        with f.open("rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            nbytes = meta["data_offsets"][1] - meta["data_offsets"][0]
            label = "U8 (MXFP4)" if meta["dtype"] == "U8" and ".weight_" in name else meta["dtype"]
            out[label] += nbytes
    return out


def format_summary(s: Summary, dtype: torch.dtype = torch.bfloat16, block_size: int = 16) -> str:
    c, t = s.config, s.config.text
    gib = 1 << 30
    lines = [f"architecture: {c.architecture} ({c.source})"]
    kinds = Counter(t.layer_types)
    moe = sum(t.is_moe_layer(i) for i in range(t.num_hidden_layers))
    lines.append(f"layers: {t.num_hidden_layers} = {kinds['kda']} KDA + {kinds['mla']} MLA; "
                 f"{t.num_hidden_layers - moe} dense MLP + {moe} MoE; MLA at {list(t.mla_layer_ids)}")
    lines.append(f"hidden {t.hidden_size}, vocab {t.vocab_size}, KDA {t.kda.num_heads}x{t.kda.head_dim}, "
                 f"MLA {t.num_attention_heads} heads (kv_lora {t.kv_lora_rank}, rope {t.qk_rope_head_dim})")
    if t.num_experts:
        lines.append(f"MoE: {t.num_experts} experts, top-{t.num_experts_per_token}, expert width "
                     f"{t.moe_intermediate_size}, latent {t.routed_expert_hidden_size or '-'}, "
                     f"{t.num_shared_experts} shared, activation {t.hidden_act}")
    lines.append(f"attention residuals: {'block size ' + str(t.attn_res_block_size) if t.attn_res_block_size else 'off'}; "
                 f"vision tower: {'yes' if c.vision else 'no'}")
    lines.append(f"parameters: {s.total_params:,} ({s.total_params / 1e9:.2f} B)")
    for label, n in s.params.most_common():
        lines.append(f"  {label:<26} {n:>20,}  {100 * n / s.total_params:5.1f}%")
    total = sum(s.stored_bytes.values())
    lines.append(f"stored bytes ({s.bytes_source}): {total / gib:.3f} GiB")
    for label, n in s.stored_bytes.most_common():
        lines.append(f"  {label:<26} {n / gib:>14.3f} GiB  {100 * n / total:5.1f}%")
    mx = s.stored_bytes.get("U8 (MXFP4)", 0)
    lines.append(f"MXFP4 share of stored bytes: {100 * mx / total:.1f}%")
    per_tok = HybridCache.bytes_per_block(t, 1, dtype)
    per_seq = HybridCache.bytes_per_slot(t, dtype)
    lines.append(f"cache ({str(dtype).replace('torch.', '')}): MLA latent {per_tok:,} B/token "
                 f"({len(t.mla_layer_ids)} layers x {t.mla_cache_dim}); KDA state {per_seq / (1 << 20):.1f} MiB/sequence "
                 f"({len(t.kda_layer_ids)} layers, fp32 recurrent + conv window)")
    for n in (4096, 131072, 1048576):
        lines.append(f"  one sequence of {n:>7} tokens: {(per_seq + per_tok * n) / gib:8.3f} GiB")
    lines.extend(single_gpu_fit(total, per_tok, per_seq))
    return "\n".join(lines)


# What one GPU holds, as nvidia-smi reports it (MiB), and the engine's default cache rule
# (kimik3.engine.core.cache_budget.gpu_cache_budget: gpu_memory_utilization of the whole GPU, minus the weights).
SINGLE_GPUS = {"H200": 143771 << 20, "H100": 81559 << 20}
CUDA_CONTEXT_BYTES = 1 << 30        # CUDA context, kernels and workspaces: about 1 GiB, an estimate


def single_gpu_fit(weight_bytes: int, per_token: int, per_sequence: int) -> list[str]:
    """Whether the weights fit one GPU, and the default cache there in tokens and long sequences."""
    from kimik3.engine.args import EngineArgs

    utilization = EngineArgs.gpu_memory_utilization
    gib = 1 << 30
    lines = []
    for name, memory in SINGLE_GPUS.items():
        left = memory - weight_bytes - CUDA_CONTEXT_BYTES
        cache = int(utilization * memory) - weight_bytes
        if left <= 0 or cache <= 0:
            lines.append(f"one {name} ({memory / gib:.1f} GiB): does not fit (weights {weight_bytes / gib:.1f} GiB)")
            continue
        fits = {n: cache // (per_sequence + per_token * n) for n in (4096, 131072, 1048576)}
        lines.append(f"one {name} ({memory / gib:.1f} GiB): fits, weights {weight_bytes / gib:.1f} GiB; default cache "
                     f"{cache / gib:.1f} GiB (gpu_memory_utilization {utilization} of the GPU, less the weights) = "
                     f"{cache // per_token:,} latent tokens; memory for "
                     + ", ".join(f"{k} sequences of {n}" for n, k in fits.items()) + " tokens at once")
    return lines
