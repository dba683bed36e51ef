"""MLA attention over a long cached context, one device call (~2 minutes of GPU time).

For H = 96 (K3 slice) and H = 32 (Kimi-Linear), d_qk 192 (128 nope + 64 rope), d_v 128, latent 512:
  (a) a chunk of 8192 queries over contexts 0, 8k, 32k, 128k, 512k, 1M through
      ``mla_prefill_attention``: the naive form at every context, the absorbed form where its 3.4x
      FLOPs stay affordable, and the replaced path (per-sequence SDPA with a boolean
      [chunk, context] mask over the whole up-projected history) where it fits memory;
  (b) short query runs (16, 128 and 512 queries per sequence, 4 sequences) over 32k and 1M
      contexts in both forms: where the absorbed form wins (``KernelTuning.mla_absorbed_max_query_len``);
  (c) a sweep of fixed kernel configs (BLOCK_M, BLOCK_N, num_warps, num_stages) on one piece:
      naive at H = 96, absorbed at H = 32 (``kimik3.ops.triton.mla_prefill.CONFIGS``).
  (d) decode (``mla_decode_triton``, split-K over the paged blocks, in CUDA graphs; H = 96, 32 and
      16, the heads a GPU holds of K3 at tensor parallelism 8 padded to a tile): batch 1 at
      contexts 4k-1M and batches 8-128, against the floor of reading each sequence's latents
      (context x 576 x 2 bytes) at the measured copy rate; ``--decode-sweep`` times the launch
      configs of DECODE_SWEEP beside the default; ``--decode-only`` runs this part alone.
Each timed case reports time, peak GPU memory above its inputs, attention FLOPs counted from the
shapes (causal: chunk x (context + chunk / 2) x H x 2 x (d_qk + d_v); the same count for both
forms), the naive form's up-projection FLOPs, achieved TFLOP/s and its ratio to the measured bf16
rate of an 8192^3 matmul, and the two forms' relative difference where both ran.

    PYTHONPATH=. python benchmarks/gpu/bench_mla_prefill.py --out $OUT/bench_mla_prefill.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from benchmarks.common import capture_graph, commit_id, copy_rate, cuda_time, matmul_rate, rel_err  # noqa: E402

from kimik3.ops.triton import mla_decode                           # noqa: E402
from kimik3.ops.triton.mla_decode import DecodeConfig              # noqa: E402

from kimik3.ops import ceil_div                                    # noqa: E402
from kimik3.ops.mla import gather_latents, mla_prefill_attention   # noqa: E402
from kimik3.ops.options import tuning                              # noqa: E402
from kimik3.ops.triton import mla_prefill                          # noqa: E402

R, P, DN, DV, BS = 512, 64, 128, 128, 64
DEVICE = "cuda"
D_QK = DN + P
CHUNK = 8192
CONTEXTS = (0, 8192, 32768, 131072, 524288, 1048576)
SHORT = [(16, 32768), (16, 1048576), (128, 32768), (128, 1048576), (512, 32768)]   # (queries, context) x 4 seqs
ABSORBED_MAX_CONTEXT = 131072           # absorbed at chunk 8192 beyond this costs seconds per rep
SDPA_MAX_BYTES = 40e9                   # the old path's [H, chunk, context] buffers (continuations) must fit
NAIVE_SWEEP = [(128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 2), (128, 32, 4, 2), (64, 128, 4, 3)]
ABSORBED_SWEEP = [(64, 32, 8, 2), (64, 64, 8, 1), (32, 64, 4, 2), (128, 32, 8, 1)]
log = logging.getLogger("bench_mla_prefill")


def inputs(H: int, query_lens: list[int], context_lens: list[int], seed: int = 0):
    """A paged latent cache holding every sequence's context + queries (blocks scattered), queries, kv_b."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    need = [ceil_div(c + q, BS) for c, q in zip(context_lens, query_lens)]
    cache = torch.randn(sum(need) + 1, BS, R + P, generator=g, device=DEVICE).to(torch.bfloat16)
    perm = torch.randperm(sum(need), generator=g, device=DEVICE).int() + 1
    tables = torch.zeros(len(need), max(need), dtype=torch.int32, device=DEVICE)
    used = 0
    for n, nb in enumerate(need):
        tables[n, :nb] = perm[used:used + nb]
        used += nb
    q = torch.randn(sum(query_lens), H, D_QK, generator=g, device=DEVICE).to(torch.bfloat16)
    kv_b = (torch.randn(H * (DN + DV), R, generator=g, device=DEVICE) / math.sqrt(R)).to(torch.bfloat16)
    return q, cache, tables, kv_b


def sdpa_per_sequence(q, cache, tables, kv_b, query_lens, context_lens, scale):
    """The path this replaces (kept here as the baseline): per sequence, the whole history
    up-projected, SDPA with a boolean [chunk, context] mask for continuations."""
    T, H, _ = q.shape
    out, start = torch.empty(T, H, DV, dtype=q.dtype, device=q.device), 0
    for n, (ql, cl) in enumerate(zip(query_lens, context_lens)):
        S = cl + ql
        e = gather_latents(cache, tables[n], S)
        kv = F.linear(e[:, :R], kv_b).view(S, H, DN + DV)
        key = torch.cat([kv[..., :DN], e[:, R:].unsqueeze(1).expand(S, H, P)], dim=-1)
        vs = F.pad(kv[..., DN:], (0, D_QK - DV))
        qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q[start:start + ql], key, vs))
        if cl == 0:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        else:
            allowed = torch.arange(S, device=q.device).view(1, S) <= torch.arange(cl, S, device=q.device).view(ql, 1)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale)
        out[start:start + ql] = o.squeeze(0).transpose(0, 1)[..., :DV]
        start += ql
    return out


def timed(fn, reps: int) -> tuple[float, int, torch.Tensor]:
    """(median seconds, peak bytes above what was allocated before, last output)."""
    out = fn()                                         # compile / warm-up, also the output kept
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t = cuda_time(fn, warmup=0, iters=reps)
    return t, torch.cuda.max_memory_allocated() - base, out


def attn_flops(query_lens, context_lens, H):
    return sum(ql * (cl + ql / 2) for ql, cl in zip(query_lens, context_lens)) * H * 2 * (D_QK + DV)


def case(rows, mm, H, query_lens, context_lens, forms, sdpa: bool):
    q, cache, tables, kv_b = inputs(H, query_lens, context_lens)
    scale = D_QK ** -0.5
    flops = attn_flops(query_lens, context_lens, H)
    up_flops = sum(c + q_ for c, q_ in zip(context_lens, query_lens)) * R * H * (DN + DV) * 2
    reps = 2 if flops > 1e14 else 5
    outs = {}
    runs = [(f, lambda f=f: mla_prefill_attention(q, cache, tables, kv_b, query_lens, context_lens, R, DV, scale,
                                                  form=f)) for f in forms]
    if sdpa:
        runs.append(("sdpa_per_sequence", lambda: sdpa_per_sequence(q, cache, tables, kv_b, query_lens,
                                                                    context_lens, scale)))
    for name, fn in runs:
        row = {"H": H, "query_lens": query_lens if len(query_lens) > 1 else query_lens[0],
               "context": context_lens[0] if len(set(context_lens)) == 1 else context_lens, "path": name,
               "attn_flops": flops, "upproj_flops": up_flops if name != "absorbed" else 0}
        try:
            t, peak, outs[name] = timed(fn, reps)
            row.update(seconds=t, peak_extra_bytes=peak, tflops=flops / t / 1e12, matmul_ratio=flops / t / mm,
                       tflops_with_upproj=(flops + row["upproj_flops"]) / t / 1e12)
        except torch.OutOfMemoryError as exc:
            row["error"] = f"out of memory: {str(exc)[:160]}"
        except Exception as exc:                         # keep going: one failure must not hide the rest
            row["error"] = repr(exc)[:400]
            traceback.print_exc()
        torch.cuda.empty_cache()
        rows.append(row)
        log.info("%s", {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()})
    if "naive" in outs and len(outs) > 1:
        ref = outs["naive"].double()
        for name, o in outs.items():
            if name != "naive":
                diff = rel_err(o, ref)
                next(r for r in rows[::-1] if r["path"] == name)["rel_diff_vs_naive"] = diff


def sweep(rows, mm, H, form, configs):
    """One piece: 8192 queries at positions 16384.. over 16384 keys, all visible (the common piece
    of a long context), then the causal piece of a fresh 8192 prompt."""
    g = torch.Generator(device=DEVICE).manual_seed(1)
    T, S = CHUNK, max(tuning().mla_prefill_block, CHUNK)
    DA, Hk, DVk = (DN, H, DV) if form == "naive" else (R, 1, R)
    bf = torch.bfloat16
    qa, qb = (torch.randn(T, H, d, generator=g, device=DEVICE).to(bf) for d in (DA, P))
    ka, kb = torch.randn(S, Hk, DA, generator=g, device=DEVICE).to(bf), torch.randn(S, 1, P, generator=g, device=DEVICE).to(bf)
    v = torch.randn(S, Hk, DVk, generator=g, device=DEVICE).to(bf) if form == "naive" else None
    ints = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)    # noqa: E731
    for label, kl, q0 in (("full", S, S), ("causal", T, 0)):
        flops = T * (kl if label == "full" else T / 2) * H * 2 * (D_QK + DV)
        for bm, bn, nw, ns in configs:
            cfg = mla_prefill.PrefillConfig(bm, bn, nw, ns)
            row = {"form": form, "H": H, "piece": label, "block_m": bm, "block_n": bn, "num_warps": nw,
                   "num_stages": ns, "default": cfg == mla_prefill.config_for(DA, DVk)}
            try:
                t0 = time.perf_counter()
                fn = lambda: mla_prefill.mla_prefill_triton(qa, qb, ka[:kl], kb[:kl], None if v is None else v[:kl],  # noqa: E731
                                                             ints([0, T]), ints([0, kl]), ints([q0]), ints([0]), T,
                                                             D_QK ** -0.5, bf, cfg)
                fn()
                torch.cuda.synchronize()
                row["compile_and_first_s"] = time.perf_counter() - t0
                t = cuda_time(fn, warmup=1, iters=5)
                row.update(seconds=t, tflops=flops / t / 1e12, matmul_ratio=flops / t / mm)
            except Exception as exc:                      # a config may not fit shared memory
                row["error"] = repr(exc)[:300]
            rows.append(row)
            log.info("%s", row)


DECODE_BS = 16                             # the engine's cache block size
DECODE_CASES = [(1, 4096), (1, 32768), (1, 131072), (1, 1048576), (8, 131072), (32, 4096), (32, 32768), (128, 4096)]
# the sweeps: the first (f510ef7) chose the default; the second (3ddadd8) also tried a lazy rescale
# and a hand prefetch in the paged form (both slower or equal, since removed) and 64-row gather
# tiles (10-20% faster at H = 96 up to 128k, not at 1M): results/mla_decode_sweep*_*.json. Every
# launch so far ran at 70-90 TFLOP/s (mma.sync tiles of 16-32 heads); the third sweep tries tiles
# Hopper's wgmma can take (64 heads a program, 64-128 token rows), with the output's 512 latent
# columns in one program (8 warps) or split over two (bv 256: the scores computed twice), and the
# products transposed (trans: 64-128 token rows as the M side, 32 heads as N: no padded heads at H = 96).
# It chose the third defaults (2-2.6x faster at H = 96; results/mla_decode_sweep3_1e66f41.json).
# Every launch of the third sweep ran out of registers (255 a thread: the gathered tile passes
# through them) or overlapped nothing (one stage: block ids, rows, products in turn). The fourth
# (935d67f) tried loading the next tile's block ids while a tile computes (no registers) on each
# default and beside 1-2 stages and 16-64 heads a program: never slower (2-6%, up to 18% with two
# programs an SM), so the gather form now always does it (results/mla_decode_sweep4_935d67f.json).
# Its first run (1af974a) stopped at an illegal address in the transposed 64-row one-stage launch
# (Triton 3.6; the interpreter runs it right), which took the context down: that launch and the
# rows prefetched into registers (450-950 bytes of spills a thread) are out of the list.
G = dict(form="gather", max_splits=256)
DECODE_SWEEP = [DecodeConfig(**G, bh=32, bn=128, trans=True, num_warps=8, num_stages=1, programs_per_sm=1),
                DecodeConfig(**G, bh=16, bn=128, trans=True, num_warps=8, num_stages=1, programs_per_sm=1),
                DecodeConfig(**G, bh=32, bn=64, trans=True, num_warps=8, num_stages=2, programs_per_sm=1),
                DecodeConfig(**G, bh=64, bn=64, num_warps=8, num_stages=2, programs_per_sm=1),
                DecodeConfig(**G, bh=32, bn=64, num_warps=8, num_stages=2, programs_per_sm=2),
                DecodeConfig(**G, bh=32, bn=64, num_warps=8, num_stages=2, programs_per_sm=1),
                # at 32 heads and 32-128 sequences (Kimi-Linear's batch decode, 2.5x its floor at 5091417):
                # more programs an SM, and three stages
                DecodeConfig(**G, bh=32, bn=64, num_warps=8, num_stages=2, programs_per_sm=4),
                DecodeConfig(**G, bh=32, bn=64, num_warps=4, num_stages=3, programs_per_sm=2),
                DecodeConfig(**G, bh=32, bn=32, num_warps=4, num_stages=3, programs_per_sm=4),
                # one sequence over a short context (the slices' batch-1 step at 4k: 32 programs of
                # 128 rows by default): more, smaller programs
                DecodeConfig(**G, bh=16, bn=64, trans=True, num_warps=4, num_stages=2, programs_per_sm=2),
                DecodeConfig(**G, bh=32, bn=32, trans=True, num_warps=4, num_stages=2, programs_per_sm=2),
                DecodeConfig(**G, bh=32, bn=64, trans=True, num_warps=4, num_stages=2, programs_per_sm=2)]


def kernel_info(fn) -> dict:
    """Run ``fn`` once with the decode pass-1 launch intercepted: whether its PTX issues wgmma
    (Hopper's warpgroup MMA) or only mma.sync, registers and spills per thread, shared memory."""
    jit = mla_decode._mla_decode_split_kernel
    seen = []

    class Spy:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                seen.append(jit[grid](*a, **kw))
                return seen[-1]
            return launch

    mla_decode._mla_decode_split_kernel = Spy()
    try:
        fn()
    finally:
        mla_decode._mla_decode_split_kernel = jit
    k = seen[-1]
    ptx = k.asm.get("ptx", "")
    return {"wgmma": "wgmma.mma_async" in ptx, "mma_sync": "mma.sync" in ptx, "regs": getattr(k, "n_regs", None),
            "spills": getattr(k, "n_spills", None), "shared": getattr(k.metadata, "shared", None)}


def graph_time(fn, iters: int = 20) -> float:
    """Median device seconds of ``fn`` captured in a CUDA graph (no launch overhead: as in the
    engine's decode graphs)."""
    graph, _ = capture_graph(fn)
    return cuda_time(graph.replay, warmup=2, iters=iters)


def decode(rows, bw, sweep: bool, cases=None):
    """(d): one query per sequence over ``ctx`` cached latents (block size 16, scattered blocks),
    sequence lengths on the device, each launch in a CUDA graph; floor = latent bytes / copy rate.
    The default launch (``mla_decode.config_for``) always, the sweep's configs with ``sweep``; the
    relative difference of each output from the default's."""
    global BS
    saved, BS = BS, DECODE_BS
    try:
        for H in (96, 32, 16):
            for n, ctx in (c for c in DECODE_CASES if not cases or f"{H}/{c[0]}/{c[1]}" in cases):
                q, cache, tables, _ = inputs(H, [1] * n, [ctx - 1] * n)
                q_lat = torch.randn(n, H, R, device=DEVICE).to(torch.bfloat16)
                lens = torch.full((n,), ctx, dtype=torch.int32, device=DEVICE)
                floor = n * ctx * (R + P) * 2 / bw
                default = mla_decode.config_for(H, DECODE_BS, ctx, n)
                ref = None
                for cfg in [None] + (DECODE_SWEEP if sweep else []):
                    fn = lambda cfg=cfg: mla_decode.mla_decode_triton(  # noqa: E731
                        q_lat, q[..., DN:], cache, tables, lens, ctx, D_QK ** -0.5, config=cfg)
                    row = {"H": H, "batch": n, "context": ctx, "config": vars(cfg or default), "default": cfg is None,
                           "floor_s": floor}
                    try:
                        row.update(kernel=kernel_info(fn))
                        t = graph_time(fn)
                        out = fn().double()
                        ref = out if ref is None else ref
                        row.update(seconds=t, over_floor=t / floor, rel_diff=rel_err(out, ref))
                    except Exception as exc:                      # a config may not fit the SM's memory
                        row["error"] = repr(exc)[:300]
                    rows.append(row)
                    log.info("decode %s", {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()})
                del q, cache, tables, ref
                torch.cuda.empty_cache()
    finally:
        BS = saved
    best = {}
    for r in rows:
        if "seconds" in r:
            k = (r["H"], r["batch"], r["context"])
            if k not in best or r["seconds"] < best[k]["seconds"]:
                best[k] = r
    for (H, n, ctx), r in best.items():
        log.info("decode best H=%d b%d ctx %d: %.4g x floor with %s", H, n, ctx, r["over_floor"], r["config"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--max-context", type=int, default=CONTEXTS[-1], help="skip longer contexts")
    ap.add_argument("--no-sweep", action="store_true", help="skip the kernel config sweep")
    ap.add_argument("--decode-only", action="store_true", help="run only (d), the decode cases")
    ap.add_argument("--decode-sweep", action="store_true", help="(d) also over the DECODE_SWEEP launch configs")
    ap.add_argument("--decode-cases", nargs="*", help="(d) only these cases, as H/batch/context (e.g. 96/1/131072)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t_start = time.perf_counter()
    res = {"commit": commit_id(), "gpu": torch.cuda.get_device_name(), "date": datetime.datetime.now(
        datetime.timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
        "prefill_block": tuning().mla_prefill_block, "absorbed_max_query_len": tuning().mla_absorbed_max_query_len,
        "configs": {f"{k[0]}/{k[1]}": vars(c) for k, c in mla_prefill.CONFIGS.items()}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        res["wall_s"] = time.perf_counter() - t_start
        out.write_text(json.dumps(res, indent=1))

    bw = res["copy_bytes_per_s"] = copy_rate()
    res["decode"] = []
    decode(res["decode"], bw, args.decode_sweep, args.decode_cases)
    save()
    if args.decode_only:
        return
    mm = res["bf16_matmul_flops"] = matmul_rate()
    log.info("bf16 matmul %.0f TFLOP/s", mm / 1e12)
    res["chunk"], res["short"], res["sweep"] = [], [], []
    for H in (96, 32):
        for ctx in (c for c in CONTEXTS if c <= args.max_context):
            forms = ["naive"] + (["absorbed"] if ctx <= ABSORBED_MAX_CONTEXT else [])
            sdpa = ctx == 0 or H * CHUNK * (ctx + CHUNK) * 2 <= SDPA_MAX_BYTES
            case(res["chunk"], mm, H, [CHUNK], [ctx], forms, sdpa)
            torch.cuda.empty_cache()                     # the case's inputs are gone with it
            save()
        for ql, ctx in SHORT:
            if ctx <= args.max_context:
                case(res["short"], mm, H, [ql] * 4, [ctx] * 4, ["naive", "absorbed"], False)
                torch.cuda.empty_cache()
                save()
    if not args.no_sweep:
        sweep(res["sweep"], mm, 96, "naive", NAIVE_SWEEP)
        save()
        sweep(res["sweep"], mm, 32, "absorbed", ABSORBED_SWEEP)
    save()
    log.info("wrote %s (%.0f s)", out, res["wall_s"])


if __name__ == "__main__":
    main()
