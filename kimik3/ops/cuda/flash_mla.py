"""DeepSeek's FlashMLA dense decode (Hopper) for the absorbed MLA decode, through the C entry point of
``flash_mla_shim.cu`` (built by ``kimik3 build-kernels``). Opt-in: ``--flash-mla <path to
libkimik3_flash_mla.so>`` and a latent cache in blocks of 64 tokens (``--block-size``'s default once the
variable is set); otherwise decode runs our Triton split-K kernel (``ops/triton/mla_decode.py``).

It computes what ours computes: per sequence and head, softmax(scale q . c) over the sequence's cached
latent rows c (576 = 512 latent + 64 rope columns), times their first 512 columns, in bf16 with fp32
accumulation, splits merged by their log-sum-exp. Two launches (split attention, combine) after the split
schedule of the step's sequence lengths (``flash_mla_schedule``: one launch, which every MLA layer of a forward step
shares), no host synchronisation, so decode steps still capture into CUDA graphs.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from kimik3.ops.cuda.loading import library, passed_over
from kimik3.ops.options import kernel_options

ENV = "KIMIK3_FLASH_MLA"        # the fallback of --flash-mla, read by engine/args.py alone
NAME = "--flash-mla / KIMIK3_FLASH_MLA"
LATENT, ROPE, PAGE = 512, 64, 64


def _declare(lib: ctypes.CDLL) -> None:
    lib.kimik3_flash_mla_sm_parts.restype = ctypes.c_int
    lib.kimik3_flash_mla_sm_parts.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.kimik3_flash_mla_meta_ints.restype = ctypes.c_int
    if not hasattr(lib, "kimik3_flash_mla_schedule"):
        raise RuntimeError(f"{NAME} names a library built before its schedule had its own entry point: rebuild it "
                           "with kimik3 build-kernels")
    lib.kimik3_flash_mla_schedule.restype = ctypes.c_int
    lib.kimik3_flash_mla_schedule.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3 + [ctypes.c_void_p]
    lib.kimik3_flash_mla_decode.restype = ctypes.c_int
    lib.kimik3_flash_mla_decode.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 7
                                            + [ctypes.c_int] * 4 + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p])


def flash_mla_library() -> ctypes.CDLL | None:
    """The library ``KernelOptions.flash_mla`` names (loaded once per path), or None when unset."""
    return library(NAME, kernel_options().flash_mla, _declare, "kimik3 build-kernels")


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def refusal(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
            capability: tuple[int, int], scaled: bool = False) -> str | None:
    """Why FlashMLA cannot take this decode, or None when it can: bf16 on Hopper (``capability`` (9, 0)),
    512 + 64 latent columns, a cache of 64-token blocks with packed rows. ``scaled``: an FP8 cache with
    per-token scales (``--kv-cache-dtype fp8``), which FlashMLA's dense decode does not read (its FP8 cache
    is the sparse decode's own 656-byte row: 512 FP8 values with four scales, and a bf16 rope part)."""
    if scaled or cache.dtype == torch.float8_e4m3fn:
        return "the latent cache is FP8 with per-token scales (FlashMLA's dense decode reads bf16 rows)"
    if not q_latent.dtype == q_pe.dtype == cache.dtype == torch.bfloat16:
        return f"the model runs in {q_latent.dtype} (FlashMLA takes bf16)"
    if q_latent.shape[-1] != LATENT or q_pe.shape[-1] != ROPE:
        return f"the latent is {q_latent.shape[-1]} + {q_pe.shape[-1]} wide (FlashMLA takes {LATENT} + {ROPE})"
    if cache.dim() != 3 or cache.shape[1] != PAGE:
        return f"the cache has {cache.shape[1]}-token blocks (FlashMLA reads {PAGE}: --block-size {PAGE})"
    if cache.shape[2] != LATENT + ROPE or cache.stride(2) != 1 or cache.stride(1) != LATENT + ROPE \
            or cache.stride(0) != PAGE * (LATENT + ROPE):
        return f"the cache rows are not packed (shape {tuple(cache.shape)}, strides {cache.stride()})"
    if tuple(capability) != (9, 0):
        return f"the GPU is sm_{capability[0]}{capability[1]} (the library is built for Hopper, sm_90a)"
    return None


def flash_mla_applies(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, scaled: bool = False) -> bool:
    """Whether this decode goes to FlashMLA: the library is named, the call is on CUDA and ``refusal`` finds
    nothing (what it finds is logged once)."""
    if not q_latent.is_cuda or not kernel_options().flash_mla:
        return False
    reason = refusal(q_latent, q_pe, cache, torch.cuda.get_device_capability(q_latent.device), scaled)
    if reason is not None:
        passed_over(NAME, reason, "MLA decode runs our Triton kernel")
        return False
    return flash_mla_library() is not None


@dataclass(frozen=True)
class FlashMLASchedule:
    """FlashMLA's split schedule of N sequence lengths for H heads: meta [parts, ...] and splits [N + 1] int32."""
    lens: torch.Tensor          # [N] int32, the lengths it schedules (the decode reads them too)
    meta: torch.Tensor
    splits: torch.Tensor
    heads: int
    parts: int


def _check(err: int, what: str) -> None:
    if err:
        raise RuntimeError(f"FlashMLA {what} failed ({'an exception in FlashMLA' if err < 0 else f'CUDA error {err}'})")


def flash_mla_schedule(seq_lens: torch.Tensor, heads: int) -> FlashMLASchedule:
    """The split schedule of a decode over ``seq_lens`` [N] (on the device, the new token included) with ``heads``
    query heads: one launch, shared by every decode over the same lengths and heads (``ops.mla``'s ``plans``)."""
    lib = flash_mla_library()
    dev = seq_lens.device
    N = seq_lens.shape[0]
    lens = seq_lens.to(torch.int32).contiguous()
    parts = lib.kimik3_flash_mla_sm_parts(heads, _num_sms(dev))
    meta = torch.empty(parts, lib.kimik3_flash_mla_meta_ints(), dtype=torch.int32, device=dev)
    splits = torch.empty(N + 1, dtype=torch.int32, device=dev)
    _check(lib.kimik3_flash_mla_schedule(lens.data_ptr(), meta.data_ptr(), splits.data_ptr(), N, parts,
                                         dev.index if dev.index is not None else torch.cuda.current_device(),
                                         torch.cuda.current_stream(dev).cuda_stream), f"schedule (N={N}, H={heads})")
    return FlashMLASchedule(lens, meta, splits, heads, parts)


def flash_mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, schedule: FlashMLASchedule | None = None) -> torch.Tensor:
    """q_latent [N, H, 512]; q_pe [N, H, 64]; cache [num_blocks, 64, 576]; block_tables [N, max_blocks];
    seq_lens [N] on the device (the new token included); ``schedule``: ``flash_mla_schedule`` of these lengths
    and heads (None: computed here). Returns the latent output [N, H, 512] bf16."""
    if not flash_mla_applies(q_latent, q_pe, cache):
        raise ValueError(f"flash_mla_decode: needs {NAME}, a Hopper GPU, bf16 q [N, H, {LATENT}] + [N, H, {ROPE}] and a "
                         f"cache [blocks, {PAGE}, {LATENT + ROPE}]; got {q_latent.dtype} {tuple(q_latent.shape)}, "
                         f"{tuple(q_pe.shape)}, cache {cache.dtype} {tuple(cache.shape)}")
    lib = flash_mla_library()
    N, H, _ = q_latent.shape
    dev = q_latent.device
    if N == 0:
        return q_latent.new_empty(0, H, LATENT)
    if schedule is None:
        schedule = flash_mla_schedule(seq_lens, H)
    elif schedule.heads != H or schedule.lens.shape[0] != N:
        raise ValueError(f"flash_mla_decode: a schedule of {schedule.lens.shape[0]} sequences and {schedule.heads} "
                         f"heads for a decode of {N} and {H}")
    q = torch.cat([q_latent, q_pe], dim=-1)                                         # [N, H, 576], packed
    tables = block_tables if block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1 else \
        block_tables.to(torch.int32).contiguous()
    parts = schedule.parts
    out = torch.empty(N, H, LATENT, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(N, H, dtype=torch.float32, device=dev)
    lse_acc = torch.empty(N + parts, H, dtype=torch.float32, device=dev)
    o_acc = torch.empty(N + parts, H, LATENT, dtype=torch.float32, device=dev)
    _check(lib.kimik3_flash_mla_decode(q.data_ptr(), cache.data_ptr(), tables.data_ptr(), tables.stride(0),
                                       schedule.lens.data_ptr(), out.data_ptr(), lse.data_ptr(), schedule.meta.data_ptr(),
                                       schedule.splits.data_ptr(), lse_acc.data_ptr(), o_acc.data_ptr(), N, H,
                                       cache.shape[0], parts, float(scale),
                                       dev.index if dev.index is not None else torch.cuda.current_device(),
                                       torch.cuda.current_stream(dev).cuda_stream), f"decode (N={N}, H={H})")
    return out
