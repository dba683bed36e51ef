"""What the benchmark scripts share: where results go, the commit they name, logging, CUDA-event
timing and CUDA-graph capture. Run the scripts from the repository root (``PYTHONPATH=.``)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("OUT", ROOT / "bench_out"))


def log(*a) -> None:
    print(*a, flush=True)


def arg(name: str, default: str | None = None) -> str | None:
    """The value of ``--name=value`` on the command line (the scripts that take no argparse), else ``default``."""
    return next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith(f"--{name}=")), default)


def save_results(name: str, results: dict) -> Path:
    """``results`` as JSON in ``$OUT/name`` (``bench_out/`` without $OUT)."""
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / name
    path.write_text(json.dumps(results, indent=1, default=str))
    return path


def commit_id() -> str:
    """KIMIK3_COMMIT when set (the device's copy of the tree may carry stale git metadata), else git."""
    if os.environ.get("KIMIK3_COMMIT"):
        return os.environ["KIMIK3_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip() or "?"
    except OSError:
        return "?"


def cuda_time(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median seconds of ``fn`` over ``iters`` runs, timed with CUDA events after a warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def copy_rate() -> float:
    """Measured device copy bandwidth, bytes/s: a 2 GiB bf16 buffer copied into a second one."""
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / cuda_time(lambda: dst.copy_(src), iters=20)


def matmul_rate() -> float:
    """Measured bf16 matmul rate, FLOP/s: an 8192^3 product."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / cuda_time(lambda: a @ b, iters=20)


def capture_graph(fn):
    """``fn`` captured in a CUDA graph after two warm-up runs on a side stream: (graph, its output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def library_path(env: str, script: str) -> str:
    """The path ``env`` names (a library of ``kimik3/ops/cuda``); exits naming the build script when unset."""
    path = os.environ.get(env, "")
    if not path:
        raise SystemExit(f"set {env} to the library {script} builds")
    return path


def named_or_not(env: str, path: str, named: bool, fn):
    """``fn()`` with the library option of ``env`` (KIMIK3_FLASH_MLA / KIMIK3_FLASH_KDA) set to ``path`` (named)
    or unset: the ops take the library or our kernels (a CUDA graph keeps what ran at its capture)."""
    import dataclasses

    from kimik3.ops.options import kernel_options, use_kernel_options
    field = {"KIMIK3_FLASH_MLA": "flash_mla", "KIMIK3_FLASH_KDA": "flash_kda"}[env]
    with use_kernel_options(dataclasses.replace(kernel_options(), **{field: path if named else None})):
        return fn()


def install_environment_kernel_options() -> None:
    """The benchmarks run their ops under the kernel options a default ``EngineArgs`` resolves: the device
    call's KIMIK3_FLASH_MLA / KIMIK3_FLASH_KDA / KIMIK3_PDL / KIMIK3_PREFETCH decide, as for ``kimik3``."""
    from kimik3.engine.args import EngineArgs
    from kimik3.ops.options import install_kernel_options
    install_kernel_options(EngineArgs().kernel_options())


install_environment_kernel_options()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (same shapes: a broadcast would compare unrelated rows)."""
    if a.shape != b.shape:
        raise ValueError(f"rel_err: shapes {tuple(a.shape)} and {tuple(b.shape)} differ")
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def drain(engine, requests: list[tuple[str, list[int]]], params) -> int:
    """Add ``requests`` (id, prompt token ids) to ``engine`` and step it until done; the output tokens."""
    for rid, ids in requests:
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
    tokens = 0
    while engine.has_unfinished_requests():
        for d in engine.step():
            tokens += sum(len(c.token_ids) for c in d.outputs)
    return tokens


def load_module(path: str, name: str = "module_compared"):
    """The Python file at ``path`` imported as a module of its own (another copy of a kernel module, for an
    A/B in one process)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
