"""The cache's byte budget: given (``cache_memory_bytes``) or derived from the device, then split
into the two pools by ``memory.plan_memory`` and checked to hold one ``max_model_len`` sequence."""

from __future__ import annotations

import logging

import torch

from kimik3.engine.config import EngineConfig
from kimik3.engine.core.memory import MemoryPlan, max_blocks_per_seq, plan_memory
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
        budget = default_cache_bytes(device, wanted, config.gpu_memory_utilization)
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


def default_cache_bytes(device: torch.device, wanted_bytes: int, gpu_memory_utilization: float = 0.9) -> int:
    """The cache budget when none is given. On a GPU (vLLM's meaning of gpu_memory_utilization): the
    process may use ``utilization * total`` bytes; the cache gets that minus what the process already
    holds (the weights); the rest of the GPU stays free for activations, CUDA graphs and other processes.
    On CPU: what the limits can use, at most 4 GiB."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return gpu_cache_budget(total, free, torch.cuda.memory_reserved(device), gpu_memory_utilization)
    return min(wanted_bytes, 4 << 30)


def gpu_cache_budget(total: int, free: int, held: int, utilization: float) -> int:
    """``utilization * total - held`` (``held``: bytes this process's allocator holds now), or ValueError
    when that is not positive or more than the GPU has free (other processes hold the rest)."""
    gib = 1 << 30
    budget = int(utilization * total) - held
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={utilization} allows {utilization * total / gib:.2f} GiB of the "
                         f"GPU's {total / gib:.2f} GiB, but the weights already take {held / gib:.2f} GiB; raise "
                         f"gpu_memory_utilization or use more GPUs (tensor_parallel_size)")
    if budget > free:
        raise ValueError(f"gpu_memory_utilization={utilization} asks for {budget / gib:.2f} GiB of cache but only "
                         f"{free / gib:.2f} GiB of the GPU is free (other processes hold "
                         f"{(total - free - held) / gib:.2f} GiB); lower gpu_memory_utilization to at most "
                         f"{(free + held) / total:.2f}")
    return budget
