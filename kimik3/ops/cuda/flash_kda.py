"""MoonshotAI's FlashKDA (CUTLASS, Hopper and newer) for the chunked KDA of a prefill step, through the
C entry point of ``flash_kda_shim.cu`` (built by ``kimik3 build-kernels``; no Python or torch ABI
in the library). Opt-in: ``--flash-kda <path to libkimik3_flash_kda.so>``; without it the
prefill runs fla-core's ``chunk_kda``.

It takes what FlashKDA takes: bf16 operands, K = V = 128, the bounded gate (K3's ``lower_bound``;
Kimi-Linear's softplus gate stays on fla). Its arithmetic differs from fla's and from our reference in
ways the library chose: the recurrent state is rounded to bf16 at every 16-token tile (fp32 only at the
ends), parts of the tile's triangular solve accumulate in fp16, and the sigmoids use ``tanh.approx``.
README "Decisions" says why we accept that (opt-in) and what the GPU test bounds.
"""

from __future__ import annotations

import ctypes

import torch

from kimik3.ops.cuda.loading import library, passed_over
from kimik3.ops.options import kernel_options

ENV = "KIMIK3_FLASH_KDA"        # the fallback of --flash-kda, read by engine/args.py alone
NAME = "--flash-kda / KIMIK3_FLASH_KDA"
HEAD_DIM = 128


def _declare(lib: ctypes.CDLL) -> None:
    lib.kimik3_flash_kda_workspace_bytes.restype = ctypes.c_int64
    lib.kimik3_flash_kda_workspace_bytes.argtypes = [ctypes.c_int64] * 3
    lib.kimik3_flash_kda_fwd.restype = ctypes.c_int
    lib.kimik3_flash_kda_fwd.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                                                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                                                  ctypes.c_float, ctypes.c_float, ctypes.c_int,
                                                                  ctypes.c_void_p]


def flash_kda_library() -> ctypes.CDLL | None:
    """The library ``KernelOptions.flash_kda`` names (loaded once per path), or None when unset."""
    return library(NAME, kernel_options().flash_kda, _declare, "kimik3 build-kernels")


def refusal(q: torch.Tensor, v: torch.Tensor, lower_bound: float | None) -> str | None:
    """Why FlashKDA cannot take this call, or None when it can: K3's bounded gate, bf16, K = V = 128."""
    if lower_bound is None:
        return "this model's KDA gate is the softplus form (Kimi-Linear; FlashKDA takes K3's bounded gate)"
    if q.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
        return f"the model runs in {q.dtype} (FlashKDA takes bf16)"
    if q.shape[-1] != HEAD_DIM or v.shape[-1] != HEAD_DIM:
        return f"the head dims are {q.shape[-1]} / {v.shape[-1]} (FlashKDA takes {HEAD_DIM})"
    return None


def flash_kda_applies(q: torch.Tensor, v: torch.Tensor, lower_bound: float | None) -> bool:
    """Whether this call goes to FlashKDA: the library is named, the call is on CUDA and ``refusal`` finds
    nothing (what it finds is logged once)."""
    if not q.is_cuda or not kernel_options().flash_kda:
        return False
    reason = refusal(q, v, lower_bound)
    if reason is not None:
        passed_over(NAME, reason, "KDA prefill runs fla-core's chunk_kda")
        return False
    return flash_kda_library() is not None


def flash_kda_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float, initial_state: torch.Tensor,
                     cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA over packed sequences: q, k (raw, L2-normalised inside), v, f (raw gate logits)
    [T, H, 128] bf16; b [T, H] raw beta logits; A_log [H]; dt_bias [H*128]; initial_state
    [N, H, 128, 128] fp32 V-first; cu_seqlens [N+1]. Returns o [T, H, 128] bf16 and the final states
    [N, H, 128, 128] fp32."""
    lib = flash_kda_library()
    T, H, K = q.shape
    N = cu_seqlens.numel() - 1
    if lib is None or not flash_kda_applies(q, v, lower_bound):
        raise ValueError(f"flash_kda_varlen: needs {NAME}, bf16 q/v with K = V = {HEAD_DIM} and a bounded gate; got "
                         f"{q.dtype} q {tuple(q.shape)}, v {tuple(v.shape)}, lower_bound {lower_bound}")
    if (k.shape != q.shape or v.shape[:2] != (T, H) or f.shape != q.shape or b.shape != (T, H)
            or tuple(initial_state.shape) != (N, H, K, K) or initial_state.dtype != torch.float32):
        raise ValueError(f"flash_kda_varlen: shapes do not agree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, f {tuple(f.shape)}, b {tuple(b.shape)}, initial_state "
                         f"{initial_state.dtype} {tuple(initial_state.shape)} for {N} sequences")
    if T == 0:
        return v.new_empty(v.shape), initial_state.clone()
    q, k, v, f = (t.to(torch.bfloat16).contiguous() for t in (q, k, v, f))
    beta_ht = b.to(torch.bfloat16).t().contiguous()                                  # [H, T]: the kernel's layout
    A_log = A_log.float().contiguous()
    dt_bias = dt_bias.float().contiguous()
    state0 = initial_state.contiguous()
    cu = cu_seqlens.to(device=q.device, dtype=torch.int64).contiguous()
    out = torch.empty_like(v)
    final = torch.empty_like(state0)
    workspace = torch.empty(lib.kimik3_flash_kda_workspace_bytes(T, H, N), dtype=torch.uint8, device=q.device)
    err = lib.kimik3_flash_kda_fwd(q.data_ptr(), k.data_ptr(), v.data_ptr(), f.data_ptr(), beta_ht.data_ptr(),
                                   state0.data_ptr(), final.data_ptr(), out.data_ptr(), workspace.data_ptr(), T, H, N,
                                   cu.data_ptr(), A_log.data_ptr(), dt_bias.data_ptr(), K ** -0.5, float(lower_bound),
                                   q.device.index if q.device.index is not None else torch.cuda.current_device(),
                                   torch.cuda.current_stream(q.device).cuda_stream)
    if err:
        raise RuntimeError(f"FlashKDA forward failed with CUDA error {err} (T={T}, H={H}, N={N})")
    return out, final
