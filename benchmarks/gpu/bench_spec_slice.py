"""The draft + verify step of draft-model speculation against its floor, on the two 4-layer slices (#55).

For each slice (``kimi-k3-slice4.config.json``, ``kimi-linear-slice4.config.json``: random bf16 weights on CUDA,
built as ``bench_slice.build_slice`` builds them) and a draft of random weights in a published draft's shape:
- Eagle3 in the speculators layout: one Llama decoder layer at the target's width, fc over 3 auxiliary layers'
  states (ids 1, L/2, L-1), the draft vocabulary 32000 with its d2t map, the target's embedding shared (as
  ``loader/drafts.load_eagle3`` shares it when the checkpoint has none). Heads, key/value heads and intermediate
  size are the Llama convention at that width (``EAGLE3``: assumed, written to the results);
- K3 only: K3's own MTP layer (``model/mtp.MTPDraft``: layer L, MLA + MoE, its experts dense as ``load_mtp``
  dequantizes them; embedding and head the target's tensors), its steps on its own CUDA graphs too (``DraftGraphs``:
  catch-up and each position a decode step of the MTP layer over a fixed ``ForwardBatch``).
at batch 1 and 32 (``--batches``), k = 4 drafts (``--k``), each sequence with a ``--context`` (4096) history:
(a) the plain decode step: the engine's decode graph (``DecodeGraphs``, query length 1);
(b) the draft's own step: catch-up of 2 rows a request (its input and one accepted draft), then k positions:
    the draft's CUDA graphs (``DraftGraphs``) replayed alone (``draft_ms``), and the executor's call as the engine
    makes it, inputs staged and drafts back on the host (``draft_call_ms``); where no graph holds the step (a
    batch whose gathered keys pass ``draft_graphs.MAX_KEY_BYTES``) the eager call is both; and the same call with
    the graphs set aside (``draft_eager_ms``: what the graphs save);
(c) the verify step over k + 1 rows a sequence: the engine's verify graph, which also writes the draft's states.
Each against its floor: the bytes that must move (weights once, the routed experts really touched in an eager
run, the cache and states read: ``bench_slice.counts``; the draft's weights at each position and its keys) at the
copy rate measured in this run, or the FLOPs at the measured bf16 matmul rate, whichever is larger.
``breakeven`` = ((b) + (c)) / (a): (b) + (c) against plain steps, the mean tokens a speculative step must yield
(accepted drafts + 1, at most k + 1) to match plain decoding; ``floor_breakeven`` the same ratio of the floors.

    PYTHONPATH=. python benchmarks/gpu/bench_spec_slice.py                 (writes $OUT/bench_spec_slice.json)
    PYTHONPATH=. python benchmarks/gpu/bench_spec_slice.py --cpu           (tiny configs, float32: a smoke run)
    ... --k=4 --batches=1,32 --slices=k3,kl --context=4096 --no-mtp

On the CPU ``--cpu`` runs every function eagerly in place of its graph (the graphs' own buffers and planning;
2 shared cores: timings are noise, the path and the arithmetic are what it checks).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import commit_id, copy_rate, cuda_time, log, matmul_rate, save_results  # noqa: E402
from benchmarks.gpu.bench_draft_graphs import work_of  # noqa: E402
from benchmarks.gpu.bench_slice import (CONFIG, KIMI_LINEAR_CONFIG, _random_, build_slice, counts,  # noqa: E402
                                        fill_history, touched_experts)
from kimik3.config import parse_config  # noqa: E402
from kimik3.loader.drafts import cast_mtp  # noqa: E402
from kimik3.model.batch import HybridCache, StateCheckpoint, row_state_rows  # noqa: E402
from kimik3.model.cuda_graphs import DecodeGraphs, pack_decode_inputs  # noqa: E402
from kimik3.model.draft_graphs import DraftGraphs, capture_draft_or_none  # noqa: E402
from kimik3.model.draft_step import DraftExecutor, allocate_draft_cache  # noqa: E402
from kimik3.model.eagle3 import Eagle3Config, Eagle3Draft  # noqa: E402
from kimik3.model.kimi_k3 import KimiForCausalLM  # noqa: E402
from kimik3.model.mtp import MTPDraft  # noqa: E402
from kimik3.ops import ceil_div  # noqa: E402

SLICES = {"k3": CONFIG, "kl": KIMI_LINEAR_CONFIG}
# Eagle3 drafts at each target's width: (attention heads, key/value heads, head dim, intermediate size)
EAGLE3 = {"k3": (64, 8, 128, 18432), "kl": (32, 8, 72, 9216), "cpu": (4, 2, 16, 96)}
DRAFT_VOCAB = 32000
CATCH_UP = 2                      # rows a request catches up after a verify step (its input, one accepted draft)


@dataclass
class Device:
    """Where the bench runs: CUDA graphs and CUDA-event timing, or (``--cpu``) eager stand-ins and the host clock."""

    name: str
    dtype: torch.dtype
    block_size: int

    @property
    def cuda(self) -> bool:
        return self.name == "cuda"

    def time(self, fn) -> float:
        """Median seconds of ``fn``: 20 runs after 3 (CUDA events), or 3 after 1 (the host clock)."""
        if self.cuda:
            return cuda_time(fn, warmup=3, iters=20)
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def ceilings(self) -> tuple[float, float]:
        """(copy bytes/s, matmul FLOP/s) measured now (on the CPU: a 64 MiB copy and a 1024^3 float32 product)."""
        if self.cuda:
            return copy_rate(), matmul_rate()
        src, a = torch.randn(1 << 24), torch.randn(1024, 1024)
        dst = torch.empty_like(src)
        return 2 * src.numel() * 4 / self.time(lambda: dst.copy_(src)), 2 * 1024 ** 3 / self.time(lambda: a @ a)


class Eager:
    """A CPU stand-in for a captured graph: ``replay`` runs its function."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


class EagerDraftGraphs(DraftGraphs):
    """The draft's graphs on the CPU: each function run once at capture (its warm-up), then replayed eagerly."""

    def record(self, fn):
        fn()
        return Eager(fn)


# ---- the models ------------------------------------------------------------------------------------------
def build_target(name: str, dev: Device) -> KimiForCausalLM:
    if dev.cuda:
        return build_slice(json.loads(SLICES[name].read_text()), str(SLICES[name]))
    from kimik3.testing import random_weights, tiny_k3_config, tiny_kimi_linear_config
    cfg = tiny_k3_config(vision=False) if name == "k3" else tiny_kimi_linear_config()
    model = KimiForCausalLM(parse_config(cfg, f"tiny {name}"))
    random_weights(model)
    return model.eval()


def materialize(module: nn.Module, dev: Device, shared: dict[str, torch.Tensor], seed: int) -> nn.Module:
    """``module`` (built on the meta device, in its dtypes) on the device with ``bench_slice``'s random values;
    the parameters named in ``shared`` are those target tensors instead (nothing allocated for them)."""
    g = torch.Generator(device=dev.name).manual_seed(seed)
    with torch.no_grad():
        for prefix, m in module.named_modules():
            for leaf, p in list(m._parameters.items()):
                name = f"{prefix}.{leaf}" if prefix else leaf
                if name in shared:
                    m._parameters[leaf] = nn.Parameter(shared[name], requires_grad=False)
                elif p is not None:
                    m._parameters[leaf] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=dev.name),
                                                       requires_grad=False)
                    _random_(name, m._parameters[leaf].data, g)
            for leaf, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[leaf] = torch.zeros(b.shape, dtype=b.dtype, device=dev.name)
    return module.eval()


def eagle3_draft(target: KimiForCausalLM, shape: tuple[int, int, int, int], dev: Device) -> Eagle3Draft:
    """A random Eagle3 draft: fc over layers (1, L/2, L - 1), a 32000-token draft vocabulary (fewer for a tiny
    target) mapped to random target ids by d2t, the target's embedding."""
    text = target.config.text
    heads, kv_heads, head_dim, inter = shape
    L, V = text.num_hidden_layers, text.vocab_size
    cfg = Eagle3Config(hidden_size=text.hidden_size, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=head_dim, intermediate_size=inter, rms_norm_eps=text.rms_norm_eps, rope_theta=10000.0,
                       vocab_size=V, draft_vocab_size=min(DRAFT_VOCAB, V // 2), target_hidden_size=text.hidden_size,
                       aux_layer_ids=(1, L // 2, L - 1))
    with torch.device("meta"):
        draft = Eagle3Draft(cfg).to(dev.dtype)
    draft = materialize(draft, dev, {"embed_tokens.weight": target.model.embed_tokens.weight.data}, seed=1)
    g = torch.Generator().manual_seed(2)
    ids = torch.randperm(V, generator=g)[:cfg.draft_vocab_size].sort().values
    draft.d2t.copy_(ids - torch.arange(cfg.draft_vocab_size))
    draft.t2d.zero_()
    draft.t2d[ids.to(dev.name)] = True
    return draft


def mtp_draft(target: KimiForCausalLM, dev: Device) -> MTPDraft:
    """K3's MTP layer (one, layer L) with random weights, dense experts and the fp32 tensors K3 keeps wide, as
    ``load_mtp`` gives it; its embedding and head are the target's tensors."""
    text = target.config.text
    with torch.device("meta"):
        draft = cast_mtp(MTPDraft(text, 1), dev.dtype)
    prefix = f"model.layers.{text.num_hidden_layers}."
    shared = {prefix + "embed_tokens.weight": target.model.embed_tokens.weight.data,
              prefix + "shared_head.head.weight": target.lm_head.weight.data}
    return materialize(draft, dev, shared, seed=3)


# ---- the floors ------------------------------------------------------------------------------------------
def nbytes(*modules: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def numel(*modules: nn.Module) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def eagle3_counts(draft: Eagle3Draft, N: int, k: int, head: int) -> tuple[float, float]:
    """(bytes, flops) of an Eagle3 draft step: CATCH_UP rows a request (their states in, fc, the k/v projections,
    their cache rows out), then k positions of N heads (the head at position ``head`` reads keys 0 .. head, draft j
    from the row at head + j - 1): every position reads the layer, the final norm and the LM head, and its keys."""
    layer = draft.layers[0]
    attn, elt = layer.self_attn, next(draft.parameters()).element_size()
    kv_row = 2 * attn.num_kv_heads * attn.head_dim * elt
    R, width = N * CATCH_UP, draft.fc.weight.shape[1]
    keys = sum(N * (head + j) for j in range(1, k + 1))
    catch_up = (draft.fc, attn.k_proj, attn.v_proj, layer.input_layernorm, layer.hidden_norm)
    byts = (nbytes(*catch_up) + R * width * elt + R * kv_row
            + k * nbytes(layer, draft.norm, draft.lm_head) + keys * kv_row)
    flops = (2 * R * numel(draft.fc, attn.k_proj, attn.v_proj) + 2 * k * N * numel(layer, draft.lm_head)
             + 4 * keys * attn.num_heads * attn.head_dim)
    return byts, flops


def mtp_counts(draft: MTPDraft, N: int, k: int, head: int, experts_active: float) -> tuple[float, float]:
    """(bytes, flops) of an MTP draft step: CATCH_UP rows a request through eh_proj and the attention's merged input
    projection (the latent part kept: its cache rows out), then k positions of N heads: the layer's weights but the
    embedding and the routed experts (eh_proj, attention, shared experts, head), the routed experts touched
    (``experts_active`` a position, each token ``num_experts_per_token`` of them) and the latents of keys 0 .. head + j
    - 1 (the head at position ``head``; draft j from the row at head + j - 1)."""
    layer, cfg = draft.layer(0), draft.cfg
    attn, elt = layer.self_attn, layer.eh_proj.weight.element_size()
    moe = getattr(layer, "block_sparse_moe", None)
    routed = [moe.experts] if moe is not None else []
    E = moe.experts.w1.shape[0] if moe is not None else 1
    top = cfg.num_experts_per_token if moe is not None else 0
    dense_bytes = nbytes(layer) - nbytes(layer.embed_tokens, *routed)
    dense_params = numel(layer) - numel(layer.embed_tokens, *routed)
    R, latent = N * CATCH_UP, cfg.mla_cache_dim * elt
    keys = sum(N * (head + j) for j in range(1, k + 1))
    write = (layer.eh_proj, layer.enorm, layer.hnorm, layer.input_layernorm, attn.in_proj, attn.kv_a_layernorm)
    byts = (nbytes(*write) + R * cfg.hidden_size * elt + R * latent
            + k * (dense_bytes + experts_active * nbytes(*routed) / E) + keys * latent)
    flops = (2 * R * numel(*write) + 2 * k * N * (dense_params + top * numel(*routed) / E)
             + keys * cfg.num_attention_heads * 2 * (cfg.mla_cache_dim + cfg.kv_lora_rank))
    return byts, flops


# ---- one slice at one batch --------------------------------------------------------------------------------
def graphs_for(target, cache, N: int, L: int, max_len: int, dev: Device, aux=()) -> DecodeGraphs:
    """The engine's decode (L = 1) or verify graph of N sequences alone (no other batch size is captured)."""
    graphs = DecodeGraphs(target, cache, N, max_len, L, aux_layers=aux)
    graphs.batches = {(N, L): graphs.batches[N, L]}
    if dev.cuda:
        graphs.capture()
    else:
        graphs.graphs[N, L] = (Eager(lambda: graphs.step(N, L)), None)
    return graphs


def replays(graphs: DraftGraphs, work, states: torch.Tensor):
    """The draft's captured step alone: the states gathered, the catch-up (a KDA first layer's rounds) and each
    position's graph (None when no captured graph holds ``work``, or a KDA first layer's catch-up runs eagerly)."""
    plan = graphs.plan(work)
    rounds = graphs.stage_rounds(work, graphs.rounds_for(work)) if graphs.recurrent else None
    if plan is None or (graphs.recurrent and rounds is None):
        return None
    (R, chain), T = plan, len(work.rows)

    def replay():
        torch.index_select(states, 0, graphs.rows[3, :T], out=graphs.states[:T])
        if rounds is not None and rounds[1]:
            graphs.graphs["rounds", *rounds].replay()
        graphs.graphs["rows", R].replay()
        for key in chain:
            graphs.graphs[key].replay()
    return replay


def case(target, drafts: dict, N: int, args, dev: Device, bw: float, mm: float) -> list[dict]:
    """Rows of one batch size: the plain step, then each draft's own step and its verify step."""
    k, ctx, bs = args.k, args.context, dev.block_size
    L, text = k + 1, target.config.text
    max_len = ctx + 2 * k + bs
    per_seq = ceil_div(ctx + L, bs)
    cache = HybridCache.allocate(text, num_slots=1 + N + N * k, num_blocks=N * per_seq + 1, block_size=bs,
                                 dtype=dev.dtype, device=dev.name)
    fill_history(cache, N)
    slots = list(range(1, N + 1))
    tables = [list(range(1 + n * per_seq, 1 + (n + 1) * per_seq)) for n in range(N)]
    ids = torch.randint(100, text.vocab_size, (N, L)).tolist()
    plain = graphs_for(target, cache, N, 1, max_len, dev)
    plain.run(*pack_decode_inputs([t[0] for t in ids], [ctx] * N, slots, tables, bs, N), N)
    t_plain = dev.time(plain.graphs[N, 1][0].replay)
    active = touched_experts(lambda: plain.step(N, 1))
    byts, flops = counts(target, N, 0, "decode", active, ctx)
    floor_plain = max(byts / bw, flops / mm)
    rows = []
    log(f"  b{N} plain decode {t_plain * 1e3:.3f} ms (floor {floor_plain * 1e3:.3f})")
    checkpoints = [StateCheckpoint(n, j, 1 + N + n * k + j - 1) for n in range(N) for j in range(1, L)]
    row_slots = row_state_rows([L] * N, slots, checkpoints).tolist()
    for name, (draft, executor) in drafts.items():
        verify = graphs_for(target, cache, N, L, max_len, dev, draft.aux_layer_ids)
        verify.run(*pack_decode_inputs(ids, [ctx] * N, slots, tables, bs, N, row_slots), N)
        t_verify = dev.time(verify.graphs[N, L][0].replay)
        active_v = touched_experts(lambda: verify.step(N, L))
        vb, vf = counts(target, N, 0, "decode", active_v, ctx, rows=L)
        states = verify.states(N, L)
        blocks_each = ceil_div(ctx + 2 + k, bs) + 1
        work, _ = work_of(N, ctx + 2, k, blocks_each, 1 + N * blocks_each, bs, rows_each=L)
        call = lambda: executor.run(work, states)           # noqa: E731 (the engine's call: drafts on the host)
        drafts_out = call()
        assert len(drafts_out) == N and all(len(d) == k for d in drafts_out), drafts_out[:2]
        t_call = dev.time(call)
        graphs, executor.graphs = executor.graphs, None
        t_eager = dev.time(call)
        executor.graphs = graphs
        alone = replays(executor.graphs, work, states) if executor.graphs is not None else None
        t_draft = dev.time(alone) if alone is not None else t_call
        if isinstance(draft, MTPDraft):
            active_d = touched_experts(call)
            db, df = mtp_counts(draft, N, k, ctx + 1, active_d)
        else:
            db, df = eagle3_counts(draft, N, k, ctx + 1)
        floor_draft, floor_verify = max(db / bw, df / mm), max(vb / bw, vf / mm)
        row = {"draft": name, "batch": N, "k": k, "context": ctx, "plain_ms": t_plain * 1e3,
               "plain_floor_ms": floor_plain * 1e3, "plain_over_floor": t_plain / floor_plain,
               "experts_touched_plain": active, "draft_ms": t_draft * 1e3, "draft_call_ms": t_call * 1e3,
               "draft_eager_ms": t_eager * 1e3,
               "draft_graphs": alone is not None, "draft_floor_ms": floor_draft * 1e3,
               "draft_over_floor": t_draft / floor_draft, "draft_bytes": db, "draft_flops": df,
               "verify_ms": t_verify * 1e3, "verify_floor_ms": floor_verify * 1e3,
               "verify_over_floor": t_verify / floor_verify, "experts_touched_verify": active_v,
               "verify_bytes": vb, "verify_flops": vf, "plain_bytes": byts, "plain_flops": flops,
               "breakeven": (t_draft + t_verify) / t_plain,
               "breakeven_call": (t_call + t_verify) / t_plain,
               "floor_breakeven": (floor_draft + floor_verify) / floor_plain}
        log(f"  {row}")
        rows.append(row)
        del verify
    return rows


def run_slice(name: str, args, dev: Device, results: dict) -> None:
    """Both drafts of slice ``name`` at every batch size, into ``results["rows"]`` (saved after each batch)."""
    bw, mm = results["copy_bytes_per_s"], results["matmul_flops"]
    t0 = time.perf_counter()
    target = build_target(name, dev)
    shape = EAGLE3["cpu" if not dev.cuda else name]
    drafts = {"eagle3": eagle3_draft(target, shape, dev)}
    if name == "k3" and not args.no_mtp:
        drafts["mtp"] = mtp_draft(target, dev)
    log(f"{name}: target and drafts built in {time.perf_counter() - t0:.1f} s"
        + (f"; {torch.cuda.memory_allocated() / 2**30:.1f} GiB" if dev.cuda else ""))
    batches = [int(b) for b in args.batches.split(",")]
    max_len = args.context + 2 * args.k + dev.block_size
    blocks = 1 + max(batches) * (ceil_div(args.context + 2 + args.k, dev.block_size) + 3)
    executors = {}
    with torch.inference_mode():
        for dname, draft in drafts.items():
            ex = DraftExecutor(draft, allocate_draft_cache(draft, blocks, dev.block_size, 1 + max(batches)),
                               dev.block_size)
            if DraftGraphs.can_capture(draft):
                graphs = (DraftGraphs if dev.cuda else EagerDraftGraphs)(draft, ex.cache, dev.block_size, max(batches),
                                                                        max_len, args.k, target.dtype)
                ex.graphs = capture_draft_or_none(graphs)
            executors[dname] = (draft, ex)
        log(f"{name}: draft graphs captured at {time.perf_counter() - t0:.1f} s")
        for N in batches:
            results["rows"] += [{"slice": name, **r} for r in case(target, executors, N, args, dev, bw, mm)]
            save_results("bench_spec_slice.json", results)
            if dev.cuda:
                torch.cuda.empty_cache()
    log(f"{name}: done in {time.perf_counter() - t0:.1f} s")


def table(rows: list[dict]) -> str:
    out = ["| slice | draft | batch | plain ms (/floor) | draft k=%d ms (/floor) | draft call ms (eager) "
           "| verify ms (/floor) | draft + verify ms (/floor) | break-even tokens/step (floors) |"
           % (rows[0]["k"] if rows else 0), "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        spec, floor = r["draft_ms"] + r["verify_ms"], r["draft_floor_ms"] + r["verify_floor_ms"]
        out.append(f"| {r['slice']} | {r['draft']}{'' if r['draft_graphs'] else ' (eager)'} | {r['batch']} "
                   f"| {r['plain_ms']:.3f} ({r['plain_over_floor']:.2f}) | {r['draft_ms']:.3f} "
                   f"({r['draft_over_floor']:.2f}) | {r['draft_call_ms']:.3f} ({r['draft_eager_ms']:.3f}) "
                   f"| {r['verify_ms']:.3f} "
                   f"({r['verify_over_floor']:.2f}) | {spec:.3f} ({spec / floor:.2f}) "
                   f"| {r['breakeven']:.2f} ({r['floor_breakeven']:.2f}) |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="tiny configs in float32 on the CPU, eager (a smoke run)")
    ap.add_argument("--k", type=int, default=4, help="drafts a step (the verify step runs k + 1 rows a sequence)")
    ap.add_argument("--batches", default=None, help="batch sizes (default 1,32; --cpu: 1,4)")
    ap.add_argument("--slices", default="k3,kl", help="k3 and/or kl")
    ap.add_argument("--context", type=int, default=None, help="history tokens a sequence (default 4096; --cpu: 40)")
    ap.add_argument("--no-mtp", action="store_true", help="no MTP draft on the K3 slice")
    args = ap.parse_args()
    if args.k < 1:
        ap.error(f"--k must be at least 1, got {args.k}")
    unknown = [s for s in args.slices.split(",") if s not in SLICES]
    if unknown:
        ap.error(f"--slices: unknown {unknown}; known: {', '.join(SLICES)}")
    from kimik3.model.cuda_graphs import VERIFY_GRAPH_MAX_SEQS
    batches = [int(b) for b in (args.batches or "1").split(",")]
    if min(batches) < 1 or max(batches) > VERIFY_GRAPH_MAX_SEQS:
        ap.error(f"--batches must lie in 1..{VERIFY_GRAPH_MAX_SEQS} (the verify graphs' largest batch), got {batches}")
    if args.cpu:
        torch.set_num_threads(1)             # torch's threads fight over the shared cores (60x slower steps)
        dev = Device("cpu", torch.float32, 4)
        args.batches, args.context = args.batches or "1,4", args.context or 40
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_spec_slice.py needs CUDA (or --cpu for the smoke run)")
        torch.backends.cuda.matmul.allow_tf32 = False
        dev = Device("cuda", torch.bfloat16, 64)
        args.batches, args.context = args.batches or "1,32", args.context or 4096
    bw, mm = dev.ceilings()
    log(f"copy {bw / 1e9:.0f} GB/s, matmul {mm / 1e9:.0f} GFLOP/s")
    results = {"device": torch.cuda.get_device_name() if dev.cuda else "cpu", "commit": commit_id(),
               "date": datetime.date.today().isoformat(), "k": args.k, "context": args.context,
               "copy_bytes_per_s": bw, "matmul_flops": mm, "draft_vocab": DRAFT_VOCAB, "catch_up_rows": CATCH_UP,
               "eagle3_shapes (heads, kv heads, head dim, intermediate)": EAGLE3, "rows": []}
    for name in args.slices.split(","):
        run_slice(name, args, dev, results)
    print(f"# draft + verify vs floor, k = {args.k}, context {args.context}, {results['device']}, commit "
          f"{results['commit']}, {results['date']}; floors at {bw / 1e9:.0f} GB/s and {mm / 1e9:.0f} GFLOP/s")
    print(table(results["rows"]))
    log(f"saved {save_results('bench_spec_slice.json', results)}")


if __name__ == "__main__":
    main()
