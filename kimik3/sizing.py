"""Bytes per GPU under tensor (t) and expert (e) parallelism (spec parallelism.md §6).

Each parameter is classified by how it scales: split across the TP ranks (heads, columns or rows,
vocab), split across the EP ranks (routed experts; across TP ranks when e = 1), or replicated
(latent MoE projections, router, MLA down-projections, KDA f_a / o_norm, norms, AttnRes vectors).
Stored bytes follow the release dtypes (MXFP4 experts, F32 conv/A_log/dt_bias/o_norm/router bias).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kimik3.config import ModelConfig, load_config
from kimik3.inspect import SINGLE_GPUS, meta_model, stored_bytes
from kimik3.model.batch import HybridCache

H200_BYTES = SINGLE_GPUS["H200"]        # 140.4 GiB per GPU, as nvidia-smi reports
MEMORY_FRACTION = 0.92                  # u: share of GPU memory the engine may take
OVERHEAD_BYTES = 6 << 30                # O: CUDA context, NCCL buffers, activations, graphs (assumed)

_REPLICATED = re.compile(
    r"routed_expert_(down_proj|up_proj|norm)|\.gate\.(weight|e_score_correction_bias)$|"
    r"self_attn\.(q_a_proj|kv_a_proj_with_mqa|q_a_layernorm|kv_a_layernorm|f_a_proj|o_norm)\.|"
    r"layernorm\.weight$|_res_(norm|proj)\.|^model\.norm\.|^vision\.")


@dataclass(frozen=True)
class Sizing:
    tp: int
    ep: int
    weights_sharded: int      # bytes split over the TP ranks
    weights_experts: int      # routed experts, split over e (or t)
    weights_replicated: int
    kv_bytes_per_token: int   # MLA latent, per GPU (TP replicates it)
    state_bytes_per_seq: int  # KDA conv + recurrent state, per GPU

    @property
    def weights_per_gpu(self) -> float:
        return (self.weights_sharded / self.tp + self.weights_experts / (self.ep if self.ep > 1 else self.tp)
                + self.weights_replicated)

    @property
    def cache_budget(self) -> float:
        """B = u * GPU memory - weights - overhead (negative: does not fit)."""
        return MEMORY_FRACTION * H200_BYTES - self.weights_per_gpu - OVERHEAD_BYTES

    @property
    def fits(self) -> bool:
        return self.cache_budget > 0

    def sequences(self, context: int) -> int:
        per_seq = context * self.kv_bytes_per_token + self.state_bytes_per_seq
        return max(0, int(self.cache_budget // per_seq))


def check_degrees(config: ModelConfig, tp: int, ep: int) -> None:
    t = config.text
    heads = {"KDA heads": t.kda.num_heads, "MLA heads": t.num_attention_heads}
    for what, n in heads.items():
        if n % tp:
            raise ValueError(f"--tensor-parallel-size {tp} must divide the {what} ({n})")
    if t.num_experts and ep > 1 and t.num_experts % ep:
        raise ValueError(f"--expert-parallel-size {ep} must divide num_experts ({t.num_experts})")
    if ep > 1 and ep % tp and tp % ep:
        raise ValueError(f"expert parallel size {ep} and tensor parallel size {tp} must nest (one divides the other)")


def compute_sizing(config: ModelConfig, tp: int, ep: int, dtype: torch.dtype = torch.bfloat16) -> Sizing:
    check_degrees(config, tp, ep)
    mxfp4 = config.text.expert_quantization == "mxfp4"
    sharded = experts = replicated = 0
    for name, p in meta_model(config).checkpoint_weights():
        _, nbytes = stored_bytes(name, p.numel(), mxfp4)
        if ".experts." in name:
            experts += nbytes
        elif _REPLICATED.search(name):
            replicated += nbytes
        else:
            sharded += nbytes
    t = config.text
    return Sizing(tp, ep, sharded, experts, replicated,
                  kv_bytes_per_token=HybridCache.bytes_per_block(t, 1, dtype),
                  state_bytes_per_seq=HybridCache.bytes_per_slot(t, dtype) // tp)


def format_sizing(path: str | Path, tp: int, ep: int) -> str:
    s = compute_sizing(load_config(path), tp, ep)
    gib = 1 << 30
    layout = f"TP{tp}" + (f"/EP{ep}" if ep > 1 else "")
    lines = [f"layout {layout} on H200 ({H200_BYTES / gib:.1f} GiB each, {tp * max(1, ep // tp)} GPUs):",
             f"  weights per GPU: {s.weights_per_gpu / gib:.1f} GiB (experts {s.weights_experts / (ep if ep > 1 else tp) / gib:.1f}, "
             f"TP-split {s.weights_sharded / tp / gib:.1f}, replicated {s.weights_replicated / gib:.1f})",
             f"  cache per GPU: MLA latent {s.kv_bytes_per_token:,} B/token, KDA state {s.state_bytes_per_seq / (1 << 20):.1f} MiB/sequence"]
    if s.fits:
        lines.append(f"  fits: yes; cache budget {s.cache_budget / gib:.1f} GiB (u = {MEMORY_FRACTION}, "
                     f"{OVERHEAD_BYTES / gib:.0f} GiB overhead) -> sequences at 32K / 128K / 1M tokens: "
                     f"{s.sequences(32768)} / {s.sequences(131072)} / {s.sequences(1 << 20)}")
    else:
        lines.append(f"  fits: no; {-s.cache_budget / gib:.1f} GiB short per GPU before any cache")
    return "\n".join(lines)
