"""One device call: (a) every fast op vs its torch reference, (b) the two ceilings (copy bandwidth,
bf16 matmul rate), (c) a 4-layer slice (3 KDA + 1 MLA) with random weights: decode at batch
1/8/32/128 over a 4k context and an 8k-token prefill, each with the bytes and FLOPs counted from
the shapes, the floor from the measured ceilings, time/floor, and the speed-up over the eager torch
reference path (same GPU; reference prefill on 2k tokens, see table).

Slices: ``kimi-k3-slice4.config.json`` (K3 width, 64 MXFP4 experts top-16, the default) and
``kimi-linear-slice4.config.json`` (Kimi-Linear-48B width: 256 bf16 experts top-8 at 1024).

    PYTHONPATH=. python benchmarks/gpu/bench_slice.py [--config=PATH]   (writes $OUT/bench_slice[_NAME].json)

``--pdl-ab``: every case also without programmatic dependent launch (``KernelOptions.pdl``
off: our kernels launched the ordinary way), in the same process, so the two columns compare directly.
``--gemv-ab``: every decode case also with the projections of up to 8 rows on the streaming kernel
(``KernelTuning.gemv_max_rows`` flipped: 0 when the model ships with it on, else 8).
``--side-ab``: every decode case also captured without the MoE side stream (router and shared experts on
the main stream, as eager steps run).
``--one-token-ab``: the batch-1 decode case also with a single token's dense experts on the block kernels
(``KernelTuning.one_token_gemv`` off).
``--prefetch-ab``: the batch-1 decode case also without the L2 requests before the PDL wait (the projections'
weight rows, the KDA step's state rows: ``KernelOptions.prefetch`` off).
``--flash-mla-ab`` (with ``KIMIK3_FLASH_MLA`` set): every decode case also with our Triton MLA decode in place of
FlashMLA (the slice's cache has 64-token blocks, so the main columns run FlashMLA).
``--flash-kda-ab`` (with ``KIMIK3_FLASH_KDA`` set): the prefill cases also with fla-core's chunk_kda in place of
FlashKDA (K3's bounded gate only; Kimi-Linear's KDA never takes FlashKDA).
``--wgmma-ab``: every decode case also with the MXFP4 experts on the block kernels (``KernelTuning.wgmma_experts``
off, where the default takes ``moe_wgmma``'s register-operand kernels).
``--router-split-ab``: every decode case also with the MoE routing on unsplit logits (``kimik3.ops.router``'s
split-K path off: router_split_min_tokens past any batch).
``--low-rank-ab``: every decode case also with the KDA layers' low-rank up-projections placed the other way: computed
before the step's kernel where the default computes them inside it (batches up to
``KernelTuning.decode_low_rank_max_seqs``), inside it where the default computes them first.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import (capture_graph, commit_id, copy_rate, cuda_time, log, matmul_rate,  # noqa: E402
                               named_or_not, save_results)
from kimik3.config import parse_config                      # noqa: E402
from kimik3.model.batch import ForwardBatch, HybridCache     # noqa: E402
from kimik3.model.kimi_k3 import KimiForCausalLM             # noqa: E402
from kimik3.model.moe import Experts                         # noqa: E402
from kimik3.ops import ceil_div, mxfp4                       # noqa: E402
from kimik3.ops.backend import reference_ops                 # noqa: E402
from kimik3.ops.options import KernelOptions, kernel_options, tuning, use_kernel_options  # noqa: E402

CONFIG = Path(__file__).with_name("kimi-k3-slice4.config.json")
KIMI_LINEAR_CONFIG = Path(__file__).with_name("kimi-linear-slice4.config.json")
BLOCK = 64
CONTEXT = 4096
results: dict = {}


def config_path() -> Path:
    arg = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--config=")), None)
    return Path(arg) if arg else CONFIG


def save():
    name = "bench_slice.json" if config_path() == CONFIG else f"bench_slice_{config_path().stem.split('.')[0]}.json"
    save_results(name, results)


# ---- (a) correctness -----------------------------------------------------------------------
def run_checks():
    from tests.gpu.test_fast_ops import CHECKS, bound
    rows = {}
    only = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--checks=")), None)
    for name, fn in CHECKS.items():
        if only is not None and name not in only:
            continue
        try:
            for k, v in fn().items():
                rows[k] = {"rel_err": v, "bound": bound(k), "ok": v <= bound(k)}
        except Exception as exc:               # keep going: one broken op must not hide the rest
            rows[name] = {"error": repr(exc)[:400], "ok": False}
            traceback.print_exc()
    results["checks"] = rows
    for k, r in rows.items():
        log(f"check {k:28s} {'OK ' if r['ok'] else 'BAD'} {r.get('rel_err', r.get('error'))}")


# ---- (b) ceilings ----------------------------------------------------------------------------
def ceilings():
    bw, mm = copy_rate(), matmul_rate()
    results["ceilings"] = {"copy_bytes_per_s": bw, "bf16_matmul_flops": mm}
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s")
    return bw, mm


# ---- (c) the slice model ---------------------------------------------------------------------
def _random_(name: str, p: torch.Tensor, g: torch.Generator) -> None:
    """Fill parameter ``p`` (on the GPU) with build_slice's random values for ``name``."""
    if p.dtype == torch.uint8:                                     # packed expert codes
        p.copy_(torch.randint(0, 256, p.shape, generator=g, device="cuda", dtype=torch.uint8))
    elif name.endswith("A_log"):
        p.copy_(torch.log(torch.empty(p.shape, device="cuda").uniform_(1, 16, generator=g)))
    elif name.endswith(("dt_bias", "e_score_correction_bias")):
        p.normal_(0, 0.3, generator=g)
    elif "conv1d" in name:
        p.normal_(0, 0.5, generator=g)
    elif p.dim() == 1:
        p.normal_(1.0, 0.1, generator=g)
    elif name.endswith("embed_tokens.weight"):
        p.normal_(0, 1.0, generator=g)
    else:
        p.normal_(0, 1 / math.sqrt(p.shape[-1]), generator=g)


def _pinned_experts(model) -> None:
    """Every ``Experts`` module's tensors in pinned host memory (expert offload's host pool), the rest left."""
    for m in model.modules():
        if isinstance(m, Experts):
            for key, t in list(m._parameters.items()):
                m._parameters[key] = torch.nn.Parameter(torch.empty(t.shape, dtype=t.dtype, pin_memory=True),
                                                        requires_grad=False)
            for key, t in list(m._buffers.items()):
                m._buffers[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


def build_slice(cfg: dict, source: str = str(CONFIG), experts_on_host: bool = False) -> KimiForCausalLM:
    """The model of ``cfg`` on the GPU with random bf16 weights (MXFP4 experts when the config
    quantizes them, else dense bf16 experts). ``experts_on_host``: the routed experts in pinned host memory
    (filled from the GPU, the same values), for a model whose experts do not fit the GPU; then
    ``model.offload_experts`` builds its GPU expert cache."""
    parsed = parse_config(cfg, source)
    with torch.device("meta"):
        model = KimiForCausalLM(parsed)
    model.cast(torch.bfloat16)
    for m in model.modules():
        if isinstance(m, Experts) and parsed.text.expert_quantization == "mxfp4":
            m.use_mxfp4_storage()
    if experts_on_host:
        _pinned_experts(model)
    for m in model.modules():
        if not (experts_on_host and isinstance(m, Experts)):
            m.to_empty(device="cuda", recurse=False)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            dst = p if p.is_cuda else torch.empty(p.shape, dtype=p.dtype, device="cuda")
            _random_(name, dst, g)
            if dst is not p:
                p.copy_(dst)
                del dst
        for m in model.modules():
            if isinstance(m, Experts) and m.mxfp4:
                for which in ("w1", "w2", "w3"):
                    s = getattr(m, f"{which}_scale")
                    K = s.shape[-1] * 32
                    base = 127 - round(math.log2(2 * math.sqrt(K)))
                    s.copy_((base + torch.randint(-1, 2, s.shape, generator=g, device="cuda")).to(torch.uint8))
                m.scale_max = max(int(getattr(m, f"{w}_scale").max()) for w in ("w1", "w2", "w3"))
    model.eval()
    return model


def dense_twins(model) -> dict:
    """Dense bf16 copies of the packed experts (the reference path's weights)."""
    twins = {}
    for name, m in model.named_modules():
        if isinstance(m, Experts) and m.mxfp4:
            E = m.w1.shape[0]
            I, L = m.w1.shape[1], m.w1.shape[2] * 2
            with torch.device("meta"):
                d = Experts(E, L, I).to(torch.bfloat16)
            d.to_empty(device="cuda")
            with torch.no_grad():
                for which in ("w1", "w2", "w3"):
                    packed, scale = m.packed(which)
                    dst = getattr(d, which)
                    for e in range(E):
                        dst[e].copy_(mxfp4.dequantize(packed[e], scale[e], torch.bfloat16))
            twins[name] = d
    return twins


class swapped_experts:
    """Context: MoE layers use their dense twins (for the reference path)."""

    def __init__(self, model, twins):
        self.model, self.twins, self.saved = model, twins, {}

    def __enter__(self):
        for name, twin in self.twins.items():
            parent = self.model.get_submodule(name.rsplit(".", 1)[0])
            self.saved[name] = parent.experts
            parent.experts = twin

    def __exit__(self, *exc):
        for name, packed in self.saved.items():
            self.model.get_submodule(name.rsplit(".", 1)[0]).experts = packed


def fill_history(cache: HybridCache, seed: int) -> None:
    """Random latents, states and windows in ``cache``: they stand for each sequence's prefilled history."""
    g = torch.Generator(device=cache.mla_latent.device).manual_seed(seed)
    cache.mla_latent.normal_(0, 1, generator=g)
    cache.kda_state.normal_(0, 0.02, generator=g)
    cache.kda_conv.normal_(0, 1, generator=g)


def decode_setup(model, N: int):
    cfg = model.config.text
    per_seq = ceil_div(CONTEXT + 1, BLOCK)
    cache = HybridCache.allocate(cfg, num_slots=N + 1, num_blocks=N * per_seq + 1, block_size=BLOCK,
                                 dtype=torch.bfloat16, device="cuda")
    fill_history(cache, N)                                # a 4k history per sequence
    tables = [list(range(1 + n * per_seq, 1 + (n + 1) * per_seq)) for n in range(N)]
    batch = ForwardBatch.build([1] * N, [CONTEXT] * N, list(range(1, N + 1)), tables, BLOCK, device="cuda")
    ids = torch.randint(0, cfg.vocab_size, (N,), device="cuda")
    return cache, batch, ids


def step_fn(model, ids, batch, cache, last_only=False):
    def run():
        h = model.forward_step(ids, batch, cache)
        return model.compute_logits(h[-1:] if last_only else h)
    return run


def graph_time(fn) -> float | None:
    """Capture ``fn`` in a CUDA graph and time its replays (None if capture fails)."""
    try:
        graph, _ = capture_graph(fn)
        return cuda_time(graph.replay, warmup=3, iters=20)
    except Exception as exc:
        log(f"  CUDA graph capture failed: {exc!r}"[:300])
        return None


def with_setting(flag: str, measure, **changes):
    """``measure()`` under the kernel options in force with ``changes`` (``KernelOptions`` fields, or
    ``KernelTuning`` ones) for its duration, when ``flag`` is on the command line (else None): the second
    column of ``--pdl-ab``, ``--gemv-ab`` ..."""
    if flag not in sys.argv:
        return None
    options = kernel_options()
    fields = {f.name for f in dataclasses.fields(KernelOptions)}
    options = dataclasses.replace(options, **{k: v for k, v in changes.items() if k in fields})
    options = options.tuned(**{k: v for k, v in changes.items() if k not in fields})
    with use_kernel_options(options):
        return measure()


def without_pdl(measure):
    """``measure()`` with our kernels launched without PDL (``--pdl-ab`` only; else None)."""
    return with_setting("--pdl-ab", measure, pdl=False)


def other_gemv(measure):
    """``measure()`` with ``gemv_max_rows`` flipped between 0 and 8 (``--gemv-ab`` only; else None)."""
    return with_setting("--gemv-ab", measure, gemv_max_rows=0 if tuning().gemv_max_rows else 8)


def without_library(flag: str, env: str, measure):
    """``measure()`` with the library ``env`` names unnamed (``flag`` on the command line and ``env`` set: the
    main columns then run that library, this one our default kernels; else None)."""
    field = {"KIMIK3_FLASH_MLA": "flash_mla", "KIMIK3_FLASH_KDA": "flash_kda"}[env]
    if flag not in sys.argv or not getattr(kernel_options(), field):
        return None
    return named_or_not(env, getattr(kernel_options(), field), False, measure)


def without_flash_kda(measure):
    """``--flash-kda-ab`` (KIMIK3_FLASH_KDA set): the prefill cases on fla-core's chunk_kda."""
    from kimik3.ops.cuda.flash_kda import ENV
    return without_library("--flash-kda-ab", ENV, measure)


def without_flash_mla(measure):
    """``--flash-mla-ab`` (KIMIK3_FLASH_MLA set): the decode cases on our Triton MLA decode."""
    from kimik3.ops.cuda.flash_mla import ENV
    return without_library("--flash-mla-ab", ENV, measure)


def profile(name, fn, row_limit: int = 14) -> str:
    """Top kernels of one run by device time (printed, kept in this bench's results, returned)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=row_limit, max_name_column_width=60)
    log(f"--- profile {name}\n{table}")
    results.setdefault("profiles", {})[name] = table
    return table


def touched_experts(fn) -> float:
    """Mean number of distinct experts the MoE layers route to in one eager run of ``fn`` (the
    random router does not spread tokens evenly, so the floor counts what is really read)."""
    from kimik3.model.moe import MoE
    seen, route = [], MoE.route

    def recording(self, x):
        weights, ids = route(self, x)
        seen.append(torch.unique(ids).numel())
        return weights, ids
    MoE.route = recording
    try:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    finally:
        MoE.route = route
    return sum(seen) / max(len(seen), 1)


def counts(model, N: int, T: int, mode: str, experts_active: float, context: int = CONTEXT, rows: int = 1):
    """(bytes, flops) of one step from the shapes. decode: N sequences x ``rows`` tokens (1; a verify step's
    k + 1) over ``context`` (the cache read once a sequence, the KDA state read once and written after each row);
    prefill: T tokens of one fresh sequence, logits for its last token."""
    cfg = model.config.text
    D, V = cfg.hidden_size, cfg.vocab_size
    kda, mla_layers = len(cfg.kda_layer_ids), len(cfg.mla_layer_ids)
    H, K = cfg.kda.num_heads, cfg.kda.head_dim
    Hm = cfg.num_attention_heads
    dense_params, expert_bytes, expert_params = 0, 0, 0
    n_moe = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            continue
        if name.endswith("embed_tokens.weight") or name.startswith("lm_head"):
            continue
        dense_params += p.numel()
    for m in model.modules():
        if isinstance(m, Experts):
            n_moe += 1
            E = m.w1.shape[0]
            if m.mxfp4:
                expert_bytes = sum(t.numel() for w in ("w1", "w2", "w3") for t in m.packed(w)) // E
                expert_params = sum(getattr(m, w)[0].numel() * 2 for w in ("w1", "w2", "w3"))
            else:
                expert_params = sum(getattr(m, w)[0].numel() for w in ("w1", "w2", "w3"))
                expert_bytes = expert_params * 2
    k = cfg.num_experts_per_token
    state = H * K * K * 4 + 3 * H * K * (cfg.kda.conv_size - 1) * 2
    if mode == "decode":
        tokens = N * rows
        byts = (dense_params * 2 + D * V * 2 + tokens * D * 2 + n_moe * experts_active * expert_bytes
                + (1 + rows) * N * kda * state + N * (context + rows) * cfg.mla_cache_dim * 2 * mla_layers)
        attn = tokens * mla_layers * Hm * 2 * (context + rows) * (cfg.mla_cache_dim + cfg.kv_lora_rank)
        flops = 2 * tokens * (dense_params + D * V) + 2 * tokens * k * expert_params * n_moe + attn \
            + 2 * tokens * kda * H * K * K * 4
    else:
        tokens = T
        byts = dense_params * 2 + D * V * 2 + n_moe * cfg.num_experts * expert_bytes + T * D * 2 * 4
        d_qk, d_v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
        attn = mla_layers * Hm * 2 * (T * T / 2) * (d_qk + d_v)
        kda_chunk = kda * H * T * (6 * K * K + 6 * 64 * K)        # state products + intra-chunk (chunk 64)
        flops = 2 * T * dense_params + 2 * D * V + 2 * T * k * expert_params * n_moe + attn + kda_chunk
    return byts, flops


def bench_model(bw, mm):
    cfg = json.loads(config_path().read_text())
    t0 = time.time()
    model = build_slice(cfg, str(config_path()))
    log(f"slice built in {time.time() - t0:.1f}s; {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
    twins = {} if "--no-ref" in sys.argv else dense_twins(model)
    E = model.config.text.num_experts
    rows = []
    for N in (1, 8, 32, 128):
        cache, batch, ids = decode_setup(model, N)
        fast = step_fn(model, ids, batch, cache)
        t_eager = cuda_time(fast, iters=10)
        model.use_side_stream(torch.cuda.Stream())      # as the engine's decode graphs run
        t_graph = graph_time(fast)
        t_graph_no_pdl = without_pdl(lambda: graph_time(fast))
        t_graph_other_gemv = other_gemv(lambda: graph_time(fast))
        t_graph_block_experts = with_setting("--one-token-ab", lambda: graph_time(fast),
                                             one_token_gemv=False) if N == 1 else None
        t_graph_no_prefetch = with_setting("--prefetch-ab", lambda: graph_time(fast), prefetch=False) if N == 1 else None
        t_graph_no_flash_mla = without_flash_mla(lambda: graph_time(fast))
        t_graph_block_moe = with_setting("--wgmma-ab", lambda: graph_time(fast), wgmma_experts=False)
        t_graph_unsplit_router = with_setting("--router-split-ab", lambda: graph_time(fast),
                                              router_split_min_tokens=1 << 30)
        low_rank_inside = N <= tuning().decode_low_rank_max_seqs
        t_graph_low_rank_other = with_setting("--low-rank-ab", lambda: graph_time(fast),
                                              decode_low_rank_max_seqs=0 if low_rank_inside else 1 << 30)
        model.use_side_stream(None)
        t_graph_no_side = graph_time(fast) if "--side-ab" in sys.argv else None
        t_ref = float("nan")
        if "--no-ref" not in sys.argv:
            with reference_ops(), swapped_experts(model, twins):
                t_ref = cuda_time(fast, warmup=1, iters=3)
        if "--profile" in sys.argv:
            profile(f"decode b{N}", fast, row_limit=24)
        active = touched_experts(fast)
        byts, flops = counts(model, N, 0, "decode", active)
        floor = max(byts / bw, flops / mm)
        best = min(t for t in (t_eager, t_graph) if t is not None)
        rows.append({"case": f"decode b{N} ctx{CONTEXT}", "experts_touched_per_layer": active, "t_eager_ms": t_eager * 1e3,
                     "t_graph_ms": None if t_graph is None else t_graph * 1e3, "t_ref_ms": t_ref * 1e3,
                     "t_graph_no_pdl_ms": None if t_graph_no_pdl is None else t_graph_no_pdl * 1e3,
                     "gemv_max_rows": tuning().gemv_max_rows,
                     "t_graph_other_gemv_ms": None if t_graph_other_gemv is None else t_graph_other_gemv * 1e3,
                     "t_graph_no_side_stream_ms": None if t_graph_no_side is None else t_graph_no_side * 1e3,
                     "t_graph_one_token_block_kernels_ms": None if t_graph_block_experts is None else t_graph_block_experts * 1e3,
                     "t_graph_no_prefetch_ms": None if t_graph_no_prefetch is None else t_graph_no_prefetch * 1e3,
                     "t_graph_no_flash_mla_ms": None if t_graph_no_flash_mla is None else t_graph_no_flash_mla * 1e3,
                     "t_graph_unsplit_router_ms": None if t_graph_unsplit_router is None else t_graph_unsplit_router * 1e3,
                     "t_graph_block_moe_ms": None if t_graph_block_moe is None else t_graph_block_moe * 1e3,
                     "low_rank_inside_kernel": low_rank_inside,
                     "t_graph_low_rank_other_ms": None if t_graph_low_rank_other is None else t_graph_low_rank_other * 1e3,
                     "bytes": byts, "flops": flops, "floor_ms": floor * 1e3, "time_over_floor": best / floor,
                     "speedup_vs_ref": t_ref / best, "ref_note": "same shapes"})
        log(rows[-1])
        results["model"] = rows
        save()
        del cache, batch
        torch.cuda.empty_cache()
    for T, with_ref in ((8192, False), (2048, True)):
        cfg_t = model.config.text
        cache = HybridCache.allocate(cfg_t, num_slots=2, num_blocks=T // BLOCK + 1, block_size=BLOCK,
                                     dtype=torch.bfloat16, device="cuda")
        batch = ForwardBatch.build([T], [0], [1], [list(range(1, T // BLOCK + 1))], BLOCK, device="cuda")
        ids = torch.randint(0, cfg_t.vocab_size, (T,), device="cuda")
        fast = step_fn(model, ids, batch, cache, last_only=True)
        t_fast = cuda_time(fast, warmup=2, iters=5)
        t_no_pdl = without_pdl(lambda: cuda_time(fast, warmup=2, iters=5))
        t_no_flash = without_flash_kda(lambda: cuda_time(fast, warmup=2, iters=5))
        t_ref = None
        if "--profile" in sys.argv:
            profile(f"prefill {T}", fast)
        if with_ref and "--no-ref" not in sys.argv:
            with reference_ops(), swapped_experts(model, twins):
                t_ref = cuda_time(fast, warmup=1, iters=2)
        byts, flops = counts(model, 1, T, "prefill", E)
        floor = max(byts / bw, flops / mm)
        rows.append({"case": f"prefill {T}", "t_eager_ms": t_fast * 1e3, "t_graph_ms": None,
                     "t_eager_no_pdl_ms": None if t_no_pdl is None else t_no_pdl * 1e3,
                     "t_eager_no_flash_kda_ms": None if t_no_flash is None else t_no_flash * 1e3,
                     "t_ref_ms": None if t_ref is None else t_ref * 1e3, "bytes": byts, "flops": flops,
                     "floor_ms": floor * 1e3, "time_over_floor": t_fast / floor,
                     "matmul_fraction": flops / t_fast / mm,
                     "speedup_vs_ref": None if t_ref is None else t_ref / t_fast,
                     "ref_note": "reference at 2k tokens (8k would need 25 GB of fp32 scores)" if with_ref else ""})
        log(rows[-1])
        results["model"] = rows
        save()
        del cache
        torch.cuda.empty_cache()
    if not any(m.mxfp4 for m in model.modules() if isinstance(m, Experts)) and "--no-experts" not in sys.argv:
        bench_experts(model, bw, mm)
    return rows


# ---- (d) dense routed experts alone vs torch._grouped_mm -------------------------------------
def bench_experts(model, bw, mm):
    """The routed-expert op of the slice's first MoE layer (dense experts) at 1..2048 tokens vs
    torch._grouped_mm on the same shapes (gate/up as one [E, L, 2I] GEMM, SiLU-GLU, down; tokens
    pre-sorted by expert, its best case: no sort, gather or combine timed), both as CUDA graphs.
    Floor: the touched experts' bytes / copy rate, or FLOPs / matmul rate."""
    from kimik3.ops.moe import fused_moe
    moe = next(m for m in model.modules() if isinstance(m, Experts))
    E, I, L = moe.w1.shape
    k = model.config.text.num_experts_per_token
    w13t = torch.cat([moe.w1, moe.w3], dim=1).transpose(1, 2)          # [E, L, 2I], column-major per expert
    w2t = moe.w2.transpose(1, 2)                                         # [E, I, L]
    g = torch.Generator(device="cuda").manual_seed(5)
    rows = []
    sweep = {}
    for T in ((512, 2048, 8192) if "--sweep" in sys.argv else ()):
        from kimik3.ops.triton.moe import fused_moe_triton
        x = torch.randn(T, L, device="cuda", generator=g).to(torch.bfloat16)
        ids = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=-1).indices
        weights = torch.rand(T, k, device="cuda", generator=g)
        for BM, BN1, BN2, BKH, warps, stages in ((64, 64, 128, 32, 4, 3), (64, 128, 128, 32, 8, 3), (128, 128, 128, 32, 8, 3),
                                                 (128, 64, 128, 32, 4, 3), (64, 128, 128, 64, 8, 3), (128, 128, 128, 64, 8, 3),
                                                 (64, 128, 64, 32, 4, 4), (128, 128, 64, 32, 8, 4), (32, 64, 64, 64, 4, 3)):
            cfg = dict(BM=BM, BN1=BN1, BN2=BN2, BKH=BKH, warps=warps, stages=stages)
            try:
                t = cuda_time(lambda: fused_moe_triton(x, moe.w1, moe.w2, moe.w3, weights, ids, False, 1.0, None, tiles=cfg),
                              warmup=2, iters=5)
            except Exception as exc:
                log(f"  sweep T={T} {cfg}: {exc!r}"[:200])
                continue
            sweep.setdefault(T, []).append({"cfg": cfg, "ms": t * 1e3})
            log(f"  sweep T={T} {cfg} {t * 1e3:.3f} ms")
        results["dense_tile_sweep"] = sweep
        save()
    for T in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048):
        x = torch.randn(T, L, device="cuda", generator=g).to(torch.bfloat16)
        ids = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=-1).indices
        weights = torch.rand(T, k, device="cuda", generator=g)
        used = torch.unique(ids).numel()
        byts = used * 3 * I * L * 2 + T * L * 2 * 2
        flops = 2 * T * k * 3 * I * L
        floor = max(byts / bw, flops / mm)
        ours = graph_time(lambda: fused_moe(x, moe.w1, moe.w2, moe.w3, weights, ids, "silu", 1.0, None, True))
        order = torch.argsort(ids.reshape(-1))
        xs = x[order // k].contiguous()
        offs = torch.bincount(ids.reshape(-1), minlength=E).cumsum(0).to(torch.int32)

        def grouped():
            gu = torch._grouped_mm(xs, w13t, offs=offs)
            h = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
            return torch._grouped_mm(h, w2t, offs=offs)
        try:
            lib = graph_time(grouped)
        except Exception as exc:               # the library op may refuse a shape
            log(f"  torch._grouped_mm T={T}: {exc!r}"[:200])
            lib = None
        row = {"T": T, "experts_touched": used, "ours_ms": None if ours is None else ours * 1e3,
               "grouped_mm_ms": None if lib is None else lib * 1e3, "floor_ms": floor * 1e3,
               "ours_over_floor": None if ours is None else ours / floor,
               "grouped_mm_over_floor": None if lib is None else lib / floor,
               "ours_speedup_vs_grouped_mm": None if (ours is None or lib is None) else lib / ours}
        rows.append(row)
        log(row)
        results["experts"] = rows
        save()
    return rows


FLAGS = ("--checks=", "--config=", "--flash-kda-ab", "--flash-mla-ab", "--gemv-ab", "--low-rank-ab", "--no-experts",
         "--no-ref", "--one-token-ab", "--pdl-ab", "--prefetch-ab", "--profile", "--router-split-ab", "--side-ab",
         "--skip-checks", "--sweep", "--wgmma-ab")


def main():
    unknown = [a for a in sys.argv[1:] if not any(a == f or (f.endswith("=") and a.startswith(f)) for f in FLAGS)]
    if unknown:                                    # (a flag this script does not read is an error, not a no-op)
        raise SystemExit(f"bench_slice.py: unknown arguments {unknown}; known: {' '.join(FLAGS)}")
    torch.backends.cuda.matmul.allow_tf32 = False
    results["gpu"] = torch.cuda.get_device_name()
    results["date"] = datetime.date.today().isoformat()
    results["commit"] = commit_id()
    results["torch"], results["triton"] = torch.__version__, __import__("triton").__version__
    if "--skip-checks" not in sys.argv:
        run_checks()
        save()
    bw, mm = ceilings()
    save()
    results["config"] = config_path().name
    rows = bench_model(bw, mm)
    save()
    log(f"\n| case | fast eager ms | fast graph ms | floor ms | time/floor | ref ms | speed-up | without PDL ms "
        f"| GEMV_MAX_ROWS {0 if tuning().gemv_max_rows else 8} ms | no side stream ms | one token on block kernels ms | no weight prefetch ms | without FlashKDA (prefill) / FlashMLA (decode) ms "
        f"| unsplit router logits ms | low rank placed the other way ms "
        f"| MXFP4 experts on the block kernels ms |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        g = "-" if r["t_graph_ms"] is None else f"{r['t_graph_ms']:.3f}"
        off = r.get("t_graph_no_pdl_ms") or r.get("t_eager_no_pdl_ms")
        off = "-" if off is None else f"{off:.3f}"
        ref = "-" if r["t_ref_ms"] is None else f"{r['t_ref_ms']:.1f}"
        sp = "-" if r["speedup_vs_ref"] is None else f"{r['speedup_vs_ref']:.1f}x"
        extra = f" ({r['matmul_fraction']:.0%} of matmul rate)" if "matmul_fraction" in r else ""
        other = r.get("t_graph_other_gemv_ms")
        other = "-" if other is None else f"{other:.3f}"
        side = r.get("t_graph_no_side_stream_ms")
        side = "-" if side is None else f"{side:.3f}"
        blocks = r.get("t_graph_one_token_block_kernels_ms")
        blocks = "-" if blocks is None else f"{blocks:.3f}"
        nopf = r.get("t_graph_no_prefetch_ms")
        nopf = "-" if nopf is None else f"{nopf:.3f}"
        noflash = r.get("t_eager_no_flash_kda_ms") or r.get("t_graph_no_flash_mla_ms")
        noflash = "-" if noflash is None else f"{noflash:.3f}"
        unsplit = r.get("t_graph_unsplit_router_ms")
        unsplit = "-" if unsplit is None else f"{unsplit:.3f}"
        low_rank = r.get("t_graph_low_rank_other_ms")
        low_rank = "-" if low_rank is None else f"{low_rank:.3f}" + (" (first)" if r.get("low_rank_inside_kernel")
                                                                      else " (inside)")
        block_moe = r.get("t_graph_block_moe_ms")
        block_moe = "-" if block_moe is None else f"{block_moe:.3f}"
        log(f"| {r['case']} | {r['t_eager_ms']:.2f} | {g} | {r['floor_ms']:.3f} | {r['time_over_floor']:.2f}{extra} "
            f"| {ref} | {sp} | {off} | {other} | {side} | {blocks} | {nopf} | {noflash} | {unsplit} | {low_rank} "
            f"| {block_moe} |")
    bad = [k for k, r in results.get("checks", {}).items() if not r["ok"]]
    log(f"checks: {len(results.get('checks', {})) - len(bad)} ok, bad: {bad}")


if __name__ == "__main__":
    main()
