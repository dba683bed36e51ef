"""The cache's byte budget: given (``cache_memory_bytes``) or derived from the device, then split
into the two pools by ``memory.plan_memory`` and checked to hold one ``max_model_len`` sequence."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kimik3.engine.config import EngineConfig
from kimik3.engine.core.memory import MemoryPlan, max_blocks_per_seq, plan_memory
from kimik3.engine.core.scheduler import PROMPT_LOGPROB_ROWS
from kimik3.model.batch import HybridCache, latent_cache_dtype

logger = logging.getLogger(__name__)


def default_checkpoint_interval(text_config, block_size: int, dtype: torch.dtype,
                                latent_dtype: torch.dtype | None = None) -> int:
    """Blocks per KDA checkpoint such that checkpoints take about as much memory as the latents they cover."""
    per_block = max(HybridCache.bytes_per_block(text_config, block_size, dtype, latent_dtype), 1)
    return max(1, round(HybridCache.bytes_per_slot(text_config, dtype) / per_block))


def plan_cache(config: EngineConfig, text_config, dtype: torch.dtype, device: torch.device) -> MemoryPlan:
    """The memory plan of an engine whose cache is sized by ``text_config`` (this rank's share under
    tensor parallelism); ValueError when the budget cannot hold one max_model_len sequence. The latent rows
    are counted in ``config.kv_cache_dtype`` (FP8: one byte a value plus a float32 scale a token)."""
    latent = latent_cache_dtype(config.kv_cache_dtype, dtype)
    interval = None
    if config.enable_prefix_caching:
        interval = config.kda_checkpoint_interval or default_checkpoint_interval(text_config, config.block_size, dtype,
                                                                                 latent)
    per_seq = max_blocks_per_seq(config.max_model_len, config.block_size)
    budget = config.cache_memory_bytes
    if budget is None:   # enough for max_num_seqs full-length sequences and their checkpoints
        slot = HybridCache.bytes_per_slot(text_config, dtype)
        block = HybridCache.bytes_per_block(text_config, config.block_size, dtype, latent)
        n = config.max_num_seqs
        wanted = ((1 + n + n * config.num_speculative_tokens) * slot + (1 + n * per_seq) * block
                  + (n * per_seq // interval if interval else 0) * slot)
        workspace = step_workspace(text_config, config, dtype) if device.type == "cuda" else None
        if workspace is not None:
            logger.info("reserving %.2f GiB for a step's workspace (%s)", workspace.total / (1 << 30),
                        workspace.describe())
        budget = default_cache_bytes(device, wanted, config.gpu_memory_utilization,
                                     workspace.total if workspace is not None else 0)
    plan = plan_memory(text_config, budget, config.block_size, config.max_num_seqs, interval, dtype,
                       num_spec_slots=config.max_num_seqs * config.num_speculative_tokens, latent_dtype=latent)
    if per_seq > plan.num_usable_blocks:
        raise ValueError(
            f"max_model_len={config.max_model_len} needs {per_seq} cache blocks of {config.block_size} tokens, but "
            f"cache_memory_bytes={budget} holds {plan.num_usable_blocks} ({plan.describe()}); "
            f"raise cache_memory_bytes or lower max_model_len to {plan.max_cached_tokens}")
    logger.info("%s; %d sequences of max_model_len=%d tokens fit at once", plan.describe(),
                plan.sequences_of(config.max_model_len), config.max_model_len)
    return plan


def default_cache_bytes(device: torch.device, wanted_bytes: int, gpu_memory_utilization: float = 0.9,
                        workspace: int = 0) -> int:
    """The cache budget when none is given. On a GPU (vLLM's meaning of gpu_memory_utilization): the
    process may use ``utilization * total`` bytes; the cache gets that minus what the process already
    holds (the weights) and minus ``workspace``, the worst step's transient memory (``step_workspace``).
    On CPU: what the limits can use, at most 4 GiB."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return gpu_cache_budget(total, free, torch.cuda.memory_reserved(device), gpu_memory_utilization, workspace)
    return min(wanted_bytes, 4 << 30)


MLA_PREFILL_BLOCK = 16384       # kimik3.ops.mla.PREFILL_BLOCK: keys a prefill piece expands at once
GRAPH_RESERVE = 512 << 20       # CUDA graphs' private pools and the allocator's rounding


@dataclass(frozen=True)
class StepWorkspace:
    """The largest transient memory one engine step needs beside the weights and the cache, by part (bytes).

    An estimate from the shapes, for the worst step: a prefill chunk of ``max_num_batched_tokens`` tokens T at
    the end of a ``max_model_len`` context. Per layer (one layer's temporaries live at a time):
    - residual: the attention-residual block vectors [T, D] (model dtype) and the float32 stack a mix reads;
    - mla: q [T, H, d_qk], the running output and one piece's (float32 [T, H, d_v], merged), and one piece's keys and
      values expanded from the latents [MLA_PREFILL_BLOCK, H, d_nope + d_v] (the context is walked in pieces, so
      this does not grow with the context);
    - kda: the chunked recurrence's q, k, v, gate, beta and output in float32 [T, H_kda, d_kda];
    - mlp: routed tokens x top-k at the expert width, their gate/up/act rows, and the router's logits;
    - logits: float32 logits and log-softmax for every row a step may score: the samples (``max_num_seqs`` x
      (1 + speculative tokens)) and the prompt positions ``prompt_logprobs`` scores (at most
      ``scheduler.PROMPT_LOGPROB_ROWS`` a step);
    - graphs: ``GRAPH_RESERVE`` unless ``enforce_eager``.
    ``benchmarks/gpu/check_step_memory.py`` measures the true peak on a GPU against this."""

    parts: dict

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        return ", ".join(f"{k} {v / (1 << 30):.2f} GiB" for k, v in self.parts.items())


def step_workspace(text_config, config: EngineConfig, dtype: torch.dtype) -> StepWorkspace:
    """``StepWorkspace`` of an engine over ``text_config`` (this rank's share) under ``config``."""
    c, T = text_config, config.max_num_batched_tokens
    b, f32 = torch.empty((), dtype=dtype).element_size(), 4
    D, H = c.hidden_size, c.num_attention_heads
    d_qk, dv = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    blocks = -(-c.num_hidden_layers // c.attn_res_block_size) + 1 if c.attn_res_block_size else 1
    residual = T * D * (blocks * b + (blocks + 1) * f32 + 6 * b)
    piece = min(MLA_PREFILL_BLOCK, config.max_model_len)
    mla = (T * H * (2 * d_qk * b + 3 * dv * f32 + f32) + piece * H * (c.qk_nope_head_dim + dv) * b
           + piece * (c.kv_lora_rank + c.qk_rope_head_dim) * f32)
    kda = T * c.kda.num_heads * c.kda.head_dim * f32 * 8 if c.kda is not None and c.kda.kda_layers else 0
    width = c.routed_expert_hidden_size or D
    routed = T * c.num_experts_per_token * (2 * width * b + 3 * c.moe_intermediate_size * b) if c.num_experts else 0
    dense = T * 3 * max(c.intermediate_size, c.num_shared_experts * c.moe_intermediate_size) * b
    mlp = routed + dense + T * (c.num_experts or 0) * f32
    samples = config.max_num_seqs * (1 + config.num_speculative_tokens)
    logits = (samples + min(T, PROMPT_LOGPROB_ROWS)) * c.vocab_size * f32 * 2
    return StepWorkspace({"residual": residual, "mla": mla, "kda": kda, "mlp": mlp, "logits": logits,
                          "graphs": 0 if config.enforce_eager else GRAPH_RESERVE})


def gpu_cache_budget(total: int, free: int, held: int, utilization: float, workspace: int = 0) -> int:
    """``utilization * total - held - workspace`` (``held``: bytes this process's allocator holds now; ``workspace``:
    the worst step's transient memory), or ValueError when that is not positive or more than the GPU has free
    (other processes hold the rest)."""
    gib = 1 << 30
    budget = int(utilization * total) - held - workspace
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={utilization} allows {utilization * total / gib:.2f} GiB of the "
                         f"GPU's {total / gib:.2f} GiB, but the weights already take {held / gib:.2f} GiB and a step's "
                         f"workspace {workspace / gib:.2f} GiB; raise gpu_memory_utilization, lower "
                         f"max_num_batched_tokens, or use more GPUs (tensor_parallel_size)")
    if budget > free:
        raise ValueError(f"gpu_memory_utilization={utilization} asks for {budget / gib:.2f} GiB of cache but only "
                         f"{free / gib:.2f} GiB of the GPU is free (other processes hold "
                         f"{(total - free - held) / gib:.2f} GiB); lower gpu_memory_utilization to at most "
                         f"{(free + held) / total:.2f}")
    return budget
