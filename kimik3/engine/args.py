"""One definition of the engine's arguments (vLLM's ``EngineArgs``): a dataclass plus one argparse builder.

Every ``kimik3`` subcommand that builds an engine (``generate``, ``chat``, ``serve``, ``bench``) adds its
flags with ``flags.add_engine_args``, and ``LLM(...)`` takes the same fields as keyword arguments, so names,
choices and defaults agree everywhere. Names follow vLLM; ``EngineArgs`` resolves the automatic values
(dtype, device, ``max_model_len`` from the model's config) and ``build.build_engine`` builds the engine.

``--max-model-len`` takes vLLM's human-readable integers: a lowercase suffix is decimal (``32k`` = 32000,
``1m`` = 1000000, ``25.6k`` = 25600), an uppercase one binary (``32K`` = 32768, ``1M`` = 1048576, no
decimals), exactly as vLLM's ``human_readable_int`` parses them.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kimik3.engine.arg_checks import LOAD_FORMATS, MOE_BACKENDS, check_engine_args
from kimik3.engine.arg_types import DTYPES, fraction, mm_limits_arg, non_negative_gib, non_negative_int, positive_int, \
    positive_seconds, positive_size, read_generation_config, speculative_config_arg, speculative_settings
from kimik3.model.batch import KV_CACHE_DTYPES
from kimik3.model.offload_policy import POLICIES as OFFLOAD_POLICIES
from kimik3.kernels import installed
from kimik3.ops.cuda.flash_kda import ENV as FLASH_KDA_ENV
from kimik3.ops.cuda.flash_mla import ENV as FLASH_MLA_ENV
from kimik3.ops.cuda.flash_mla import PAGE as FLASH_MLA_BLOCK
from kimik3.ops.options import KernelOptions

logger = logging.getLogger(__name__)

CPU_DEFAULT_MAX_MODEL_LEN = 8192     # the default context on a CPU (a chat without max_tokens ends within it)


def _opt(help: str, **kw) -> Any:
    """A dataclass field that carries its flag's help text (and argparse options)."""
    default = kw.pop("default")
    factory = kw.pop("default_factory", None)
    meta = {"help": help, **kw}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class EngineArgs:
    """The engine's arguments; ``LLM(**fields)`` and the ``kimik3`` flags (``--max-model-len`` ...) take them."""

    model: str | None = _opt("checkpoint directory (default: the embedded tiny K3 with random weights)",
                             default=None)
    dtype: Any = _opt("weights and activations dtype: auto (bfloat16 on CUDA, float32 on CPU), half/float16, "
                      "bfloat16, float/float32, float64 (default: auto)", default="auto", choices=list(DTYPES))
    device: str | None = _opt("cpu, cuda or cuda:N (default: cuda if available, else cpu)", default=None)
    max_model_len: int | None = _opt(
        "prompt + output tokens per sequence; takes 32k (=32000) or 32K (=32768) as vLLM does "
        "(default: the model's max_position_embeddings; on CPU at most 8192)", default=None, type=positive_size)
    max_num_seqs: int = _opt("sequences per engine step (default: 64)", default=64,
                             type=positive_size)
    max_num_batched_tokens: int = _opt("token budget of one engine step; longer prompts are chunked, which bounds a "
                                       "step's memory (default: 8192)", default=8192,
                                       type=positive_size)
    long_prefill_token_threshold: int | None = _opt(
        "the most tokens of one prompt prefilled in a step (vLLM's): a long prompt is chunked that fine, so the decode "
        "steps it shares stay short; 0: --max-num-batched-tokens (default: 0; kimik3 serve on a CPU: 32)",
        default=None, type=non_negative_int)
    cpu_threads: int | None = _opt("torch threads on a CPU device (default: torch's, one per core; kimik3 serve "
                                   "on a CPU: the cores less one, which it leaves to the HTTP side)",
                                   default=None, type=positive_int)
    block_size: int | None = _opt("tokens per cache block (default: 16; 64 on CUDA when --flash-mla names "
                                  "FlashMLA's library, whose decode takes 64-token blocks)", default=None,
                                  type=positive_size)
    enable_prefix_caching: bool = _opt("reuse the cache of shared prompt prefixes (default: on)", default=True)
    gpu_memory_utilization: float = _opt(
        "fraction of the GPU's memory this whole process may use (weights, cache, activations); the cache gets "
        "what the loaded weights leave of it. Ignored on CPU (default: 0.9)", default=0.9, type=fraction)
    kv_cache_memory_bytes: int | None = _opt(
        "bytes for the cache pools, overriding --gpu-memory-utilization (default: sized automatically; "
        "on CPU what max-num-seqs full sequences need, at most 4 GiB)", default=None,
        type=positive_size)
    kv_cache_dtype: str = _opt("MLA latent cache dtype: auto (the model dtype), fp8 / fp8_e4m3 (float8_e4m3fn with "
                               "one float32 scale per token: half the bytes); KDA states stay float32 "
                               "(default: auto)", default="auto", choices=list(KV_CACHE_DTYPES))
    quantization: str | None = _opt(
        "fp8: the dense bf16 projections and bf16 routed experts (offloaded ones too) quantised to FP8 (E4M3, a scale "
        "per output channel) at load; FP8 GEMVs at decode, FP8 GEMMs at prefill (default: none, the checkpoint's own)",
        default=None, choices=["fp8"], aliases=("-q",))
    kda_checkpoint_interval: int | None = _opt(
        "cache blocks between saved KDA states for prefix caching (default: auto)", default=None,
        type=positive_size)
    enforce_eager: bool | None = _opt(
        "never capture CUDA graphs; every step runs eagerly. --no-enforce-eager asks for decode graphs under "
        "tensor/expert parallelism too (default: off on one GPU; on under parallelism, whose graphs are tested "
        "on CPU ranks but not yet run on several GPUs)", default=None)
    seed: int = _opt("engine RNG seed for requests without their own seed (default: 0)", default=0, type=int)
    max_logprobs: int = _opt("most logprobs a request may ask for per token (default: 20)", default=20,
                             type=non_negative_int)
    grammar_compile_timeout: float = _opt(
        "seconds a structured-outputs constraint may take to compile (in a separate worker process); a slower "
        "one is refused with a 400 (default: 5)", default=5.0, type=positive_seconds)
    grammar_compile_memory: int = _opt(
        "bytes a structured-outputs constraint's compiler process may grow by (2G = 2 GiB); beyond it the "
        "constraint is refused with a 400 (default: 2G)", default=2 << 30, type=positive_size)
    language_model_only: bool = _opt("load the text model only: skip the vision tower, refuse images "
                                     "(default: off)", default=False)
    generation_config: str = _opt(
        "default sampling settings: auto reads the model's generation_config.json, vllm uses the built-in "
        "defaults, or a folder holding a generation_config.json (default: auto)", default="auto")
    limit_mm_per_prompt: dict[str, int] | None = _opt(
        "most images/videos per prompt, as JSON: '{\"image\": 4, \"video\": 1}' (default: no limit)",
        default=None, type=mm_limits_arg)
    trust_remote_code: bool = _opt(
        "accepted for the K3 recipe; a no-op: kimik3 implements K3 itself and never runs checkpoint code "
        "(default: off)", default=False)
    tensor_parallel_size: int = _opt("GPUs (ranks) the model is split over; on one node the extra ranks are "
                                     "spawned, across nodes start every rank with torchrun (default: 1)",
                                     default=1, type=positive_size, aliases=("-tp",))
    enable_expert_parallel: bool = _opt("split whole routed experts over the tensor-parallel ranks instead of "
                                        "their intermediate (default: off)", default=False)
    expert_parallel_mode: str = _opt("with expert parallelism: tokens replicated (tep), or token-sharded MoE with "
                                     "all-to-all (a2a) or all-gather/reduce-scatter (agrs) (default: tep)",
                                     default="tep", choices=["tep", "a2a", "agrs"])
    decode_context_parallel_size: int = _opt(
        "decode context parallelism: the MLA latent cache's token positions striped over this many tensor-parallel "
        "ranks (position p on rank p mod N of its group), each attending over its stripe, the partials merged by "
        "their log-sum-exps: N times the context per rank; must divide --tensor-parallel-size and "
        "--block-size (default: 1, off)", default=1, type=positive_size, aliases=("-dcp",))
    pipeline_parallel_size: int = _opt(
        "pipeline stages: the decoder layers split into this many contiguous stages (balanced by weight bytes and "
        "the attention-residual blocks), each stage tensor-parallel over --tensor-parallel-size ranks; the stream "
        "crosses stages by send/recv (default: 1)", default=1, type=positive_size, aliases=("-pp",))
    pp_layer_partition: str | None = _opt("decoder layers per pipeline stage, comma-separated (e.g. 47,46) "
                                          "(default: planned)", default=None)
    pp_micro_batches: int | None = _opt(
        "pipeline parallelism: micro-batches each step is cut into, so stage s works on micro-batch k + 1 while stage "
        "s + 1 works on k; 1 runs each step whole (default: one per stage)", default=None, type=positive_int)
    enable_eplb: bool = _opt("expert-parallel load balancing: each MoE layer's experts placed in E + R slots over the "
                             "expert-parallel ranks by their recorded load (hot experts copied, tokens spread over "
                             "the copies); needs --enable-expert-parallel (default: off)", default=False)
    num_redundant_experts: int = _opt("EPLB: extra expert slots per MoE layer (E + R must divide over the "
                                      "expert-parallel ranks) (default: 0)", default=0, type=non_negative_int)
    eplb_load_file: str | None = _opt("EPLB: a recorded expert load file (JSON, as LLM.save_expert_loads writes it) "
                                      "that places the experts at start-up (default: even placement)", default=None)
    num_speculative_tokens: int = _opt("n-gram draft tokens verified per step (default: 0, off)", default=0,
                                       type=non_negative_int)
    speculative_config: dict[str, Any] | None = _opt(
        "speculative decoding, vLLM's JSON: '{\"method\": \"eagle3\" | \"mtp\" | \"dflash\" | \"dspark\" | \"ngram\", "
        "\"model\": DRAFT_DIR, \"num_speculative_tokens\": K}'; \"model\": \"default\" is the Eagle3 draft shipped "
        "with the default model (default: none; --num-speculative-tokens alone means n-gram)", default=None,
        type=speculative_config_arg)
    speculative_ngram_min: int = _opt("shortest n-gram looked up for drafts (default: 2)", default=2, type=positive_int)
    speculative_ngram_max: int = _opt("longest n-gram looked up for drafts (default: 4)", default=4, type=positive_int)
    async_scheduling: bool | None = _opt(
        "schedule and launch each decode step before the previous step's tokens reach the host, so host work "
        "overlaps the GPU; with speculation, drafts are looked up ahead of the previous token and a step "
        "expected to reject its drafts is followed at once by the next (default: on for one CUDA device, "
        "as in vLLM; else off)", default=None)
    cpu_offload_gb: float = _opt(
        "GiB of routed experts kept in host memory (pinned) instead of on the GPU, per GPU as vLLM's flag: "
        "under tensor / expert / pipeline parallelism each rank offloads this much of the experts (or expert "
        "slices) it holds; each MoE layer caches its hot experts on the GPU and copies the ones it misses in "
        "as it runs them, with the same tokens as fully resident (default: 0)",
        default=0.0, type=non_negative_gib)
    expert_offload_policy: str = _opt(
        "with --cpu-offload-gb, how a step serves the experts it routes to but the GPU does not cache: copy (in "
        "after routing), prefetch (predicted while the previous layer runs, copied on a side stream; the rest "
        "after routing), auto (the faster of the two per batch size, from rates measured at start-up; the "
        "choices are logged), host (as auto, and eager steps may compute them on the host where that is "
        "faster; its sums round differently from the GPU kernels') (default: auto)",
        default="auto", choices=list(OFFLOAD_POLICIES))
    use_tqdm_on_load: bool = _opt("show a progress bar while the weights load (default: on)", default=True)
    # the ops' options (``kimik3.ops.options.KernelOptions``); each falls back to its environment variable
    flash_mla: str | None = _opt("path of libkimik3_flash_mla.so: MLA decode on FlashMLA (Hopper, bf16, 64-token "
                                 "blocks); 'none': our Triton decode (default: $KIMIK3_FLASH_MLA, else the library "
                                 "`kimik3 build-kernels` built into kimik3's cache, else our Triton decode)",
                                 default=None)
    flash_kda: str | None = _opt("path of libkimik3_flash_kda.so: K3's KDA prefill on FlashKDA (Hopper, bf16); "
                                 "'none': fla-core (default: $KIMIK3_FLASH_KDA, else the library `kimik3 "
                                 "build-kernels` built into kimik3's cache, else fla-core)", default=None)
    pdl: bool | None = _opt("programmatic dependent launch of our Triton kernels on Hopper and later (default: on, "
                            "unless KIMIK3_PDL=0)", default=None)
    prefetch: bool | None = _opt("L2 prefetch of weight / state rows ahead of the PDL wait (default: on, unless "
                                 "KIMIK3_PREFETCH=0)", default=None)
    enable_w4a8_moe: bool | None = _opt("W4A8: MXFP4 experts (K3's) at prefill sizes with MXFP8 activations on the FP8 "
                                        "tensor cores; no-op for bf16 experts (default: off, not yet measured a win)", default=None)
    # vLLM's flags that name what kimik3 always does (accepted no-ops, with the reason) or a limit it applies
    load_format: str = _opt(
        "weights format: auto, safetensors or fastsafetensors; all three read the checkpoint's safetensors with "
        "kimik3's loader (fastsafetensors is vLLM's faster reader of the same files: the same weights), other "
        "formats are refused (default: auto)", default="auto", choices=list(LOAD_FORMATS))
    moe_backend: str = _opt(
        "routed-expert kernels: auto or triton, kimik3's own Triton/Gluon expert kernels (the only backend it "
        "has); vLLM's other backends are refused (default: auto)", default="auto", choices=list(MOE_BACKENDS))
    max_cudagraph_capture_size: int | None = _opt(
        "largest decode batch captured in a CUDA graph; larger batches run eagerly (default: --max-num-seqs)",
        default=None, type=positive_size)
    disable_custom_all_reduce: bool = _opt(
        "accepted for the K3 recipe; a no-op: kimik3's tensor parallelism always reduces through NCCL (it has no "
        "custom all-reduce) (default: off)", default=False)
    enable_chunked_prefill: bool | None = _opt(
        "accepted; prefill is always chunked by --max-num-batched-tokens, so --no-enable-chunked-prefill is "
        "refused (default: on)", default=None)

    def __post_init__(self) -> None:
        check_engine_args(self)

    # ---- the command line ------------------------------------------------------------------------
    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})

    # ---- resolution ---------------------------------------------------------------------------------
    def model_path(self) -> Path:
        from kimik3.loader import DEFAULT_MODEL
        path = Path(self.model) if self.model else DEFAULT_MODEL
        if not path.exists():
            raise ValueError(f"model path {path} does not exist")
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json: not a checkpoint directory")
        return path

    def resolve_device_dtype(self) -> tuple[torch.device, torch.dtype]:
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if not isinstance(device, torch.device) and not re.fullmatch(r"cpu|cuda(:\d+)?", str(device)):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device}: CUDA is not available on this machine")
        dtype = self.dtype if isinstance(self.dtype, torch.dtype) else DTYPES[self.dtype]
        if dtype is None:
            dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        return dev, dtype

    def resolve_max_model_len(self, model_config, device: torch.device | None = None) -> int:
        """The flag if given (at most the model's max_position_embeddings); else the model's, or on a CPU at
        most ``CPU_DEFAULT_MAX_MODEL_LEN`` (a CPU cannot serve 1M-token sequences: a 1,048,575-id prompt grew a
        CPU server by 6.3 GB in 25 s; vLLM too picks smaller defaults off the GPU)."""
        limit = model_config.text.max_position_embeddings
        if self.max_model_len is None:
            if limit is None:
                raise ValueError("the model's config.json has no max_position_embeddings; pass max_model_len")
            if device is not None and device.type == "cpu" and limit > CPU_DEFAULT_MAX_MODEL_LEN:
                logger.info("max_model_len %d on CPU (the model takes %d; pass --max-model-len for more)",
                            CPU_DEFAULT_MAX_MODEL_LEN, limit)
                return CPU_DEFAULT_MAX_MODEL_LEN
            return limit
        if limit is not None and self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} is longer than the model's "
                             f"max_position_embeddings={limit}; lower it")
        return self.max_model_len

    def generation_defaults(self, path: Path) -> dict[str, Any]:
        """Default sampling settings (SamplingParams names) from ``generation_config.json``."""
        return read_generation_config(path, self.generation_config)

    def resolve_async_scheduling(self, device: torch.device) -> bool:
        """The flag if given; else on for one CUDA device, with speculation too: on one H100 at 856b609 (the K3
        slice at batch 1, 1024 + 256 tokens, benchmarks/gpu/bench_speculative.py) speculation ran 310 / 309 /
        875 tok/s async against 282 / 284 / 888 synchronous (no drafts / rejected / repetitive), plain
        decoding 311 against 290 (on a CPU there is nothing to overlap). Under tensor / expert parallelism it
        is opt-in: tested with gloo on CPU ranks, not yet run on several GPUs."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return device.type == "cuda" and not self.is_parallel

    def kernel_options(self) -> KernelOptions:
        """The ops' options: each flag, or where it is not given its environment variable (the one place
        kimik3 reads them: ``KIMIK3_FLASH_MLA``, ``KIMIK3_FLASH_KDA`` paths; ``KIMIK3_PDL``,
        ``KIMIK3_PREFETCH`` = 0 for off). A library named by neither is the one ``kimik3 build-kernels``
        built into kimik3's cache, if any (``kimik3.kernels.installed``); "none" (flag or variable) turns it off."""
        env = os.environ

        def pick(flag, name: str, default: str):
            return flag if flag is not None else env.get(name, default)

        def library(flag, variable: str, name: str) -> str | None:
            given = pick(flag, variable, "")
            if given.lower() == "none":
                return None
            found = None if given else installed(name)
            return given or (str(found) if found else None)
        return KernelOptions(flash_mla=library(self.flash_mla, FLASH_MLA_ENV, "flash_mla"),
                             flash_kda=library(self.flash_kda, FLASH_KDA_ENV, "flash_kda"), w4a8_moe=bool(self.enable_w4a8_moe),
                             pdl=self.pdl if self.pdl is not None else env.get("KIMIK3_PDL", "1") != "0",
                             prefetch=self.prefetch if self.prefetch is not None else env.get("KIMIK3_PREFETCH", "1") != "0")

    def resolve_block_size(self, device: torch.device) -> int:
        """The flag if given; else 64 on CUDA when ``--flash-mla`` names FlashMLA's library (its decode
        reads 64-token blocks: ``kimik3/ops/cuda/flash_mla.py``, which says once in the log when a given other
        size keeps our Triton decode), else 16."""
        if self.block_size is not None:
            return self.block_size
        return FLASH_MLA_BLOCK if device.type == "cuda" and self.kernel_options().flash_mla else 16

    def resolve_enforce_eager(self) -> bool:
        """The flag if given; else eager under tensor / expert parallelism only."""
        if self.enforce_eager is not None:
            return self.enforce_eager
        return self.is_parallel

    @property
    def is_parallel(self) -> bool:
        """Several ranks (tensor, expert or pipeline parallelism)."""
        return self.tensor_parallel_size > 1 or self.enable_expert_parallel or self.pipeline_parallel_size > 1

    def pp_partition(self) -> tuple[int, ...] | None:
        if self.pp_layer_partition is None:
            return None
        try:
            return tuple(int(x) for x in str(self.pp_layer_partition).split(","))
        except ValueError:
            raise ValueError(f"pp_layer_partition must be comma-separated layer counts, got "
                             f"{self.pp_layer_partition!r}") from None

    def expert_offload_config(self):
        """The model's expert-offload settings (``--cpu-offload-gb``), or None when nothing is offloaded."""
        if not self.cpu_offload_gb:
            return None
        if self.enable_eplb:
            raise ValueError("cpu_offload_gb with --enable-eplb is not supported yet (EPLB moves experts between the "
                             "ranks' GPUs, offloaded ones live in host memory); leave one of them off")
        from kimik3.model.expert_offload import ExpertOffloadConfig
        return ExpertOffloadConfig.from_gib(self.cpu_offload_gb, policy=self.expert_offload_policy)

    def engine_config(self, max_model_len: int, device: torch.device):
        from kimik3.engine.config import EngineConfig
        return EngineConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                            long_prefill_token_threshold=self.long_prefill_token_threshold or 0,
                            max_model_len=max_model_len, enable_prefix_caching=self.enable_prefix_caching,
                            kv_cache_dtype=self.kv_cache_dtype,
                            block_size=self.resolve_block_size(device), kda_checkpoint_interval=self.kda_checkpoint_interval,
                            cache_memory_bytes=self.kv_cache_memory_bytes,
                            gpu_memory_utilization=float(self.gpu_memory_utilization), seed=self.seed,
                            enforce_eager=self.resolve_enforce_eager(), max_logprobs=self.max_logprobs,
                            max_cudagraph_capture_size=self.max_cudagraph_capture_size,
                            pp_micro_batches=self.pp_micro_batches,
                            **self.speculative_settings(),
                            grammar_compile_timeout=float(self.grammar_compile_timeout),
                            grammar_compile_memory=self.grammar_compile_memory,
                            async_scheduling=self.resolve_async_scheduling(device))

    def speculative_settings(self) -> dict[str, Any]:
        """The EngineConfig speculation fields from ``speculative_config`` or the n-gram flags."""
        return speculative_settings(self)
