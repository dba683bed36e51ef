"""The ops' options, built once: which kernel libraries run (FlashMLA, FlashKDA), programmatic dependent
launch and L2 prefetch, and the measured thresholds where one implementation hands over to another
(``KernelTuning``). Nothing in ``kimik3.ops`` or ``kimik3.model`` reads an environment variable: the engine
resolves ``EngineArgs`` (a flag each; the variables ``KIMIK3_FLASH_MLA``, ``KIMIK3_FLASH_KDA``,
``KIMIK3_PDL``, ``KIMIK3_PREFETCH`` as the fallback, read in ``engine/args.py`` alone) into one
``KernelOptions`` and installs it when it builds the model (``install_kernel_options``). Tests and
benchmarks run a piece of code under other options with ``use_kernel_options(KernelOptions(...))``, scoped
to the current thread/context (a benchmark's setting does not change what a server thread runs).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class KernelTuning:
    """Where one implementation hands over to another. Each value was measured; its reason stands beside it
    (benchmarks named, card and commit). 0 / False turns a fast path off where a comment says so."""

    # ---- projections (ops/linear.py) ----
    # Rows (tokens) up to which a projection takes the streaming kernel on CUDA (0: never). One row: on the
    # lent GPU (H100, e9088c3 / 12cf350) it beat cuBLAS at M = 1 on 14 of the 19 slice shapes (up to 1.4x)
    # and made the slices' batch-1 step 0.8-2.6% faster; from 4 rows it lost on most shapes (bench_gemv.py).
    gemv_max_rows: int = 1
    # Below this reduction length cuBLAS stays faster (K3's f_b, K = 128: 4.1 against 4.3-4.6 us).
    gemv_min_k: int = 512
    # Host (CPU) projections of this many rows (inclusive range) compute x W^T as (W x^T)^T, the weight as the
    # GEMM's first operand (``ops.linear._weight_first``; the routed experts' GEMMs too); (0, -1): never. MKL
    # on this box's EPYC (one thread, fp32, 2026-12-07): with the weights out of cache, as a step reads them,
    # 0.4-0.7x F.linear's time at 2-8 rows (1092 x 256: 159 against 268 us at 5 rows), 1.0-1.4x from 16 rows
    # (in cache it is 1.5-2x slower: a micro-benchmark that repeats one weight misleads). The default model's
    # steps, interleaved A/B against (0, -1): verify step b1 (5 rows) 13.66 against 15.72 ms, b32 (160 rows)
    # 70.3 / 74.1, decode b32 25.5 / 26.4, b1 even; (2, 16) and (2, 48) were no faster at b32.
    host_weight_first_rows: tuple[int, int] = (2, 8)

    # ---- router logits (ops/router.py) ----
    # 16-bit weight: the SIMT kernel up to this many logits (tokens x experts), then the tensor-core GEMM
    # kernel (exact 16-bit products). The SIMT kernel's time grows with T x E x D, the GEMM kernel's at decode
    # sizes with D alone (a latency-bound walk over the width), so they cross at a fixed T x E. H200
    # (bench_router_align.py, bf16 weight, 2d76027): SIMT 4.4 / 6.2 / 10.3 us against the GEMM's 5.4 at
    # 8 / 16 / 32 tokens x 256 experts (D 2304); 9.7 / 14.0 against 13.8 at 32 / 64 x 64 (D 7168); 5.4 / 19.1
    # against 13.9 at 1 / 8 x 896 (D 7168). Both replace the cast of x and of the weight to fp32 and cuBLAS's
    # fp32 GEMM (8.7-24.9 us at one token, 19-83 at 8-16: every checkpoint's path before).
    router_logits_simt_max_logits: int = 4096
    # fp32 weight: the SIMT kernel up to this many tokens (router_logits_max_tokens_large for weights over 2**20
    # elements); beyond, cuBLAS's fp32 GEMM on the upcast x, and from router_logits_gemm_min_logits logits
    # (prefill chunks) the tensor-core kernel with TF32 x3 products. H200 (6e3384c): Kimi-Linear's 256 x 2304
    # weight 2.0x / 1.2x faster than the cast + GEMM at 32 / 64 tokens, 1.05x at 128; K3 release's 896 x 7168
    # 2.3x at 16 tokens but 0.66x at 32; the TF32 x3 kernel 167 / 450 us against 262 / 570 us at (8192
    # tokens, 256 experts) / (2048, 896), slower below (123 against 87 us at (2048, 256)).
    router_logits_max_tokens: int = 64
    router_logits_max_tokens_large: int = 16
    router_logits_gemm_min_logits: int = 1 << 20
    # ``route_tokens`` with a 16-bit weight from router_split_min_tokens to router_split_max_tokens tokens:
    # split-K partial logits (``triton/router.py: router_logit_partials``) that the routing kernel sums, in
    # place of the SIMT kernel (4.4-8.0 us at 8-16 tokens x 64-256 experts, 19-25 at 896) or the unsplit GEMM
    # (13.8 / 5.4 us at D = 7168 / 2304, a latency-bound walk over the width). The bounds sit just past / at
    # powers of two, so a step and the CUDA graph it is padded to (``cuda_graphs.graph_batch_sizes``: 1, 2,
    # 4, 8, ...) take the same path and the same bits (an eager step of 5-7 tokens and its 8-row graph both
    # split; otherwise a greedy token could differ between the two at an expert near-tie: seen on the H100
    # at 7f26387).
    router_split_min_tokens: int = 5
    router_split_max_tokens: int = 256
    # The split-K logits cut the width into splits of at least this many K steps until about
    # router_split_target_programs programs run (the unsplit GEMM's time at up to 256 tokens is its walk over
    # the width: 13.8 us at D = 7168 whatever T and E on the H200, 5.4 at 2304). A fixed program target (not
    # the device's SM count): the partials, and so the logits' last bits, depend on T alone. Swept by
    # bench_router_align.py --split-only.
    router_split_min_steps: int = 4
    router_split_target_programs: int = 128

    # ---- routed experts (ops/triton/moe.py) ----
    # Up to this many (token, expert) assignments one Triton launch sorts them by expert (decode); beyond,
    # torch ops (-1: always torch). bench_moe.py / bench_router_align.py compare the two.
    align_kernel_max_rows: int = 4096
    # MXFP4 experts at decode sizes through ``moe_wgmma`` where it fits (``_wgmma_tiles``); False: the block
    # kernels. H100, K3 slice shapes (64 experts, 3584 -> 3072, top-16; bench_moe.py --wgmma, ff201cc), against
    # the block kernels: 1 token 0.132 against 0.186 ms, 8 tokens 0.436 / 0.595, 32 tokens 0.490 / 0.651,
    # 128 tokens 0.732 / 1.011 (bench_slice.py --wgmma-ab).
    wgmma_experts: bool = True
    # From this many rows per expert, dense bf16 experts run as torch._grouped_mm (CUTLASS grouped GEMMs)
    # beside our sort, gating and combine: measured on the H200 at the Kimi-Linear width (bench_slice.py,
    # 6344050, the library on pre-sorted tokens) it was 0.94x our tiles' time at 32 rows per expert, 0.71x at
    # 64 (2048 tokens, top-8 of 256); the gather and combine around it add ~2 x T x k x L x 2 bytes, so the
    # switch is at 64.
    grouped_mm_rows_per_expert: int = 64
    # One token with dense experts: its k experts' gate/up and down read as streaming products, the combine
    # in the down launch (``kimik3.ops.triton.gemv.one_token_experts``: two launches where the block kernels
    # take three, and no tensor-core tile of which one row is used). H100 (bench_slice.py --one-token-ab):
    # the Kimi-Linear slice's batch-1 step 2.3% (04c7b10) and 1.6% (0a2ea22) faster. False: the block kernels.
    one_token_gemv: bool = True
    # From this many rows per expert (prefill), MXFP4 experts are dequantized to bf16 a chunk of experts at a
    # time and run as torch._grouped_mm, as dense experts are: where the products dominate, the library's
    # bf16 tiles beat our fused dequantizing kernels, and the dequantization (4 bytes written and reread per
    # weight element) is repaid. H200, K3 slice shapes (64 experts, 3584 -> 3072, top-16; bench_moe.py
    # --prefill-only, results/moe_prefill_65bef5e.json), fused / grouped time: 0.40x at 128 rows an expert,
    # 0.64x at 256, 0.99x at 512, 1.29x at 1024, 1.45x at 2048 (17.3 against 25.1 ms a layer: 502 TFLOP/s).
    mxfp4_grouped_mm_rows_per_expert: int = 1024
    # bf16 scratch of one chunk's gate | up weights (the down weights take half of it again): a memory
    # bound, not a speed choice.
    mxfp4_dequant_chunk_bytes: int = 256 << 20
    # FP8 experts (``--quantization fp8`` of bf16 experts, Kimi-Linear's): from this many rows per expert on
    # average the activations are quantised on the fly (per row and 128 columns, power-of-two scales) and the
    # products run on the FP8 tensor cores; below it (decode) the E4M3 weights are widened to the activations'
    # dtype in the kernel (a one-byte weight stream, the activations as they are). Not measured yet (no GPU
    # while it was written): where compute starts to matter on an H100 at Kimi-Linear widths by the
    # arithmetic (~32 rows an expert for bf16 tiles); ``benchmarks/gpu/bench_fp8.py --experts`` sweeps it.
    fp8_experts_quant_rows_per_expert: int = 32
    # W4A8 (``KernelOptions.w4a8_moe``): from this many rows per expert, MXFP4 experts take the MXFP8 x
    # MXFP4 kernels in place of the bf16 block kernels and the dequantise-then-grouped-GEMM path; below it the
    # decode kernels (``moe_wgmma``, memory bound) keep bf16 activations: the top of ``_wgmma_tiles``' range.
    # Not measured yet (``benchmarks/gpu/bench_fp8.py --w4a8`` sweeps it).
    w4a8_rows_per_expert: int = 48

    # ---- KDA (ops/kda.py) ----
    # A CUDA decode step of at most this many sequences computes ``LowRank`` operands inside its kernel (one
    # launch fewer a KDA layer); larger ones compute them first, as every other path does (0: always first).
    # Each (sequence, head) program then reads its head's rows of the up-projection from L2, which pays at
    # small batches and costs at large ones: H200 at 092fe21 (``bench_slice.py --low-rank-ab``, in-kernel
    # against computed first, ms): Kimi-Linear slice 0.582 / 0.607 at batch 1, 0.852 / 0.863 at 8, 1.200 /
    # 1.209 at 32, 2.054 / 2.027 at 128; K3 slice 2.491 / 2.513, 3.357 / 3.373, 4.287 / 4.258, 7.555 / 7.434.
    decode_low_rank_max_seqs: int = 16

    # ---- MLA prefill (ops/mla.py, ops/triton/mla_prefill.py) ----
    # Context positions per prefill attention piece: a piece's keys, over all sequences of the step, are at
    # most this many, so the naive form's up-projected per-head K/V buffer stays at
    # prefill_block x H x (d_nope + d_v) x 2 bytes (16384 x 96 x 256 x 2 = 0.8 GB for K3): a memory bound.
    mla_prefill_block: int = 16384
    # prefill_form picks the absorbed form for a sequence with cached context and fewer new tokens than this.
    # FLOPs per key and head, for q new tokens: naive q x 2 x (192 + 128) plus the up-projection 2 x 512 x 256
    # (every step re-expands the history), absorbed q x 2 x (576 + 512): naive wins by FLOPs from ~170
    # tokens; the absorbed kernel's wider tiles run slower, so the cut sits below that. Measured on the H200
    # (bench_mla_prefill.py "short" rows, 4 sequences, commit c5d62e8): 16 tokens over 32k / 1M at H=96,
    # absorbed 6.3 / 223 ms vs naive 11.0 / 331 ms; 128 tokens, absorbed 28.7 / 889 ms vs naive 11.2 / 350 ms
    # (at H=32 the two are within 15% at 128).
    mla_absorbed_max_query_len: int = 64
    # Split-K prefill: each split at least this many key tiles (about two waves of programs fill the GPU).
    mla_prefill_split_min_tiles: int = 4

    # ---- the MoE block (model/moe.py) ----
    # Batches up to this many tokens run the router and the shared experts on a side CUDA stream (when the
    # model was given one), beside the routed down-projection and the routed experts.
    side_stream_max_tokens: int = 256


@dataclass(frozen=True)
class KernelOptions:
    """The ops' options. ``flash_mla`` / ``flash_kda``: the path of the library built by
    ``kimik3 build-kernels`` (``kimik3/kernels.py``) (None: our Triton MLA decode / fla-core's KDA
    prefill). ``pdl``: launch our Triton kernels with programmatic dependent launch on Hopper and later
    (``triton/common.py``); ``prefetch``: the L2 prefetch ahead of the PDL wait (H100, 0a2ea22: the batch-1
    steps 1.3% (Kimi-Linear slice) and 0.6% (K3 slice) faster). ``cpu_kernels``: the fast paths take CPU
    tensors too, their Triton kernels running in Triton's interpreter (``TRITON_INTERPRET=1`` before the kernels
    are built): how the CPU tests run the kernels and their dispatch; never the default. ``w4a8_moe``: MXFP4
    routed experts (K3) at ``KernelTuning.w4a8_rows_per_expert`` rows per expert and more compute with their
    activations quantised to MXFP8 on the fly (E4M3, one power-of-two scale per 32 values, as K3's experts
    are reported to have been trained) on the FP8 tensor cores (``ops/triton/moe.py``, W4A8); the CPU
    reference rounds the same way. Off by default: not yet measured a win on a GPU (EngineArgs
    ``enable_w4a8_moe``, docs/gpu.md)."""

    flash_mla: str | None = None
    flash_kda: str | None = None
    pdl: bool = True
    prefetch: bool = True
    cpu_kernels: bool = False
    w4a8_moe: bool = False
    tuning: KernelTuning = field(default_factory=KernelTuning)

    def tuned(self, **changes) -> KernelOptions:
        """These options with some ``KernelTuning`` values changed (an unknown name is an error)."""
        return dataclasses.replace(self, tuning=dataclasses.replace(self.tuning, **changes))


_installed = KernelOptions()
_scoped: contextvars.ContextVar[KernelOptions | None] = contextvars.ContextVar("kimik3_kernel_options", default=None)


def kernel_options() -> KernelOptions:
    """The options in force: the scoped ones (``use_kernel_options``), else the installed ones."""
    scoped = _scoped.get()
    return _installed if scoped is None else scoped


def tuning() -> KernelTuning:
    return kernel_options().tuning


def install_kernel_options(options: KernelOptions) -> None:
    """Make ``options`` the process's options (the engine, once, when it builds the model: one engine's
    kernel options per process)."""
    global _installed
    if not isinstance(options, KernelOptions):
        raise TypeError(f"install_kernel_options takes a KernelOptions, got {type(options).__name__}")
    _installed = options


@contextlib.contextmanager
def use_kernel_options(options: KernelOptions):
    """Run the block under ``options`` (this thread/context only)."""
    if not isinstance(options, KernelOptions):
        raise TypeError(f"use_kernel_options takes a KernelOptions, got {type(options).__name__}")
    token = _scoped.set(options)
    try:
        yield options
    finally:
        _scoped.reset(token)
