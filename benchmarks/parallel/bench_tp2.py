"""One device call on 2 GPUs: the K3-width 4-layer slice (random bf16 weights, MXFP4 experts)
under TP=1, TP=2 (experts TP-split) and EP=2 (TEP; all-to-all; all-gather/reduce-scatter):
(1) agreement with TP=1 (prefill logits, teacher-forced greedy tokens), (2) decode b1/b32/b128
(4k context) and an 8k prefill per layout and MoE tail, with the bytes each collective moved per
step, (3) the MoE tail alone, (a) concat vs (b) sliced, by token count: the crossover.

    torchrun --standalone --nproc-per-node=2 benchmarks/parallel/bench_tp2.py   ($OUT/bench_tp2.json)
    torchrun --standalone --nproc-per-node=2 benchmarks/parallel/bench_tp2.py --tiny   (CPU smoke run)

Weights are generated per tensor from a seed of its name at full size and narrowed to the rank's
shard (the loader's rule), so every layout holds slices of the same model. Timings are eager
(no CUDA graphs: the EP paths sync on routing counts), CUDA events, median, rank 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
import zlib
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import commit_id, save_results                # noqa: E402
from kimik3.config import parse_config                               # noqa: E402
from kimik3.distributed import ParallelContext                       # noqa: E402
from kimik3.model.batch import ForwardBatch                          # noqa: E402
from kimik3.model.kimi_k3 import KimiForCausalLM                     # noqa: E402
from kimik3.model.moe import Experts                                 # noqa: E402
from kimik3.ops import ceil_div                                      # noqa: E402
from kimik3.parallel.launch import NVLS_SAFE_ENV, set_safe_nvls_env  # noqa: E402

CONFIG = ROOT / "benchmarks" / "gpu" / "kimi-k3-slice4.config.json"
results: dict = {"sections": {}}
RANK = 0


def log(*a):
    if RANK == 0:
        print(*a, flush=True)


def save():
    if RANK == 0:
        save_results("bench_tp2.json", results)


def timed(fn, warmup=2, iters=5) -> float:
    """Median ms of ``fn`` (every rank runs it; collectives keep them together)."""
    for _ in range(warmup):
        fn()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if DEVICE.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()


def _gen(name: str) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(zlib.crc32(name.encode()))


def _random(name: str, shape, dtype) -> torch.Tensor:
    g = _gen(name)
    t = torch.empty(shape, device=DEVICE, dtype=torch.float32)
    if name.endswith("A_log"):
        t.uniform_(1, 16, generator=g).log_()
    elif name.endswith(("dt_bias", "e_score_correction_bias")):
        t.normal_(0, 0.3, generator=g)
    elif "conv1d" in name:
        t.normal_(0, 0.5, generator=g)
    elif len(shape) == 1:
        t.normal_(1.0, 0.1, generator=g)
    elif name.endswith("embed_tokens.weight"):
        t.normal_(0, 1.0, generator=g)
    else:
        t.normal_(0, 1 / math.sqrt(shape[-1]), generator=g)
    return t.to(dtype)


def build(cfg: dict, par: ParallelContext, dtype) -> KimiForCausalLM:
    """The model's shards of one random full-size model (same for every layout)."""
    parsed = parse_config(cfg, str(CONFIG))
    with torch.device("meta"):
        model = KimiForCausalLM(parsed, par)
    model.cast(dtype)
    for m in model.modules():
        if isinstance(m, Experts):
            m.use_mxfp4_storage()
    model.to_empty(device=DEVICE)
    table = model.shard_table()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                continue
            if name.endswith("A_log"):
                attn = model.get_submodule(name.rsplit(".", 1)[0])
                attn.load_A_log(_random(name, (p.shape[0] * par.tp_size,), torch.float32), name)
                continue
            shape = list(p.shape)
            if name in table:
                dim, rank, size = table[name]
                shape[dim] *= size
                p.copy_(_random(name, shape, p.dtype).narrow(dim, rank * p.shape[dim], p.shape[dim]))
            else:
                p.copy_(_random(name, shape, p.dtype))
        for mname, m in model.named_modules():
            if isinstance(m, Experts):
                fill_experts(mname, m)
    model.eval()
    return model


def fill_experts(mname: str, m: Experts) -> None:
    index, count = m.intermediate_shard
    E, I, L = m.w1.shape[0], m.w1.shape[1] * count, m.w2.shape[1]
    for e in range(m.first_expert, m.first_expert + E):
        for which, (n, k) in {"w1": (I, L), "w2": (L, I), "w3": (I, L)}.items():
            g = _gen(f"{mname}.{e}.{which}")
            packed = torch.randint(0, 256, (n, k // 2), generator=g, device=DEVICE, dtype=torch.uint8)
            base = 127 - round(math.log2(2 * math.sqrt(k)))
            scale = (base + torch.randint(-1, 2, (n, k // 32), generator=g, device=DEVICE)).to(torch.uint8)
            if count > 1:
                dim = 0 if which != "w2" else 1
                packed = packed.narrow(dim, index * packed.shape[dim] // count, packed.shape[dim] // count)
                scale = scale.narrow(dim, index * scale.shape[dim] // count, scale.shape[dim] // count)
            m.load_expert_mxfp4(e, which, packed.contiguous(), scale.contiguous(), f"{mname}.{e}.{which}")


# ---- (1) agreement -------------------------------------------------------------------------------
def agreement(model, prompt: list[int], forced: list[int] | None, steps: int):
    """Prefill the prompt, then decode ``steps`` tokens, fed with ``forced`` (or, without it, with
    the model's own argmax). Returns (last prefill logits, the argmax after prefill and after
    every decode step) on rank 0; the fed tokens are forced, or those argmaxes."""
    cache = model.allocate_cache(num_slots=2, num_blocks=1 + (len(prompt) + steps) // 16 + 1, block_size=16)
    table = list(range(1, cache.mla_latent.shape[1]))
    T = len(prompt)
    batch = ForwardBatch.build([T], [0], [1], [table], 16, device=DEVICE)
    logits = model.compute_logits(model.forward_step(torch.tensor(prompt, device=DEVICE), batch, cache)[-1:])
    first = logits
    argmaxes = [int(logits.argmax())] if RANK == 0 else []
    for i in range(steps):
        tok = forced[i] if forced is not None else argmaxes[-1]
        batch = ForwardBatch.build([1], [T + i], [1], [table], 16, device=DEVICE)
        logits = model.compute_logits(model.forward_step(torch.tensor([tok], device=DEVICE), batch, cache))
        if RANK == 0:
            argmaxes.append(int(logits.argmax()))
    return first, argmaxes


# ---- (2) step timings ----------------------------------------------------------------------------
def decode_case(model, N: int, context: int):
    per_seq = ceil_div(context + 1, 64)
    cache = model.allocate_cache(num_slots=N + 1, num_blocks=N * per_seq + 1, block_size=64)
    g = torch.Generator(device=DEVICE).manual_seed(N)
    cache.mla_latent.normal_(0, 1, generator=g)      # same bytes on every rank (replicated latent)
    cache.kda_state.normal_(0, 0.02, generator=g)
    cache.kda_conv.normal_(0, 1, generator=g)
    tables = [list(range(1 + n * per_seq, 1 + (n + 1) * per_seq)) for n in range(N)]
    batch = ForwardBatch.build([1] * N, [context] * N, list(range(1, N + 1)), tables, 64, device=DEVICE)
    ids = torch.randint(0, model.config.text.vocab_size, (N,), generator=g, device=DEVICE)
    return lambda: model.compute_logits(model.forward_step(ids, batch, cache))


def prefill_case(model, T: int):
    cache = model.allocate_cache(num_slots=2, num_blocks=T // 64 + 2, block_size=64)
    batch = ForwardBatch.build([T], [0], [1], [list(range(1, T // 64 + 2))], 64, device=DEVICE)
    ids = torch.randint(0, model.config.text.vocab_size, (T,), generator=torch.Generator(device=DEVICE).manual_seed(1),
                        device=DEVICE)

    def run():
        cache.kda_state.zero_()
        cache.kda_conv.zero_()
        return model.compute_logits(model.forward_step(ids, batch, cache)[-1:])
    return run


def traced(model, fn) -> dict:
    """Bytes each kind of collective moved (payload, this rank) in one call of ``fn``."""
    model.parallel.trace = []
    fn()
    sync()
    per = defaultdict(lambda: [0, 0])
    for op, nbytes in model.parallel.trace:
        per[op][0] += 1
        per[op][1] += nbytes
    model.parallel.trace = None
    return {op: {"calls": c, "bytes": b} for op, (c, b) in per.items()}


def time_layout(name: str, model, cases: dict, tails: list[str], modes: list[str]):
    out = {}
    for mode in modes:
        model.parallel.moe_mode = mode
        for tail in tails:
            model.parallel.moe_tail = tail
            key = f"{name}" + (f"/{mode}" if len(modes) > 1 else "") + (f"/{tail}" if len(tails) > 1 else "")
            row = {}
            for case, make in cases.items():
                fn = make(model)
                row[case] = {"ms": round(timed(fn, iters=3 if "prefill" in case else 5), 3)}
                if model.parallel.enabled:
                    row[case]["collectives"] = traced(model, fn)
                del fn
                if DEVICE.type == "cuda":
                    torch.cuda.empty_cache()
            out[key] = row
            log(key, json.dumps({c: r["ms"] for c, r in row.items()}))
    return out


# ---- (3) the tail alone ----------------------------------------------------------------------------
@torch.inference_mode()
def tail_sweep(model, sizes: list[int]):
    moe = next(layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe"))
    L, D = moe.routed_expert_up_proj.weight.shape[1], moe.routed_expert_up_proj.weight.shape[0]
    rows = {}
    for T in sizes:
        g = torch.Generator(device=DEVICE).manual_seed(T)
        u = torch.randn(T, L, generator=g, device=DEVICE).to(DTYPE)
        s = torch.randn(T, D, generator=g, device=DEVICE).to(DTYPE)
        row = {}
        for tail in ("concat", "sliced"):
            model.parallel.moe_tail = tail
            row[tail] = round(timed(lambda: moe.reduce(u.clone(), s.clone()), warmup=3, iters=20), 4)
        model.parallel.moe_tail = "concat"
        ref = moe.reduce(u.clone(), s.clone())
        model.parallel.moe_tail = "sliced"
        alt = moe.reduce(u.clone(), s.clone())
        row["rel_diff"] = float((alt.float() - ref.float()).norm() / ref.float().norm()) if ref is not None else None
        rows[T] = row
        log(f"tail T={T}: concat {row['concat']} ms, sliced {row['sliced']} ms, rel diff {row['rel_diff']:.1e}")
    model.parallel.moe_tail = "auto"
    over = [T for T in sizes if rows[T]["sliced"] < rows[T]["concat"]]
    cross = next((T for i, T in enumerate(sizes) if all(t in over for t in sizes[i:])), None)
    return rows, cross


def section(name, fn):
    t = time.perf_counter()
    try:
        results["sections"][name] = fn()
    except Exception as e:          # report and go on: both ranks see the same error or hang in NCCL
        import traceback
        results["sections"][name] = {"error": repr(e)}
        traceback.print_exc()
    results.setdefault("seconds", {})[name] = round(time.perf_counter() - t, 1)
    save()


def main():
    global RANK, DEVICE, DTYPE
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on a tiny config")
    args = ap.parse_args()
    set_safe_nvls_env()
    RANK = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available() and not args.tiny
    DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    DTYPE = torch.bfloat16 if cuda else torch.float32
    if cuda:
        torch.cuda.set_device(DEVICE)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300), device_id=DEVICE)
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    if args.tiny:
        from kimik3.testing import tiny_k3_config
        cfg = tiny_k3_config(num_heads=4, vision=False, hidden=64, vocab_size=256)
        cfg["text_config"]["moe_intermediate_size"] = 64
        decode_sizes, prefill_T, ctx, sweep = [1, 4], 64, 16, [1, 8, 64]
    else:
        cfg = json.loads(CONFIG.read_text())
        cfg.pop("vision_config", None)
        decode_sizes, prefill_T, ctx, sweep = [1, 32, 128], 8192, 4096, [1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    results.update(commit=commit_id(), world=world, device=torch.cuda.get_device_name() if cuda else "cpu",
                   date=datetime.date.today().isoformat(), torch=torch.__version__,
                   nvls_env={k: os.environ.get(k) for k in NVLS_SAFE_ENV},
                   nccl=".".join(map(str, torch.cuda.nccl.version())) if cuda else None)
    log(json.dumps({k: results[k] for k in ("commit", "world", "device", "torch", "nvls_env", "nccl")}))
    assert all(os.environ.get(k) == v for k, v in NVLS_SAFE_ENV.items()), "NVLS variables must be set"
    g = torch.Generator().manual_seed(0)
    V = cfg["text_config"]["vocab_size"]
    prompt = torch.randint(0, V, (64,), generator=g).tolist()
    steps = 16
    cases = {f"decode_b{n}": (lambda m, n=n: decode_case(m, n, ctx)) for n in decode_sizes}
    cases[f"prefill_{prefill_T}"] = lambda m: prefill_case(m, prefill_T)
    timings = {}

    # TP=1 on rank 0 (rank 1 waits at the barrier)
    ref = {}
    if RANK == 0:
        model = build(cfg, ParallelContext(), DTYPE)
        first, tokens = agreement(model, prompt, None, steps)      # tokens: steps + 1 argmaxes
        ref = {"first": first.float().cpu(), "tokens": tokens}
        timings.update(time_layout("tp1", model, cases, ["auto"], ["tep"]))
        del model
        if cuda:
            torch.cuda.empty_cache()
    sync()
    box = [ref.get("tokens")]
    dist.broadcast_object_list(box, 0)
    forced = box[0]
    results["sections"]["tp1"] = {"greedy_tokens": forced}

    layouts = {"tp2": dict(ep_size=1, moe_mode="tep"), "ep2": dict(ep_size=2, moe_mode="tep"),
               "ep2-sharded": dict(ep_size=2, moe_mode="a2a")}
    agree = {}
    for name, kw in layouts.items():
        def one(name=name, kw=kw):
            par = ParallelContext(RANK, world, None, **kw)
            t0 = time.perf_counter()
            model = build(cfg, par, DTYPE)
            sync()
            log(f"{name}: built in {time.perf_counter() - t0:.1f} s")
            modes = ["a2a", "agrs"] if name == "ep2-sharded" else ["tep"]
            out = {}
            for mode in modes:
                par.moe_mode = mode
                first, tokens = agreement(model, prompt, forced, steps)
                if RANK == 0:
                    rel = float((first.float().cpu() - ref_first()).norm() / ref_first().norm())
                    same = sum(a == b for a, b in zip(tokens, forced))
                    out[mode] = {"prefill_logits_rel_err": rel, "greedy_equal": f"{same}/{len(forced)}",
                                 "argmax": tokens}
                    log(f"{name}/{mode}: prefill logits rel err {rel:.2e}, teacher-forced greedy equal "
                        f"{same}/{len(forced)}")
            tails = ["concat", "sliced"] if name != "ep2-sharded" else ["auto"]
            timings.update(time_layout(name, model, cases, tails, modes))
            if name == "tp2":
                rows, cross = tail_sweep(model, sweep)
                results["sections"]["tail_sweep"] = {"rows": rows, "crossover_tokens": cross}
            del model
            if cuda:
                torch.cuda.empty_cache()
            return out
        agree[name] = None
        ref_first_holder[0] = ref.get("first")
        section(name, one)
        sync()
    results["timings_ms"] = timings
    save()
    log(json.dumps(results.get("sections", {}).get("tail_sweep", {}).get("crossover_tokens")))
    dist.destroy_process_group()


ref_first_holder = [None]


def ref_first():
    return ref_first_holder[0]


if __name__ == "__main__":
    main()
