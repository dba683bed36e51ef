"""``build_engine``: the one way from ``EngineArgs`` to a running engine, used by ``LLM``, ``kimik3
serve``, ``kimik3 bench`` and the other commands (through ``LLM``).

It resolves the automatic settings, checks the generation config before the (long) load, loads the
model, builds the ``LLMEngine`` and, on a GPU, warms it up (``warmup.py``: kernels compile before
the first request, not during it); with tensor or expert parallelism this process becomes rank 0
of a new group (``kimik3.parallel.launch``) whose lock-step runner drives every rank's forward.
"""

from __future__ import annotations

import functools
import logging

import torch

from kimik3.config import load_config
from kimik3.engine.args import EngineArgs
from kimik3.engine.core.llm_engine import LLMEngine
from kimik3.engine.warmup import warm_up
from kimik3.loader import load_model
from kimik3.kernels import describe_kernels
from kimik3.ops.options import install_kernel_options

logger = logging.getLogger(__name__)


def build_engine(args: EngineArgs, tokenizer=None):
    """Load the model and build the engine: ``(LLMEngine, parallel group or None)``."""
    path = args.model_path()
    device, dtype = args.resolve_device_dtype()
    config = args.engine_config(args.resolve_max_model_len(load_config(path), device), device)
    if config.async_scheduling and args.async_scheduling is None:
        logger.info("async scheduling on (the default on one CUDA device; --no-async-scheduling turns it off)")
    args.generation_defaults(path)          # a bad generation config fails before the load
    offload = args.expert_offload_config()
    if device.type == "cpu" and args.cpu_threads is not None:
        torch.set_num_threads(args.cpu_threads)       # process-wide: torch's intra-op threads
    logger.info("loading %s (%s on %s, %d torch threads)", path, str(dtype).removeprefix("torch."), device,
                torch.get_num_threads())
    kernels = args.kernel_options()
    install_kernel_options(kernels)         # the ops' options, resolved once (one engine's per process)
    if device.type == "cuda":
        for line in describe_kernels(kernels.flash_mla, kernels.flash_kda):
            logger.info("%s", line)
    if args.is_parallel:
        from kimik3.engine.run.parallel_runner import ParallelRunner
        from kimik3.parallel.launch import ParallelConfig, start_group
        layout = ParallelConfig(args.tensor_parallel_size, args.enable_expert_parallel,
                                args.expert_parallel_mode if args.enable_expert_parallel else "tep",
                                decode_context_parallel_size=args.decode_context_parallel_size,
                                enable_eplb=args.enable_eplb, num_redundant_experts=args.num_redundant_experts,
                                pipeline_parallel_size=args.pipeline_parallel_size,
                                pp_layer_partition=args.pp_partition())
        loads = {}
        if args.eplb_load_file:
            from kimik3.model.eplb import read_loads
            text = load_config(path).text
            loads = read_loads(args.eplb_load_file, text.num_experts,
                               [i for i in range(text.num_hidden_layers) if text.is_moe_layer(i)])
        layout.check_model(load_config(path), config.block_size)     # before any worker is spawned
        model, group = start_group(str(path), layout, dtype, device.type,     # ranks > 0 never return
                                   kernel_options=kernels, language_model_only=args.language_model_only,
                                   quantization=args.quantization, expert_offload=offload,
                                   **({"expert_loads": loads} if args.enable_eplb else {}))
        engine = LLMEngine(model, config, tokenizer=tokenizer, tokenizer_path=str(path),
                           runner_factory=functools.partial(ParallelRunner, control=group.control,
                                                            on_failure=group.fail))
    else:
        model = load_model(path, device=device, dtype=dtype, language_model_only=args.language_model_only,
                           progress=args.use_tqdm_on_load, expert_offload=offload, quantization=args.quantization)
        engine, group = LLMEngine(model, config, tokenizer=tokenizer, tokenizer_path=str(path)), None
    if device.type == "cuda":
        warm_up(engine)
    return engine, group
