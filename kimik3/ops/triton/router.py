"""The MoE router's kernels (spec text-backbone §3.1-3.4).

Logits: x [T, D] (bf16/fp16, read in its own dtype and upcast in registers) times the gate weight
[E, D] (the checkpoint's bf16, or fp32), fp32 products accumulated in fp32 (no TF32, no tensor
cores). A grid of (token block, expert block) programs, no atomics; at decode sizes the expert
blocks are small, so enough programs stream the weight at memory speed. (tl.dot in IEEE fp32,
Triton's FMA path, ran 5-20x slower than this on the H200 at 32-256 tokens.) Longer steps take a
tensor-core GEMM at fp32 accuracy: with a 16-bit weight of x's dtype a plain bf16/fp16 product
(each product of two 16-bit values is exact in fp32), with an fp32 weight TF32 x3. At decode sizes the
same GEMM kernel splits the width (split-K: partials [S, T, E], no atomics) and the routing kernel sums
the partials in split order (``router_logit_partials``, ``route_triton``).

Routing: scores (sigmoid or softmax), bias-corrected grouped top-k, unbiased weights,
renormalisation and scaling in one kernel, one program per token; the top-k is k rounds of
argmax over the (masked) expert row, so ids come out in descending order of the biased score,
as ``torch.topk`` gives them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimik3.ops.options import tuning
from kimik3.ops.triton.common import INTERPRETING, dot, pdl, pdl_entry


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, E, stride_s, stride_t, per_group, scaling, eps,
                  HAS_BIAS: tl.constexpr, SIGMOID: tl.constexpr, RENORM: tl.constexpr,
                  TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr,
                  TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr, SPLITS: tl.constexpr,
                  PDL: tl.constexpr):
    pdl_entry(PDL)
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    x = tl.load(logits_ptr + t * stride_t + offs, mask=valid, other=float("-inf")).to(tl.float32)
    for s in tl.static_range(1, SPLITS):        # split-K partial logits, summed in split order
        x += tl.load(logits_ptr + s * stride_s + t * stride_t + offs, mask=valid, other=0.0).to(tl.float32)
    if SIGMOID:
        scores = tl.sigmoid(x)
    else:
        e = tl.exp(x - tl.max(x, axis=0))
        scores = e / tl.sum(e, axis=0)
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if GROUPS > 1:
        # group score = sum of its two best biased scores; keep the TOPK_GROUP best groups
        group = offs // per_group
        goffs = tl.arange(0, BLOCK_G)
        gscore = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for g in tl.static_range(GROUPS):
            in_g = group == g
            row = tl.where(in_g, choice, float("-inf"))
            first = tl.argmax(row, axis=0)
            best = tl.max(row, axis=0)
            second = tl.max(tl.where(offs == first, float("-inf"), row), axis=0)
            gscore = tl.where(goffs == g, best + second, gscore)
        keep = offs < 0
        for _ in tl.static_range(TOPK_GROUP):
            gi = tl.argmax(gscore, axis=0)
            keep = keep | (group == gi)
            gscore = tl.where(goffs == gi, float("-inf"), gscore)
        choice = tl.where(keep, choice, float("-inf"))
    koffs = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int64)
    for i in tl.static_range(TOP_K):
        j = tl.argmax(choice, axis=0)
        w = tl.where(koffs == i, tl.sum(tl.where(offs == j, scores, 0.0), axis=0), w)
        ids = tl.where(koffs == i, j.to(tl.int64), ids)
        choice = tl.where(offs == j, float("-inf"), choice)
    if RENORM:
        w = w / (tl.sum(w, axis=0) + eps)
    w = w * scaling
    kmask = koffs < TOP_K
    tl.store(weights_ptr + t * TOP_K + koffs, w, mask=kmask)
    tl.store(ids_ptr + t * TOP_K + koffs, ids, mask=kmask)


# Warps of a routing program (one token row): its top-k is k rounds of argmax over the row, each a
# reduction whose cross-warp step goes through shared memory with barriers; the whole row in one warp
# reduces by shuffles alone. ``bench_router_align.py --route-only`` (H100, 12cf350): one warp takes
# 2.7 us for 256 experts top-8 (4 warps: 4.0) and 3.3 for 64 top-16 (6.1); for K3's 896 experts four
# warps do (8.0 us, one warp 10.0).
def route_warps(num_experts: int) -> int:
    return 1 if num_experts <= 256 else 4


def route_triton(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, activation: str,
                 num_expert_group: int, topk_group: int, renormalize: bool, scaling_factor: float,
                 renorm_eps: float, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``kimik3.ops.router.route`` for fp32 logits [T, E], or for their S split-K
    partials [S, T, E] (``router_logit_partials``: the kernel sums them, in split order); num_warps:
    override ``route_warps(E)`` (benchmarks)."""
    logits = logits.contiguous()
    parts = logits if logits.dim() == 3 else logits.unsqueeze(0)
    S, T, E = parts.shape
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    grouped = num_expert_group > 1 and num_expert_group > topk_group
    groups = num_expert_group if grouped else 1
    if T:
        _route_kernel[(T,)](
            parts, bias if bias is not None else parts, weights, ids, E, parts.stride(0), parts.stride(1),
            E // groups, float(scaling_factor), float(renorm_eps),
            HAS_BIAS=bias is not None, SIGMOID=activation == "sigmoid", RENORM=renormalize and top_k > 1,
            TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), GROUPS=groups, TOPK_GROUP=topk_group,
            BLOCK_G=triton.next_power_of_2(groups), BLOCK_E=triton.next_power_of_2(E), SPLITS=S,
            num_warps=num_warps or route_warps(E), **pdl(logits))
    return weights, ids


@triton.jit
def _logits_kernel(x_ptr, w_ptr, out_ptr, T, E, D, stride_xt, stride_xd, stride_we, stride_wd,
                   BT: tl.constexpr, BE: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr):
    """out[t, e] = sum_d fp32(x[t, d]) * w[e, d] for this program's BT tokens and BE experts: the
    products accumulate elementwise in a [BT, BE, BD] fp32 tile, summed over BD at the end."""
    pdl_entry(PDL)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    d = tl.arange(0, BD)
    xp = x_ptr + t[:, None].to(tl.int64) * stride_xt + d[None, :] * stride_xd
    wp = w_ptr + e[:, None].to(tl.int64) * stride_we + d[None, :] * stride_wd
    acc = tl.zeros([BT, BE, BD], tl.float32)
    for d0 in range(0, D, BD):
        md = (d0 + d < D)[None, :]
        xv = tl.load(xp, mask=(t < T)[:, None] & md, other=0.0).to(tl.float32)
        wv = tl.load(wp, mask=(e < E)[:, None] & md, other=0.0).to(tl.float32)
        acc += xv[:, None, :] * wv[None, :, :]
        xp += BD * stride_xd
        wp += BD * stride_wd
    out = tl.sum(acc, axis=2)
    tl.store(out_ptr + t[:, None] * E + e[None, :], out, mask=(t < T)[:, None] & (e < E)[None, :])


def logits_config(T: int, E: int) -> dict:
    """Tiles of ``router_logits_triton`` for T tokens and E experts: BT tokens x BE experts per
    program, BD of the hidden width per step (BT x BE x BD = 4096 products in flight), warps.
    The best of a sweep on the H200 (benchmarks/gpu/bench_router_align.py --sweep): while the
    weight read dominates, small expert blocks (one expert, and one token when E < 128) give
    enough programs to stream it; more tokens take larger expert blocks (more reuse per load)."""
    if T <= 16:
        BT, BE = (1 if T == 1 or E < 128 else min(8, triton.next_power_of_2(T))), (2 if E > 256 else 1)
    else:
        BT, BE = 8, (1 if E < 128 else 2 if T <= 32 else 4)
    return dict(BT=BT, BE=BE, BD=4096 // (BT * BE), warps=4)


def _check_operands(name: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype not in (torch.float32, x.dtype):
        raise ValueError(f"{name} takes bf16/fp16 x and an fp32 weight or one of x's dtype, got {x.dtype} and "
                         f"{weight.dtype}")


def router_logits_triton(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [T, D] bf16/fp16 (any strides), weight [E, D] fp32 or x's dtype -> logits [T, E] fp32 =
    fp32(x) @ fp32(weight)^T with fp32 products and fp32 accumulation (no TF32), deterministic for a
    given T. config: override ``logits_config(T, E)`` (benchmarks)."""
    _check_operands("router_logits_triton", x, weight)
    (T, D), E = x.shape, weight.shape[0]
    if weight.shape[1] != D:
        raise ValueError(f"x has width {D} but the router weight is {tuple(weight.shape)}")
    out = torch.empty(T, E, dtype=torch.float32, device=x.device)
    cfg = config or logits_config(T, E)
    if T:
        grid = (triton.cdiv(T, cfg["BT"]), triton.cdiv(E, cfg["BE"]))
        _logits_kernel[grid](x, weight, out, T, E, D, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
                             BT=cfg["BT"], BE=cfg["BE"], BD=cfg["BD"], num_warps=cfg["warps"], **pdl(x))
    return out


@triton.jit(do_not_specialize=["T"])         # one compile for every step size
def _logits_gemm_kernel(x_ptr, w_ptr, out_ptr, T, E, D, KS, stride_xt, stride_we,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WIDE_W: tl.constexpr,
                        UPCAST: tl.constexpr, PDL: tl.constexpr):
    """out = fp32(x) @ fp32(w)^T for BM tokens x BN experts on tensor cores at fp32 accuracy, fp32
    accumulation. WIDE_W (fp32 weight): TF32 x3 (each operand split into a TF32 part and a TF32
    remainder; x's remainder is zero, a bf16/fp16 value being exact in TF32). Otherwise w has x's
    16-bit dtype and the plain 16-bit product is exact: 8 (bf16) or 11 (fp16) significant bits
    squared fit fp32's 24. Split-K: program (.., .., s) sums the width [s KS, (s + 1) KS) into
    partial s of out [S, T, E] (KS a multiple of BK; one split: KS >= D)."""
    pdl_entry(PDL)
    t = tl.program_id(0) * BM + tl.arange(0, BM)
    e = tl.program_id(1) * BN + tl.arange(0, BN)
    s = tl.program_id(2)
    k = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    k_end = tl.minimum(D, (s + 1) * KS)
    for k0 in range(s * KS, k_end, BK):
        mk = (k0 + k < k_end)[None, :]
        xv = tl.load(x_ptr + t[:, None].to(tl.int64) * stride_xt + (k0 + k)[None, :], mask=(t < T)[:, None] & mk,
                     other=0.0)
        wv = tl.load(w_ptr + e[:, None].to(tl.int64) * stride_we + (k0 + k)[None, :], mask=(e < E)[:, None] & mk,
                     other=0.0)
        if WIDE_W:
            acc = tl.dot(xv.to(tl.float32), tl.trans(wv), acc, input_precision="tf32x3")
        else:
            acc = dot(xv, tl.trans(wv), acc, UPCAST)
    out_ptr += s.to(tl.int64) * T * E
    tl.store(out_ptr + t[:, None].to(tl.int64) * E + e[None, :], acc, mask=(t < T)[:, None] & (e < E)[None, :])


def gemm_tiles(T: int, E: int, wide_weight: bool) -> tuple[int, int, int, int]:
    """Tiles of ``router_logits_gemm_triton``: (tokens, experts, K step, warps). The fp32 weight's TF32
    x3 kernel keeps its measured 128 x 64 tiles (it runs only from 2**20 logits). The 16-bit weight's
    kernel, from the H200 sweep (bench_router_align.py, 2d76027): up to 256 tokens 16-expert tiles with
    128-wide K steps (5.4 / 13.8 us at D 2304 / 7168, every E and T measured); beyond, 64 x 64 tiles, and
    128 x 128 ones from 2**21 logits (306 against 444 us for 128 x 64 at 8192 tokens x 896 experts)."""
    if wide_weight:
        return 128, 64, 32, 4
    if T <= 256:
        return 64, 16, 128, 4
    return (128, 128, 64, 8) if T * E >= 1 << 21 else (64, 64, 64, 4)


def router_logits_gemm_triton(x: torch.Tensor, weight: torch.Tensor, tiles: tuple[int, int, int, int] | None = None
                              ) -> torch.Tensor:
    """x [T, D] bf16/fp16 (unit feature stride), weight [E, D] fp32 or x's dtype (unit feature stride)
    -> logits [T, E] fp32 for long steps (prefill): tensor-core products at fp32 accuracy (exact 16-bit
    products, or TF32 x3 for an fp32 weight), fp32 accumulation, no upcast copy of x or the weight.
    tiles: (tokens, experts, K step, warps); default ``gemm_tiles``."""
    _check_operands("router_logits_gemm_triton", x, weight)
    (T, D), E = x.shape, weight.shape[0]
    if weight.shape[1] != D or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"router_logits_gemm_triton: x {tuple(x.shape)} and weight {tuple(weight.shape)} need one "
                         f"width and unit feature strides")
    wide = weight.dtype == torch.float32
    BM, BN, BK, warps = tiles or gemm_tiles(T, E, wide)
    out = torch.empty(T, E, dtype=torch.float32, device=x.device)
    if T:
        _logits_gemm_kernel[(triton.cdiv(T, BM), triton.cdiv(E, BN), 1)](
            x, weight, out, T, E, D, triton.cdiv(D, BK) * BK, x.stride(0), weight.stride(0), BM=BM, BN=BN, BK=BK,
            WIDE_W=wide, UPCAST=INTERPRETING, num_warps=warps, **pdl(x))
    return out


# Split-K logits (``router_logit_partials``) for decode-sized steps: the unsplit GEMM's time at up to 256 tokens
# is its walk over the width (13.8 us at D = 7168 whatever T and E on the H200, 5.4 at 2304: a handful of
# programs, 56 / 18 dependent K steps each), so the width is cut into splits of at least
# ``KernelTuning.router_split_min_steps`` K steps until about ``router_split_target_programs`` programs run; the
# routing kernel sums the partials. A fixed program target (not the device's SM count): the partials, and so the
# logits' last bits, depend on T alone.


def split_tiles(T: int, E: int, D: int) -> tuple[int, int, int, int, int]:
    """(tokens, experts, K step, warps, splits) of ``router_logit_partials`` for T tokens, E experts, width D,
    sized by the next power of two of T: a step and the CUDA graph it is padded to split alike (same bits)."""
    T = triton.next_power_of_2(T)
    BM = 16 if T <= 16 else 32 if T <= 32 else 64
    BN = 16 if E <= 64 else 32 if E <= 256 else 64
    BK = 128
    steps = triton.cdiv(D, BK)
    blocks = triton.cdiv(T, BM) * triton.cdiv(E, BN)
    tune = tuning()
    S = max(1, min(steps // tune.router_split_min_steps, triton.cdiv(tune.router_split_target_programs, blocks)))
    S = triton.cdiv(steps, triton.cdiv(steps, S))       # no empty split
    return BM, BN, BK, 4, S


def router_logit_partials(x: torch.Tensor, weight: torch.Tensor,
                          tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [T, D] bf16/fp16 (unit feature stride) and a weight [E, D] of x's dtype (unit feature stride) ->
    split-K partial logits [S, T, E] fp32 (their sum over S, in order, is the logits: exact 16-bit products,
    fp32 accumulation), for ``route_triton``. tiles: (tokens, experts, K step, warps, splits); default
    ``split_tiles``."""
    _check_operands("router_logit_partials", x, weight)
    (T, D), E = x.shape, weight.shape[0]
    if weight.dtype != x.dtype or weight.shape[1] != D or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"router_logit_partials: x {x.dtype} {tuple(x.shape)} and weight {weight.dtype} "
                         f"{tuple(weight.shape)} need one dtype, one width and unit feature strides")
    BM, BN, BK, warps, S = tiles or split_tiles(T, E, D)
    KS = triton.cdiv(triton.cdiv(D, BK), S) * BK
    S = triton.cdiv(D, KS)
    out = torch.empty(S, T, E, dtype=torch.float32, device=x.device)
    if T:
        _logits_gemm_kernel[(triton.cdiv(T, BM), triton.cdiv(E, BN), S)](
            x, weight, out, T, E, D, KS, x.stride(0), weight.stride(0), BM=BM, BN=BN, BK=BK, WIDE_W=False,
            UPCAST=INTERPRETING, num_warps=warps, **pdl(x))
    return out
