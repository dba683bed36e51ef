"""``kimik3 serve``: command-line flags (vLLM's names), engine construction, uvicorn."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from kimik3.serve.app import ServeOptions, create_app
from kimik3.serve.limits import add_limit_arguments, limits_from_args

logger = logging.getLogger(__name__)

_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``serve`` flags, named as vLLM users know them."""
    import kimik3
    parser.add_argument("--model", default=str(kimik3.DEFAULT_MODEL),
                        help="checkpoint directory (default: the embedded tiny K3 model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None,
                        help="model name clients send (default: the checkpoint directory name)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but /health")
    parser.add_argument("--max-model-len", type=int, default=8192, help="prompt + output tokens per sequence")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="sequences per engine step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget per engine step (default 8192)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse cached prompt prefixes (default: on)")
    parser.add_argument("--num-speculative-tokens", type=int, default=0,
                        help="n-gram draft tokens verified per step (0 = off)")
    parser.add_argument("--speculative-ngram-min", type=int, default=2, help="shortest n-gram looked up for drafts")
    parser.add_argument("--speculative-ngram-max", type=int, default=4, help="longest n-gram looked up for drafts")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="auto",
                        help="weights and cache dtype (auto: bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    parser.add_argument("--max-queue-len", type=int, default=256,
                        help="sequences (n x prompts) accepted beyond --max-num-seqs before answering 429")
    parser.add_argument("--seed", type=int, default=0, help="engine RNG seed (requests without their own seed)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish on shutdown before they are aborted")
    add_limit_arguments(parser)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="GPUs (ranks) the model is split over; on one node the extra ranks are spawned, "
                             "across nodes start every rank with torchrun (rank 0 serves)")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="split whole routed experts over the tensor-parallel ranks instead of their "
                             "intermediate")
    parser.add_argument("--expert-parallel-mode", choices=["tep", "a2a", "agrs"], default="tep",
                        help="with expert parallelism: tokens replicated (tep), or token-sharded MoE with "
                             "all-to-all (a2a) or all-gather/reduce-scatter (agrs)")
    return parser


def build_engine(args: argparse.Namespace):
    """Load the model and tokenizer named by ``args`` and build the engine."""
    import kimik3
    from kimik3.engine import EngineConfig, LLMEngine
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _DTYPES[args.dtype] or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
                          seed=args.seed, num_speculative_tokens=args.num_speculative_tokens,
                          speculative_ngram_min=args.speculative_ngram_min,
                          speculative_ngram_max=args.speculative_ngram_max)
    tp = getattr(args, "tensor_parallel_size", 1)
    if tp > 1 or getattr(args, "enable_expert_parallel", False):
        from kimik3.parallel.launch import ParallelConfig, start_group
        layout = ParallelConfig(tp, args.enable_expert_parallel,
                                args.expert_parallel_mode if args.enable_expert_parallel else "tep")
        model, group = start_group(args.model, layout, dtype, device.type)   # ranks > 0 never return
        tokenizer = kimik3.load_tokenizer(args.model)
        return LLMEngine(model, config, tokenizer=tokenizer, tokenizer_path=str(args.model),
                         runner_factory=group.runner_factory)
    model = kimik3.load_model(args.model, device=device, dtype=dtype)
    tokenizer = kimik3.load_tokenizer(args.model)
    return LLMEngine(model, config, tokenizer=tokenizer, tokenizer_path=str(args.model))


def serve_options(args: argparse.Namespace) -> ServeOptions:
    processor = None
    if (Path(args.model) / "preprocessor_config.json").is_file():
        from kimik3.vision.preprocess import load_media_processor_config
        processor = load_media_processor_config(args.model)
    name = args.served_model_name or Path(args.model).resolve().name
    return ServeOptions(served_model_name=name, api_key=args.api_key, max_queue_len=args.max_queue_len,
                        shutdown_timeout=args.shutdown_timeout, processor_config=processor,
                        limits=limits_from_args(args))


def build_app(args: argparse.Namespace):
    options = serve_options(args)        # bad flags fail before the model loads
    return create_app(build_engine(args), options)


def run_server(args: argparse.Namespace) -> None:
    """Build the engine and app from ``args`` and serve until SIGINT/SIGTERM (graceful shutdown)."""
    from kimik3.serve.lifecycle import Server, server_config
    app = build_app(args)
    logger.info("serving %s on http://%s:%d", args.model, args.host, args.port)
    Server(server_config(app, app.state.kimik3.options.limits, host=args.host, port=args.port,
                         log_level=args.log_level)).run()


def serve_main(args: argparse.Namespace) -> int:
    """Entry point for ``kimik3 serve``: 0 on a clean shutdown, 1 if the server could not start."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run_server(args)
    except (ValueError, OSError, RuntimeError) as e:
        logger.error("cannot serve: %s", e)
        return 1
    return 0
