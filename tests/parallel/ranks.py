"""Run a function on N gloo ranks (spawned processes, file:// rendezvous) and the rank-side
bodies of the parallel tests. Rank 0 writes what the test compares with ``torch.save``."""

from __future__ import annotations

import functools
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kimik3.distributed import ParallelContext, make_dcp_group
from kimik3.engine import EngineConfig, LLMEngine, SamplingParams
from kimik3.engine.run.parallel_runner import ParallelRunner
from kimik3.loader.load import load_model
from kimik3.model import ForwardBatch, StateCheckpoint
from kimik3.parallel.launch import init_rank
from kimik3.parallel.pipeline import micro_batch_bounds, run_stage
from kimik3.parallel.worker import stop_workers, worker_loop
from tests.engine.helpers import EagerReplayGraphs, FailingGraphs, count_calls
from tests.model.test_draft_graphs import EagerDraftGraphs


def spawn(fn, world: int, *args, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world, control, *args)`` on ``world`` CPU ranks; raise on failure or timeout."""
    init = f"file://{tempfile.mkdtemp()}/rendezvous"
    ctx = mp.start_processes(_entry, args=(fn, world, init, args), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{fn.__name__} on {world} ranks did not finish in {timeout:.0f} s")


def _entry(rank, fn, world, init, args):
    torch.set_num_threads(1)
    _, control = init_rank(rank, world, init, "cpu")
    try:
        fn(rank, world, control, *args)
    finally:
        dist.destroy_process_group()


# ---- stateful steps shared by the single-process reference and the ranks ----------------------
BLOCK = 2


def run_steps(model, seed: int = 0, micro_batches: int = 1):
    """Chunked prefill of two sequences (a KDA checkpoint after 2 tokens of A), two decode steps,
    then a third sequence resuming from A's checkpoint and first block (a prefix hit).
    Returns (logits of every step, on TP rank 0: else None; the embedding of A's prompt (None off the first
    pipeline stage); cache). Each step runs as ``micro_batches`` micro-batches: through the pipeline stages
    (``run_stage``; the logits then come to world rank 0), or in one process one after the other."""
    g = torch.Generator().manual_seed(seed)
    V = model.config.text.vocab_size
    a, b = torch.randint(5, V, (9,), generator=g).tolist(), torch.randint(5, V, (7,), generator=g).tolist()
    cache = model.allocate_cache(num_slots=12, num_blocks=24, block_size=BLOCK)
    tables = {0: list(range(1, 7)), 1: list(range(7, 13)), 2: [1] + list(range(13, 18))}
    done = {0: 0, 1: 0, 2: 2}
    slots = {0: 1, 1: 2, 2: 3}
    plan = [({0: a[0:4], 1: b[0:5]}, (StateCheckpoint(0, 2, 9),)),
            ({0: a[4:7]}, ()),
            ({0: [a[7]], 1: [b[5]]}, ()),
            ({0: [a[8]], 1: [b[6]]}, ()),
            ("copy", ()),
            ({2: a[2:6], 1: [a[1]]}, ())]
    out = []
    for chunks, checkpoints in plan:
        if chunks == "copy":
            cache.copy_state(9, slots[2])
            continue
        seqs = list(chunks)
        batch = ForwardBatch.build([len(chunks[s]) for s in seqs], [done[s] for s in seqs], [slots[s] for s in seqs],
                                   [tables[s] for s in seqs], BLOCK, checkpoints=checkpoints)
        ids = torch.tensor([t for s in seqs for t in chunks[s]])
        bounds = micro_batch_bounds(batch, micro_batches)
        if model.pipeline.enabled:
            out.append(run_stage(model, ids, batch, cache, list(range(len(ids))), bounds))
        else:                 # one process: the micro-batches one after the other
            parts = [batch.slice_rows(lo, hi) if len(bounds) > 2 else batch for lo, hi in zip(bounds, bounds[1:])]
            hidden = [model.forward_step(ids[lo:hi], part, cache) for (lo, hi), part in zip(zip(bounds, bounds[1:]), parts)]
            out.append(model.compute_logits(torch.cat(hidden)))
        for s in seqs:
            done[s] += len(chunks[s])
    with torch.inference_mode():
        emb = model.model.embed_tokens(torch.tensor(a)) if model.pipeline.is_first else None
    return out, emb, cache


def logits_rank(rank, world, control, ckpts: dict, layouts: dict, out_path: str):
    results = {}
    for arch, path in ckpts.items():
        for name, (ep, mode, tail, *extra) in layouts.items():
            dcp, redundant = (extra[0] if extra else 1), (extra[1] if len(extra) > 1 else None)
            par = ParallelContext(rank, world, None, ep, mode, tail, dcp_size=dcp,
                                  dcp_group=make_dcp_group(list(range(world)), dcp, rank),
                                  eplb=redundant is not None, num_redundant_experts=redundant or 0)
            loads = skewed_loads(load_model(path, dtype=torch.float64).config.text) if redundant is not None else None
            model = load_model(path, dtype=torch.float64, parallel=par, expert_loads=loads)
            logits, emb, cache = run_steps(model)
            results[arch, name] = (logits, emb, cache.kda_state, cache.kda_conv, cache.mla_latent)
    if rank == 0:
        torch.save(results, out_path)


def pipeline_rank(rank, world, control, ckpts: dict, layouts: dict, out_path: str):
    """Pipeline layouts: name -> (stages, EP on/off, two stages' cut layer or None: planned, micro-batches per
    step); TP = world / stages. Rank 0 saves the logits of ``run_steps`` and every rank's cached layer ids, stage
    ranges and parameter names and bytes."""
    from kimik3.parallel.launch import ParallelConfig
    results = {}
    for arch, path in ckpts.items():
        for name, (pp, ep, cut, micro) in layouts.items():
            L = load_model(path, dtype=torch.float64).config.text.num_hidden_layers
            cfg = ParallelConfig(world // pp, ep, pipeline_parallel_size=pp,
                                 pp_layer_partition=None if cut is None else (cut, L - cut))
            model = load_model(path, dtype=torch.float64, **cfg.join(rank, path))
            logits, _, cache = run_steps(model, micro_batches=micro)
            layers = sorted(cache.layer_index)
            params = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
            gathered = [None] * world
            dist.all_gather_object(gathered, (layers, model.pipeline.ranges, params), group=control)
            results[arch, name] = (logits, gathered)
    if rank == 0:
        torch.save(results, out_path)


def engine_prompts(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """Two rounds: the second shares prefixes with the first (prefix-cache hits)."""
    g = torch.Generator().manual_seed(3)
    first = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (13, 6, 21)]
    second = [first[0][:10] + [7, 8, 9], first[2][:16] + [11], first[1]]
    return first, second


def run_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 6) -> tuple[list[list[int]], int]:
    """Greedy outputs of the prompts and the prompt tokens served from the prefix cache."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p if isinstance(p, dict) else {"prompt_token_ids": p}, params)
    done: dict[str, list[int]] = {}
    hits = 0
    while engine.has_unfinished_requests():
        for d in engine.step():
            done.setdefault(d.request_id, []).extend(d.outputs[0].token_ids if d.outputs else [])
            hits += int(d.metrics.get("num_prefix_hit_tokens", 0)) if d.finished else 0
    return [done[str(i)] for i in range(len(prompts))], hits


ENGINE_CONFIG = dict(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64, block_size=4,
                     kda_checkpoint_interval=1, cache_memory_bytes=1 << 22)


def image_prompts(model) -> list[dict]:
    """Three image prompts (four images) that fit ENGINE_CONFIG's 64 tokens; the first prompt's two small
    images fall in its first 8-token chunk, so one step encodes two images (one on each rank)."""
    import numpy as np
    from PIL import Image

    from kimik3.vision.preprocess import preprocess_images

    def picture(w, h, seed):
        return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))
    pad = model.config.media_placeholder_token_id
    out = []
    for k, pics in enumerate([[picture(16, 30, 2), picture(20, 30, 5)], [picture(90, 60, 3)], [picture(50, 40, 4)]]):
        vis = preprocess_images(pics)
        ids = [7 + k, 8]
        for n in vis.num_tokens:
            ids += [pad] * n + [9 + k]
        out.append({"prompt_token_ids": ids, "multi_modal_data": vis})
    return out


def skewed_loads(text) -> dict[int, list[float]]:
    """A recorded load where, in every MoE layer, the first two experts take most tokens."""
    E = text.num_experts
    return {i: [1000.0, 600.0] + [10.0 * (j + 1) for j in range(E - 2)]
            for i in range(text.num_hidden_layers) if text.is_moe_layer(i)}


def engine_rank(rank, world, control, path: str, ep: int, mode: str, out_path: str, async_scheduling: bool = False,
                graphs: str | None = None, dcp: int = 1, image_prompts: list | None = None,
                redundant: int | None = None):
    """The engine on rank 0, workers elsewhere: (greedy outputs, prefix-hit tokens, steps launched
    ahead, graph steps, cache plan, images each rank encoded). ``graphs``: decode "graphs" as eager stand-ins on
    every rank ("all"), or with rank 1's capture failing ("rank1-fails"). ``dcp``: decode context parallel size.
    ``image_prompts``: run after the text rounds (their outputs appended). ``redundant``: EPLB with that many
    redundant slots, placed by ``skewed_loads`` (the result then ends with rank 0's recorded expert loads)."""
    par = ParallelContext(rank, world, None, ep, mode, dcp_size=dcp, eplb=redundant is not None,
                          num_redundant_experts=redundant or 0)
    loads = skewed_loads(load_model(path, dtype=torch.float64).config.text) if redundant is not None else None
    model = load_model(path, dtype=torch.float64, parallel=par, expert_loads=loads)
    encoded = count_images(model)
    if rank != 0:
        worker_loop(model, control, FailingGraphs if graphs == "rank1-fails" and rank == 1 else EagerReplayGraphs)
        torch.save(encoded, f"{out_path}.rank{rank}")
        return
    engine = LLMEngine(model, EngineConfig(**ENGINE_CONFIG, async_scheduling=async_scheduling),
                       runner_factory=functools.partial(ParallelRunner, control=control))
    if graphs is not None:            # on CPU the runner captures nothing by itself
        cfg = engine.config
        engine.runner.graphs = engine.runner.capture_graphs(EagerReplayGraphs(model, engine.cache, cfg.max_num_seqs,
                                                                              cfg.max_model_len))
    ahead = count_calls(engine.scheduler, "schedule_ahead")
    first, second = engine_prompts(model.config.text.vocab_size)
    (a, _), (b, hits) = run_engine(engine, first), run_engine(engine, second)
    images = run_engine(engine, image_prompts)[0] if image_prompts else []
    stop_workers(control)
    torch.save((a + b + images, hits, ahead.hits, engine.runner.num_graph_steps, engine.plan, encoded,
                model.expert_loads() if redundant is not None else None), out_path)


def count_images(model) -> list[int]:
    """A one-item list counting the images this rank's vision tower encodes."""
    box = [0]
    if hasattr(model, "vision"):
        fn = model.encode_images

        def counting(pixels, grids, *a, **k):
            box[0] += grids.shape[0]
            return fn(pixels, grids, *a, **k)
        model.encode_images = counting
    return box


SPEC_ENGINE_CONFIG = dict(max_num_seqs=3, max_num_batched_tokens=64, block_size=16, kda_checkpoint_interval=2,
                          cache_memory_bytes=1 << 24, num_speculative_tokens=3, speculative_ngram_min=1,
                          speculative_ngram_max=3)


def spec_prompts(vocab: int) -> list[list[int]]:
    """Prompts holding every token id, so each decode step finds an n-gram draft."""
    g = torch.Generator().manual_seed(5)
    return [torch.randperm(vocab, generator=g).tolist() for _ in range(2)]


def spec_engine_rank(rank, world, control, path: str, out_path: str, graphs: bool = False, dcp: int = 1):
    """``graphs``: decode and verify "graphs" as eager stand-ins on every rank (prefix caching off, so
    verify chunks carry no prefix checkpoint); also saves the verify replays of rank 0. ``dcp``: decode context
    parallel size (the latent cache striped over the TP ranks)."""
    model = load_model(path, dtype=torch.float64, parallel=ParallelContext(rank, world, dcp_size=dcp))
    if rank != 0:
        worker_loop(model, control, EagerReplayGraphs)
        return
    vocab = model.config.text.vocab_size
    cfg = EngineConfig(max_model_len=vocab + 16, **SPEC_ENGINE_CONFIG, enable_prefix_caching=not graphs)
    engine = LLMEngine(model, cfg, runner_factory=functools.partial(ParallelRunner, control=control))
    if graphs:
        engine.runner.graphs = engine.runner.capture_graphs(EagerReplayGraphs(
            model, engine.cache, cfg.max_num_seqs, cfg.max_model_len, 1 + cfg.num_speculative_tokens))
    outs, _ = run_engine(engine, spec_prompts(vocab))
    stop_workers(control)
    verify = sum(L > 1 for _, L in engine.runner.graphs.replayed) if graphs else 0
    torch.save((outs, engine.num_draft_tokens, engine.num_accepted_tokens, verify), out_path)


def slow_layers(model, seconds_per_token: float) -> None:
    """Make each held decoder layer sleep so that a micro-batch of n tokens takes ``n * seconds_per_token`` more on
    every stage (the overlap test's stand-in for a stage whose time grows with its tokens)."""
    from kimik3.model.kimi_k3 import DecoderLayer
    held = [m for m in model.model.layers if isinstance(m, DecoderLayer)]

    def slow(forward, stream, batch, *a):
        time.sleep(seconds_per_token * batch.num_tokens / len(held))
        return forward(stream, batch, *a)
    for layer in held:
        layer.forward = functools.partial(slow, layer.forward)


def pipeline_engine_rank(rank, world, control, path: str, micro: list[int], delay: float, out_path: str):
    """PP2 (TP = world / 2) through the engine, once per micro-batch count in ``micro``, each decoder layer slowed
    so a stage takes ``delay`` s more per token: rank 0 saves, per count, the greedy outputs and every rank's
    timeline (``PipelineContext.timeline``: per step, (micro-batch, start, end) of each stage's work)."""
    import dataclasses

    from kimik3.parallel.launch import ParallelConfig
    joined = ParallelConfig(world // 2, pipeline_parallel_size=2).join(rank, path)
    model = load_model(path, dtype=torch.float64, parallel=joined["parallel"],
                       pipeline=dataclasses.replace(joined["pipeline"], timeline=[]))
    slow_layers(model, delay)
    results = {}
    for m in micro:
        model.pipeline.timeline.clear()
        outs = None
        if rank == 0:
            engine = LLMEngine(model, EngineConfig(**ENGINE_CONFIG, pp_micro_batches=m),
                               runner_factory=functools.partial(ParallelRunner, control=control))
            outs = run_engine(engine, engine_prompts(model.config.text.vocab_size)[0], max_tokens=4)[0]
            stop_workers(control)
        else:
            worker_loop(model, control)
        gathered = [None] * world
        dist.all_gather_object(gathered, (model.pipeline.stage, list(model.pipeline.timeline)), group=control)
        results[m] = (outs, gathered)
    if rank == 0:
        torch.save(results, out_path)


def skew_router(path, hot: tuple[int, ...] = (2, 4), boost: float = 0.2) -> None:
    """Rewrite a tiny checkpoint so every MoE layer's router prefers experts ``hot`` (their score-correction bias
    raised by ``boost``): a skewed expert load that the even placement leaves on one EP rank."""
    from safetensors.torch import load_file, save_file
    for f in sorted(Path(path).glob("*.safetensors")):
        tensors = load_file(f)
        for name, t in tensors.items():
            if name.endswith("gate.e_score_correction_bias"):
                t[list(hot)] += boost
        save_file(tensors, f, metadata={"format": "pt"})


def rebalance_rank(rank, world, control, ckpts: dict, layouts: dict, out_path: str):
    """EP over the world with EPLB, evenly placed at start: ``run_steps``, a live rebalance on every rank
    (``rebalance_experts``), ``run_steps`` again on a fresh cache. Layouts: name -> (MoE mode, redundant slots).
    Rank 0 saves per (arch, layout): logits before and after, the rebalance report, the per-rank loads measured in
    the second run, and every rank's slots (logical expert, w13, w2 of each)."""
    results = {}
    for arch, path in ckpts.items():
        for name, (mode, redundant) in layouts.items():
            par = ParallelContext(rank, world, None, world, mode, eplb=True, num_redundant_experts=redundant)
            model = load_model(path, dtype=torch.float64, parallel=par)
            before = run_steps(model)[0]
            report, _ = model.rebalance_experts()
            after = run_steps(model)[0]
            measured = {}
            for i, moe in model.moe_layers().items():
                ran = par.all_reduce(moe.slot_load.clone()) if par.tokens_sharded else moe.slot_load
                measured[i] = ran.view(world, -1).sum(dim=1).tolist()
            slots = {i: (moe.experts.slot_experts, moe.experts.w13.detach().clone(), moe.experts.w2.detach().clone())
                     for i, moe in model.moe_layers().items()}
            gathered = [None] * world
            dist.all_gather_object(gathered, slots, group=control)
            results[arch, name] = (before, after, report, measured, gathered)
    if rank == 0:
        torch.save(results, out_path)


def pipeline_eplb_rank(rank, world, control, path: str, out_path: str):
    """PP2 x TP2 with EP and EPLB (2 redundant slots) through the engine: the prompts, every stage's recorded loads
    gathered to rank 0 (``ParallelRunner.expert_loads``), a live rebalance, the prompts again. Rank 0 saves (outputs
    before, loads, report, outputs after)."""
    from kimik3.parallel.launch import ParallelConfig
    cfg = ParallelConfig(world // 2, True, pipeline_parallel_size=2, enable_eplb=True, num_redundant_experts=2)
    model = load_model(path, dtype=torch.float64, **cfg.join(rank, path))
    if rank != 0:
        worker_loop(model, control)
        return
    engine = LLMEngine(model, EngineConfig(**ENGINE_CONFIG), runner_factory=functools.partial(ParallelRunner, control=control))
    prompts = engine_prompts(model.config.text.vocab_size)[0]
    before = run_engine(engine, prompts)[0]
    loads = engine.runner.expert_loads()
    report = engine.runner.rebalance_experts()
    after = run_engine(engine, prompts)[0]
    stop_workers(control)
    torch.save((before, loads, report, after), out_path)

DRAFT_ENGINE_CONFIG = dict(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=64, block_size=4,
                           kda_checkpoint_interval=1, cache_memory_bytes=1 << 22, num_speculative_tokens=3,
                           speculative_method="eagle3")


def record_drafts(box: list, held: dict | None = None) -> None:
    """Every draft step's drafts this process computes (collected at once: a worker never collects its own),
    appended to ``box``; every request drafts all it may (the controller's plan, which follows measured times,
    would differ between processes). ``held``: the parameter elements of the draft that ran (this rank's share),
    under "elements", and the draft steps that replayed the draft's graphs, under "replays"."""
    from kimik3.engine.spec.controller import DraftController
    from kimik3.model.draft_step import DraftExecutor
    launch = DraftExecutor.launch
    DraftController.plan = lambda self, rates, rooms, batch, watching, costs=None: [min(r, self.k) for r in rooms]

    def recording(self, work, states):
        collect, tokens = launch(self, work, states)
        out = collect()
        box.append(out)
        if held is not None:
            held["elements"] = sum(p.numel() for p in self.draft.parameters())
            held["replays"] = 0 if self.graphs is None else self.graphs.num_replays
        return (lambda: out), tokens
    DraftExecutor.launch = recording


class KeptReplayGraphs(EagerReplayGraphs):
    """Eager stand-ins that a worker keeps in ``made`` (its loop builds them)."""
    made: list = []

    def capture(self) -> None:
        super().capture()
        KeptReplayGraphs.made.append(self)


def replayed_ids(graphs) -> list[list[int]]:
    """The input ids of every replay of emulated decode / verify ``graphs`` (drafts from the device included)."""
    return [] if graphs is None else [meta[0].tolist() for meta, _, _ in graphs.seen]


class FailingDraftGraphs(EagerDraftGraphs):
    """A draft whose steps fail to capture on one rank (every rank then drafts eagerly): after the warm-ups and
    captures, whose collectives every rank must join."""

    def capture(self) -> None:
        super().capture()
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


def emulated_graphs(engine) -> list[bool]:
    """Rank 0 of a draft engine on emulated graphs, as ``ParallelRunner`` captures them on CUDA: decode / verify
    graphs keeping the draft's states, then the draft's own (``attach_draft`` again), every rank capturing its own.
    Returns a list that gets, per step with drafts still on the device (written into its rows), whether it
    replayed a graph."""
    runner, cfg = engine.runner, engine.config
    runner.graphs = runner.capture_graphs(EagerReplayGraphs(engine.model, engine.cache, cfg.max_num_seqs,
                                                            cfg.max_model_len, 1 + cfg.num_speculative_tokens,
                                                            aux_layers=runner.aux_layers))
    capture, launch, fed = runner.capture_draft_graphs, runner.launch, []

    def emulating(graphs):
        graphs.__class__ = EagerDraftGraphs
        return capture(graphs)

    def counting(out, input_ids=None):
        graph_steps = runner.num_graph_steps
        logits = launch(out, input_ids)
        if out.pending_drafts is not None:
            fed.append(runner.num_graph_steps > graph_steps)
        return logits
    runner.capture_draft_graphs, runner.launch = emulating, counting
    runner.attach_draft(engine.scheduler.drafter)
    return fed


def draft_engine_rank(rank, world, control, cases: dict, out_path: str):
    """Speculative decoding with draft models split over the ranks, one engine per case: ``cases`` name ->
    (target checkpoint, method, draft checkpoint, rounds of prompts, run one after the other: later rounds hit the
    prefix cache[, (expert parallel size, MoE mode, decode context parallel size) or None: TP alone[, graphs]]).
    ``graphs``: words: "sync" / "async" (scheduling): decode / verify graphs and the draft's own as eager stand-ins
    on every rank (``emulated_graphs``); prefix caching off, so verify chunks carry no prefix checkpoint and replay
    graphs, unless "prefix-caching"; "rank1-fails": rank 1 cannot capture the draft's. Rank 0 saves per case (greedy
    outputs of every round, verify chunks, the drafts of every draft step, the draft's parameter elements on the
    rank, draft steps on graphs, per step fed drafts still on the device whether it replayed a graph, target graph
    steps, the input ids of every graph replay); each worker saves per case (the drafts it computed, its draft's
    parameter elements, its draft steps on graphs, the input ids of its graph replays) in ``out_path.rank<r>``."""
    drafts: list = []
    held: dict = {}
    record_drafts(drafts, held)
    results = {}
    for name, (path, method, draft_path, rounds, *extra) in cases.items():
        drafts.clear()
        held.clear()
        ep, mode, dcp = extra[0] if extra and extra[0] else (1, "tep", 1)
        graphs = extra[1] if len(extra) > 1 else None
        par = ParallelContext(rank, world, None, ep, mode, dcp_size=dcp)
        model = load_model(path, dtype=torch.float64, parallel=par)
        if rank != 0:
            fails = "rank1-fails" in (graphs or "") and rank == 1
            KeptReplayGraphs.made.clear()
            worker_loop(model, control, KeptReplayGraphs, FailingDraftGraphs if fails else EagerDraftGraphs)
            results[name] = (list(drafts), held.get("elements"), held.get("replays"),
                             replayed_ids(KeptReplayGraphs.made[-1] if KeptReplayGraphs.made else None))
            continue
        cfg = EngineConfig(**{**DRAFT_ENGINE_CONFIG, "speculative_method": method}, speculative_model=draft_path,
                           async_scheduling="async" in (graphs or ""),
                           enable_prefix_caching=graphs is None or "prefix-caching" in graphs)
        engine = LLMEngine(model, cfg, runner_factory=functools.partial(ParallelRunner, control=control))
        fed = emulated_graphs(engine) if graphs else []
        outs = [run_engine(engine, prompts)[0] for prompts in rounds]
        stop_workers(control)
        results[name] = (outs, engine.num_drafts, list(drafts), held.get("elements"), held.get("replays"), fed,
                         engine.runner.num_graph_steps, replayed_ids(engine.runner.graphs))
    torch.save(results, out_path if rank == 0 else f"{out_path}.rank{rank}")


def pipeline_images_rank(rank, world, control, path: str, out_path: str):
    """PP2 (TP = world / 2) through the engine with the default micro-batches (one per stage) on ``image_prompts``.
    Rank 0 saves (greedy outputs, images each rank of the world encoded)."""
    from kimik3.parallel.launch import ParallelConfig
    model = load_model(path, dtype=torch.float64, **ParallelConfig(world // 2, pipeline_parallel_size=2).join(rank, path))
    encoded = count_images(model)
    if rank != 0:
        worker_loop(model, control)
    else:
        engine = LLMEngine(model, EngineConfig(**ENGINE_CONFIG),
                           runner_factory=functools.partial(ParallelRunner, control=control))
        outs = run_engine(engine, image_prompts(model))[0]
        stop_workers(control)
    gathered = [None] * world
    dist.all_gather_object(gathered, encoded[0], group=control)
    if rank == 0:
        torch.save((outs, gathered), out_path)


def offload_engine_rank(rank, world, control, path: str, layouts: dict, budgets: dict, out_path: str):
    """Expert offload on every rank (``budgets[name]`` bytes per rank, refreshed every step): per layout name -> (TP
    size, EP on/off, MoE mode, pipeline stages, miss policy, rounds, graphs), the engine on rank 0 (workers
    elsewhere) serves the first ``rounds`` rounds of ``engine_prompts`` (the second: prefix hits), decode steps as
    eager stand-in "graphs" on every rank when ``graphs``; the host policy runs under rates where the host wins.
    Rank 0 saves per layout (greedy outputs, prefix-hit tokens, graph steps, every rank's offload stats, cache /
    staging sizes, layers and offloaded bytes)."""
    from kimik3.model.expert_offload import ExpertOffloadConfig
    from kimik3.model.offload_policy import MissRates
    from kimik3.parallel.launch import ParallelConfig
    results = {}
    for name, (tp, ep, mode, pp, policy, rounds, graphs) in layouts.items():
        cfg = ParallelConfig(tp, ep, mode if ep else "tep", pipeline_parallel_size=pp)
        offload = ExpertOffloadConfig(budgets[name], refresh_interval=1, policy=policy,
                                      rates=MissRates(copy=1e3, host_sync=0.0) if policy == "host" else None)
        model = load_model(path, dtype=torch.float64, expert_offload=offload, **cfg.join(rank, path))
        outs = hits = None
        if rank == 0:
            engine = LLMEngine(model, EngineConfig(**ENGINE_CONFIG),
                               runner_factory=functools.partial(ParallelRunner, control=control))
            if graphs:                # on CPU the runner captures nothing by itself
                cfg = engine.config
                engine.runner.graphs = engine.runner.capture_graphs(
                    EagerReplayGraphs(model, engine.cache, cfg.max_num_seqs, cfg.max_model_len))
            outs, hits = [], 0
            for prompts in engine_prompts(model.config.text.vocab_size)[:rounds]:
                done, hits = run_engine(engine, prompts)
                outs += done
            hits = (hits, engine.runner.num_graph_steps)
            stop_workers(control)
        else:
            worker_loop(model, control, EagerReplayGraphs)
        o = model.expert_offload
        mine = (o.stats(), o.cache_size, o.staging_size, o.num_layers, o.num_layers * o.staging_size * o.expert_bytes)
        gathered = [None] * world
        dist.all_gather_object(gathered, mine, group=control)
        results[name] = (outs, hits, gathered)
    if rank == 0:
        torch.save(results, out_path)
