"""Helpers shared by our Triton kernels."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kimik3.ops.options import kernel_options

# Programmatic dependent launch (Hopper and later; CUDA's PDL): every kernel of ours calls ``pdl_entry``
# and is launched with ``**pdl(tensor)``. Such a kernel may be launched while the kernel before it in the
# stream still runs; ``pdl_entry`` waits until that kernel has completed and its memory is visible
# (griddepcontrol.wait), then lets the kernel after it launch in turn. Each of our kernels waits before it
# loads anything it computes with, so a kernel can never run ahead of its predecessor's results, and the
# stream's order holds transitively. What it buys is the launch latency between dependent kernels (a CUDA
# graph of a decode step is a chain of ~60-100 small kernels). ``KernelOptions.pdl`` off (--no-pdl) launches them
# the ordinary way. Before the wait a kernel only asks L2 for lines it will read (``prefetch_l2``): the one-row
# projections their weight rows, the KDA decode step its state rows (located by the step's slot ids, an input
# written before the step's first kernel). On an H100 (0a2ea22) that made the batch-1 steps 1.3% (Kimi-Linear
# slice) and 0.6% (K3 slice) faster; ``KernelOptions.prefetch`` off (--no-prefetch) turns it off.


@functools.cache
def _pdl_capable(index: int) -> bool:
    """An NVIDIA GPU of compute capability 9.0 or later (ROCm devices report their own version numbers)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def pdl(t: torch.Tensor) -> dict:
    """Launch options of a kernel taking ``PDL`` for an operand ``t``: PDL on a CUDA device of compute
    capability 9.0 or later (never in the interpreter)."""
    on = (kernel_options().pdl and not INTERPRETING and t.is_cuda
          and _pdl_capable(t.device.index if t.device.index is not None else torch.cuda.current_device()))
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def pdl_entry(PDL: tl.constexpr):
    """A kernel's first statement: under PDL wait for the previous kernel in the stream to complete
    (its writes visible), then allow the next one to launch. Nothing otherwise."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


# Whether Triton runs our kernels in its CPU interpreter (TRITON_INTERPRET=1, read by Triton itself when it
# built them; the CPU tests): it multiplies bf16 dot operands as raw bits, so there the kernels upcast dot
# operands to fp32 first.
INTERPRETING = isinstance(pdl_entry, InterpretedFunction)


def prefetch_on(pdl_on: bool) -> bool:
    """Whether a kernel launched with PDL (``pdl_on``) prefetches its rows before the wait."""
    return pdl_on and kernel_options().prefetch


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte line holding each address of ``ptrs``, without waiting for it (PTX
    prefetch.global.L2; never in the interpreter). A kernel launched with PDL may call it before
    ``pdl_entry``: its loads then start while the kernel before it finishes. Always safe: L2 is where global
    memory is coherent, so a line the kernel before still writes is read after the wait as written."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def dot(a, b, acc, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def glu(g, u, beta, linear_beta, SITU: tl.constexpr, CLIP_UP: tl.constexpr):
    """act(g) * u in fp32: SITU (beta tanh(g / beta) sigmoid(g), the up branch clipped to
    linear_beta tanh(u / linear_beta) when CLIP_UP) or SiLU (g sigmoid(g))."""
    if SITU:
        gated = beta * tanh(g / beta) * tl.sigmoid(g)
    else:
        gated = g * tl.sigmoid(g)
    if CLIP_UP:
        u = linear_beta * tanh(u / linear_beta)
    return gated * u
