"""The checks of ``EngineArgs``' values (run by ``EngineArgs.__post_init__``, which passes itself: this module
sits below ``args.py`` in the imports): each refusal names the fix."""

from __future__ import annotations

import json
from typing import Any

import torch

from kimik3.distributed import MOE_MODES
from kimik3.engine.arg_types import DTYPES, check_mm_limits, check_speculative_config, human_readable_int
from kimik3.model.batch import KV_CACHE_DTYPES
from kimik3.model.offload_policy import POLICIES as OFFLOAD_POLICIES

LOAD_FORMATS = ("auto", "safetensors", "fastsafetensors")
MOE_BACKENDS = ("auto", "triton")


def check_engine_args(args: Any) -> None:
    """Refuse values the engine cannot honour, naming the fix; normalise the ones given as text."""
    if isinstance(args.dtype, str) and args.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)} (or a torch.dtype), got {args.dtype!r}")
    if not isinstance(args.dtype, (str, torch.dtype)):
        raise ValueError(f"dtype must be a string such as 'bfloat16' or a torch.dtype, got {args.dtype!r}")
    if args.quantization is not None and args.quantization not in ("fp8",):
        raise ValueError(f"quantization {args.quantization!r} is not supported; kimik3 takes ['fp8'] (or none: "
                         f"the checkpoint's own formats)")
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {args.kv_cache_dtype!r}")
    if not (isinstance(args.gpu_memory_utilization, (int, float)) and 0.0 < args.gpu_memory_utilization <= 1.0):
        raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {args.gpu_memory_utilization!r}")
    if not isinstance(args.max_logprobs, int) or args.max_logprobs < 0:
        raise ValueError(f"max_logprobs must be an integer >= 0, got {args.max_logprobs!r}")
    if args.max_model_len is not None and isinstance(args.max_model_len, str):
        args.max_model_len = human_readable_int(args.max_model_len)
    if args.limit_mm_per_prompt is not None:
        args.limit_mm_per_prompt = check_mm_limits(args.limit_mm_per_prompt)
    if args.speculative_config is not None:
        if isinstance(args.speculative_config, str):
            args.speculative_config = json.loads(args.speculative_config)
        args.speculative_config = check_speculative_config(args.speculative_config)
        if args.num_speculative_tokens:
            raise ValueError("give speculative_config or num_speculative_tokens (n-gram), not both")
    _check_parallel(args)
    _check_offload(args)
    _check_vllm_flags(args)
    if args.expert_parallel_mode not in MOE_MODES:
        raise ValueError(f"expert_parallel_mode must be one of {MOE_MODES}, got {args.expert_parallel_mode!r}")

def _check_offload(args: Any) -> None:
    """--cpu-offload-gb and --expert-offload-policy."""
    if isinstance(args.cpu_offload_gb, bool) or not isinstance(args.cpu_offload_gb, (int, float)) \
            or not 0 <= args.cpu_offload_gb < float("inf"):
        raise ValueError(f"cpu_offload_gb must be a number of GiB >= 0, got {args.cpu_offload_gb!r}")
    if args.expert_offload_policy not in OFFLOAD_POLICIES:
        raise ValueError(f"expert_offload_policy must be one of {OFFLOAD_POLICIES}, got {args.expert_offload_policy!r}")
    if args.expert_offload_policy != "auto" and not args.cpu_offload_gb:
        raise ValueError(f"expert_offload_policy={args.expert_offload_policy!r} needs cpu_offload_gb > 0 (it says how "
                         "offloaded experts are served)")


def _check_parallel(args: Any) -> None:
    """The parallel layout's settings (expert placement, decode context parallelism)."""
    if (args.num_redundant_experts or args.eplb_load_file) and not args.enable_eplb:
        raise ValueError("num_redundant_experts and eplb_load_file need enable_eplb")
    if args.enable_eplb and not args.enable_expert_parallel:
        raise ValueError("enable_eplb places experts over expert-parallel ranks: add enable_expert_parallel")
    if args.enable_eplb and args.tensor_parallel_size == 1:
        raise ValueError("enable_eplb places experts over the expert-parallel ranks, which are the tensor-parallel "
                         "ranks (of each pipeline stage): set tensor_parallel_size > 1")
    if args.pipeline_parallel_size > 1:
        if args.async_scheduling:
            raise ValueError("async_scheduling is not supported with pipeline parallelism yet; leave it off")
        if args.enforce_eager is False:
            raise ValueError("decode CUDA graphs are not supported with pipeline parallelism yet; leave "
                             "enforce_eager on")
        method = (args.speculative_config or {}).get("method", "ngram")
        if method != "ngram":
            raise ValueError(f"speculative method {method!r} (a draft model) is not supported with pipeline "
                             f"parallelism yet: the draft reads the target's hidden states, which live on other "
                             f"stages; use n-gram drafts (num_speculative_tokens) or pipeline_parallel_size 1")
    if (args.pp_layer_partition is not None or args.pp_micro_batches is not None) \
            and args.pipeline_parallel_size == 1:
        raise ValueError("pp_layer_partition and pp_micro_batches need pipeline_parallel_size > 1")
    if args.tensor_parallel_size % args.decode_context_parallel_size:
        raise ValueError(f"decode_context_parallel_size {args.decode_context_parallel_size} must divide "
                         f"tensor_parallel_size {args.tensor_parallel_size} (the latent cache is striped over "
                         f"tensor-parallel ranks)")

def _check_vllm_flags(args: Any) -> None:
    """vLLM's flags kimik3 takes as no-ops or limits: refuse the values it cannot honour."""
    if args.load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {args.load_format!r} is not supported: kimik3 reads safetensors "
                         f"checkpoints; use one of {list(LOAD_FORMATS)}")
    if args.moe_backend not in MOE_BACKENDS:
        raise ValueError(f"moe_backend {args.moe_backend!r} is not available: kimik3 runs its own Triton expert "
                         f"kernels; use one of {list(MOE_BACKENDS)}")
    if args.enable_chunked_prefill is False:
        raise ValueError("enable_chunked_prefill=False is not supported: kimik3 always chunks long prompts by "
                         "max_num_batched_tokens (raise that to prefill a prompt in one step)")
    if args.cpu_threads is not None and (isinstance(args.cpu_threads, bool) or not isinstance(args.cpu_threads, int)
                                         or args.cpu_threads < 1):
        raise ValueError(f"cpu_threads must be a positive integer (or None: torch's default), got {args.cpu_threads!r}")
    if args.max_cudagraph_capture_size is not None and (
            not isinstance(args.max_cudagraph_capture_size, int) or args.max_cudagraph_capture_size < 1):
        raise ValueError(f"max_cudagraph_capture_size must be a positive integer, got "
                         f"{args.max_cudagraph_capture_size!r}")
