"""Which path an op takes: the plain-torch reference, or the fast CUDA path (Triton kernels of
ours and fla-core). Ops call ``use_fast_path(tensor)``; tests and benchmarks force the reference
on a GPU with ``with reference_ops(): ...`` (the eager reference is the oracle)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging

import torch

from kimik3.ops.options import kernel_options

logger = logging.getLogger(__name__)

# Scoped to the current thread/context: a benchmark forcing the reference in one thread does not
# change what a server thread runs.
_force_reference = contextvars.ContextVar("kimik3_force_reference_ops", default=False)


@functools.cache
def _announce() -> None:
    logger.info("kimik3 ops: CUDA fast path (Triton kernels, fla-core KDA)")


def use_fast_path(t: torch.Tensor) -> bool:
    """True when ``t`` lives on a CUDA device (or on the CPU with ``KernelOptions.cpu_kernels``) and the
    reference is not forced."""
    fast = (t.is_cuda or kernel_options().cpu_kernels) and not _force_reference.get()
    if fast:
        _announce()
    return fast


# dtypes our elementwise Triton kernels (norms, gating) read; float64 stays on the reference
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def use_fast_kernel(t: torch.Tensor, *others: torch.Tensor | torch.dtype) -> bool:
    """``use_fast_path(t)``, and ``t`` and every other operand (a tensor or an output dtype) one of
    ``KERNEL_DTYPES``."""
    dtypes = [o if isinstance(o, torch.dtype) else o.dtype for o in (t, *others)]
    return use_fast_path(t) and all(d in KERNEL_DTYPES for d in dtypes)


@contextlib.contextmanager
def reference_ops():
    """Run every op through its torch reference, also on CUDA tensors (in this context)."""
    token = _force_reference.set(True)
    try:
        yield
    finally:
        _force_reference.reset(token)


def import_fla_kda():
    """fla-core's KDA kernels (imported on first use: CPU runs never need them)."""
    try:
        from fla.ops.kda import chunk_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except ImportError as exc:   # pragma: no cover - depends on the environment
        raise RuntimeError("the CUDA KDA path needs fla-core 0.6.0 (pip install fla-core==0.6.0); "
                           f"import failed: {exc}. Run on CPU, or wrap the call in "
                           "kimik3.ops.backend.reference_ops() to use the torch reference") from exc
    import inspect
    params = inspect.signature(chunk_kda).parameters
    if "state_v_first" not in params or "use_beta_sigmoid_in_kernel" not in params:
        raise RuntimeError("fla-core is too old: chunk_kda lacks state_v_first / use_beta_sigmoid_in_kernel "
                           "(need fla-core 0.6.0)")
    return chunk_kda, fused_recurrent_kda_fwd
