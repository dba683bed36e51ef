"""Lock-step execution (spec parallelism §7.3): rank 0 schedules and samples, every rank runs
each step's forward on its shards. This is the workers' side (the model only); rank 0's side is
``kimik3.engine.run.parallel_runner.ParallelRunner``.

Per step rank 0 broadcasts one ``StepDescriptor`` (the packed input ids, the ``ForwardBatch``,
the rows to sample, the KDA state copies/resets of the step) on the gloo control group; each
worker applies the cache ops, runs ``forward_step`` and joins the LM-head gather. A step's image
embeddings follow the descriptor as one broadcast on the model's group; the images themselves are
encoded by all ranks before it (``EncodeImages``: ``encoder_dp.py``). Pipeline parallelism: every rank
gets each step and runs its stage's part of it (``pipeline.run_stage``): the step's micro-batches, each from
the previous stage's stream to the next stage (the last stage's TP rank 0 sends the logits to rank 0), so
stages overlap on consecutive micro-batches; one engine step is in the pipe at a time. Under async
scheduling a step's input ids are the previous step's samples, still on rank 0's device: the
descriptor then carries their count, and the ids follow as a broadcast on the model's own group
(NCCL on GPUs: from device to device, without a wait on rank 0's host). The cache
geometry goes once at start (``CacheGeometry``); ``None`` ends the loop. Workers decide nothing:
the prefix registry, block and slot choices live on rank 0 only.

EPLB: ``RebalanceExperts`` has every rank move its experts to a placement planned from the loads recorded so
far, between two steps (``rebalance``); ``ExpertLoads`` gathers every stage's recorded loads to rank 0.

A draft model (speculative decoding) runs on every rank, split as the target is: ``DraftSetup`` (once, before the
first step) has each worker load its share of the draft and its cache and keep the target's auxiliary-layer
states of every step; after each step rank 0 broadcasts the step's ``DraftWork`` (``model/draft_step.py``) and every
rank runs it (its collectives inside), rank 0 keeping the drafts.

Decode CUDA graphs: ``CaptureGraphs`` has every rank capture its own graphs (their collectives
inside) at the same time, and all keep them only if every rank succeeded (``agree``); a pure decode
step is then a ``GraphStep`` (the packed decode inputs), which each rank replays. With a draft model the graphs
also keep the target's states the draft reads (``aux_layers``), and ``CaptureDraftGraphs`` has every rank capture
the draft's own steps the same way (``model/draft_graphs.py``: Eagle3, DFlash); a draft step then replays them on
every rank where they fit (the plan follows the ``DraftWork`` alone), else runs eagerly on every rank. Drafts still
on rank 0's device when their verify step is launched (``spec/device_drafts.py``) reach the workers on the model's
group: a graph step's (input row, token) pairs (``GraphStep.num_drafts``), an eager step's whole input ids.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kimik3.model.batch import ForwardBatch
from kimik3.model.cuda_graphs import DecodeGraphs, capture_or_none
from kimik3.model.draft_graphs import DraftGraphs, capture_draft_or_none
from kimik3.model.draft_step import DraftExecutor, DraftWork, allocate_draft_cache
from kimik3.parallel.encoder_dp import EncodeImages, encode_share
from kimik3.parallel.pipeline import run_stage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheGeometry:
    num_slots: int
    num_blocks: int
    block_size: int
    latent_dtype: torch.dtype | None = None      # the MLA latent rows' dtype (None: the model's)


@dataclass
class StepDescriptor:
    input_ids: torch.Tensor | int            # [T] int64 on the host, or T: the ids follow on the model's group
    batch: ForwardBatch                      # tensors on the host
    rows: list[int]                          # packed rows whose logits are gathered
    state_copies: list[tuple[int, int]]      # applied before the forward, in order
    state_resets: list[int]
    embeds: tuple | None = None              # ((M, D), dtype) of image embedding rows that follow on the model's group
    bounds: list[int] | None = None          # pipeline: the micro-batches' packed-row bounds (``pipeline.py``)


@dataclass
class GraphStep:
    meta: torch.Tensor                       # [5, size * L] int64 host (``cuda_graphs.pack_decode_inputs``)
    block_tables: torch.Tensor               # [size, width] int32 host
    num_seqs: int
    ids_on_device: bool                      # async scheduling: the ids follow on the model's group
    state_copies: list[tuple[int, int]]
    state_resets: list[int]
    num_drafts: int = 0                      # drafts still on rank 0's device: [2, n] (input rows, tokens) follow


@dataclass(frozen=True)
class RebalanceExperts:
    """EPLB, live: every rank re-places its MoE layers' experts between two steps (``rebalance``)."""


def rebalance(model, control) -> tuple[dict[int, tuple[float, float]], bool] | None:
    """Every rank, on ``RebalanceExperts``: this rank's ``KimiForCausalLM.rebalance_experts``, the reports gathered
    to rank 0 over ``control``: (per layer (max/mean measured, planned), whether a scale range changed anywhere)
    on rank 0, None elsewhere."""
    mine = model.rebalance_experts()
    rank = dist.get_rank()
    box = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, box, dst=0, group=control)
    if box is None:
        return None
    report = {}
    for layers, _ in box:                 # TP ranks of a stage report the same layers; stages differ
        for i, v in layers.items():
            report.setdefault(i, v)
    return dict(sorted(report.items())), any(flipped for _, flipped in box)


@dataclass(frozen=True)
class ExpertLoads:
    """EPLB: every rank reports its MoE layers' recorded loads and placements (``gather_loads``)."""


def gather_loads(model, control) -> dict[int, tuple[list[int], list[int]]] | None:
    """Every rank, on ``ExpertLoads``: on rank 0, per MoE layer of every pipeline stage (tokens routed to each
    logical expert since its last placement, summed over the TP ranks when the MoE runs token-sharded; the
    placement's slots), gathered over ``control``; None elsewhere."""
    mine = {i: (moe.expert_load.tolist(), moe.placement.slots) for i, moe in model.moe_layers().items()
            if moe.expert_load is not None}
    box = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, box, dst=0, group=control)
    if box is None:
        return None
    t, out = model.parallel.tp_size, {}
    for r, layers in enumerate(box):
        for i, (load, slots) in layers.items():
            if i not in out:
                out[i] = (load, slots)
            elif model.parallel.tokens_sharded and r % t:       # another TP rank's own tokens
                out[i] = ([a + b for a, b in zip(out[i][0], load)], slots)
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class CaptureGraphs:
    max_num_seqs: int
    max_model_len: int
    max_query_len: int        # 1 + speculative tokens: verify steps are captured too
    aux_layers: tuple[int, ...] = ()     # a draft model's target layers: the graphs keep their states


@dataclass(frozen=True)
class CaptureDraftGraphs:
    """Every rank captures its draft's own steps (``DraftGraphs``, the arguments rank 0's runner gave its own)."""
    max_num_seqs: int
    max_model_len: int
    k: int                    # drafts per request at most
    states_dtype: torch.dtype
    min_span: int             # the shortest key span


@dataclass(frozen=True)
class DraftSetup:
    method: str                   # speculative method of the draft (``loader.drafts.LOADERS``)
    path: str                     # its checkpoint (each rank loads its share)
    num_blocks: int               # blocks of the draft's cache (the target's and the chains' scratch blocks)
    block_size: int
    num_slots: int = 1            # state slots of a recurrent draft layer (the target's and scratch ones)


class DraftRunner:
    """A worker's draft: its share of the draft model, its cache and the target states of the last step."""

    def __init__(self, setup: DraftSetup, model):
        from kimik3.loader.drafts import load_draft
        draft = load_draft(setup.method, setup.path, model)
        cache = allocate_draft_cache(draft, setup.num_blocks, setup.block_size, setup.num_slots)
        self.executor = DraftExecutor(draft, cache, setup.block_size)
        self.aux_layers = tuple(draft.aux_layer_ids)
        self.states: torch.Tensor | None = None

    def capture(self, step: CaptureDraftGraphs, graphs_class, control) -> None:
        """Capture the draft's graphs as rank 0 does; all ranks keep them only if every rank captured."""
        ex = self.executor
        graphs = capture_draft_or_none(graphs_class(ex.draft, ex.cache, ex.block_size, step.max_num_seqs,
                                                    step.max_model_len, step.k, step.states_dtype, step.min_span))
        ex.graphs = graphs if agree(graphs is not None, control) else None

    def forward(self, model, ids, batch, cache):
        hidden, aux = model.forward_step(ids, batch, cache, self.aux_layers)
        self.states = torch.cat(aux, dim=-1)
        return hidden


def _moved(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    """The batch with every tensor field on ``device`` (fields added later travel too)."""
    changes = {f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
               if isinstance(getattr(batch, f.name), torch.Tensor)}
    return dataclasses.replace(batch, **changes)


def broadcast(obj, group) -> object:
    """Rank 0's ``obj`` on every rank of ``group`` (pickled; gloo)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def send_geometry(cache, control) -> None:
    """Rank 0, once: the cache shape the workers allocate."""
    broadcast(CacheGeometry(cache.kda_state.shape[1], cache.mla_latent.shape[1], cache.block_size,
                            cache.mla_latent.dtype), control)


def send_step(control, input_ids: torch.Tensor, batch: ForwardBatch, rows: list[int],
              state_copies: list[tuple[int, int]], state_resets: list[int], model_group=None,
              ids_on_device: bool = False, bounds: list[int] | None = None) -> None:
    """Rank 0, before each forward: the step every worker runs with it. ``ids_on_device``: the ids
    are a device tensor still being computed (async scheduling); they go on ``model_group``. ``bounds``: the
    pipeline micro-batches (``pipeline.micro_batch_bounds``)."""
    ids = input_ids.numel() if ids_on_device else input_ids.cpu()
    embeds = batch.embeds
    if embeds is not None:                     # image embeddings go device to device, not pickled
        batch = dataclasses.replace(batch, embeds=None)
    broadcast(StepDescriptor(ids, _moved(batch, torch.device("cpu")), list(rows), list(state_copies),
                             list(state_resets), None if embeds is None else (tuple(embeds.shape), embeds.dtype),
                             bounds), control)
    if ids_on_device:
        _send_ids(input_ids, model_group)
    if embeds is not None:
        dist.broadcast(embeds.contiguous(), src=_first_rank(model_group), group=model_group)


def send_graph_step(control, meta: torch.Tensor, block_tables: torch.Tensor, num_seqs: int,
                    state_copies: list[tuple[int, int]], state_resets: list[int], input_ids: torch.Tensor | None,
                    model_group=None, drafts: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Rank 0, before each graph replay: the inputs every worker replays its graph of that size with. ``drafts``:
    (input rows, tokens) of drafts still on the device (``DecodeGraphs.run``), sent device to device after the ids."""
    broadcast(GraphStep(meta.cpu(), block_tables.cpu(), num_seqs, input_ids is not None, list(state_copies),
                        list(state_resets), 0 if drafts is None else drafts[0].numel()), control)
    if input_ids is not None:
        _send_ids(input_ids, model_group)
    if drafts is not None:
        _send_ids(torch.stack(drafts), model_group)


def agree(ok: bool, control) -> bool:
    """Whether ``ok`` holds on every rank (each rank calls it with its own)."""
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=control)
    return bool(flag.item())


def _first_rank(group) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)


def _send_ids(ids: torch.Tensor, group) -> None:
    dist.broadcast(ids, src=_first_rank(group), group=group)


def _recv_ids(shape: int | tuple[int, ...], device: torch.device, group) -> torch.Tensor:
    ids = torch.empty(shape, dtype=torch.int64, device=device)
    dist.broadcast(ids, src=_first_rank(group), group=group)
    return ids


def send_draft_work(control, work: DraftWork) -> None:
    """Rank 0, after each committed step whose states the draft reads: the draft work every rank runs."""
    broadcast(work, control)


def stop_workers(control) -> None:
    """Rank 0: tell the workers to leave their loop (before or after the cache geometry)."""
    broadcast(None, control)


def _draft_message(draft: DraftRunner | None, step, model, control, graphs_class) -> DraftRunner | None:
    """A worker's draft after ``step``, one of the draft's messages (``DraftSetup``, ``CaptureDraftGraphs``,
    ``DraftWork``). The drafts of a step that replays graphs stay on the device: only rank 0 reads them."""
    if isinstance(step, DraftSetup):
        return DraftRunner(step, model)
    if isinstance(step, CaptureDraftGraphs):
        draft.capture(step, graphs_class, control)
    else:
        draft.executor.launch(step, draft.states)
    return draft


@torch.inference_mode()
def worker_loop(model, control, graphs_class=DecodeGraphs, draft_graphs_class=DraftGraphs) -> int:
    """Run steps as rank 0 describes them until it says stop; returns the number of steps.
    ``graphs_class`` / ``draft_graphs_class``: what ``CaptureGraphs`` / ``CaptureDraftGraphs`` build (tests pass
    stand-ins)."""
    device = torch.device(model.device)
    geometry: CacheGeometry | None = broadcast(None, control)
    if geometry is None:                 # rank 0 stopped before its engine was built
        return 0
    cache = model.allocate_cache(geometry.num_slots, geometry.num_blocks, geometry.block_size, geometry.latent_dtype)
    graphs = draft = None
    steps = 0
    while True:
        step = broadcast(None, control)
        if step is None:
            return steps
        first = model.pipeline.is_first              # pipeline: only the first stage takes ids and images
        if isinstance(step, EncodeImages):            # encoder data parallelism: this rank's share
            if first:
                encode_share(model, step.pixels, step.grid_thws)
            continue
        if isinstance(step, RebalanceExperts):
            rebalance(model, control)
            continue
        if isinstance(step, ExpertLoads):
            gather_loads(model, control)
            continue
        if isinstance(step, (DraftSetup, CaptureDraftGraphs, DraftWork)):
            draft = _draft_message(draft, step, model, control, draft_graphs_class)
            continue
        if isinstance(step, CaptureGraphs):
            graphs = capture_or_none(graphs_class(model, cache, step.max_num_seqs, step.max_model_len,
                                                  step.max_query_len, step.aux_layers), decode_only_retry=False)
            if not agree(graphs is not None, control):
                graphs = None
            continue
        if model.expert_offload is not None:     # this rank's hot experts, between steps as on rank 0 (runner.py)
            model.expert_offload.refresh()
        cache.apply_state_ops(step.state_copies, step.state_resets)
        if isinstance(step, GraphStep):
            group = model.parallel.group
            ids = _recv_ids(step.num_seqs, device, group) if step.ids_on_device else None
            drafts = _recv_ids((2, step.num_drafts), device, group).unbind() if step.num_drafts else None
            graphs.run(step.meta, step.block_tables, step.num_seqs, ids, drafts)
            if draft is not None:             # the states the draft reads: the graphs' fixed buffer
                draft.states = graphs.states(step.num_seqs, step.meta.shape[1] // step.block_tables.shape[0])
        else:
            if isinstance(step.input_ids, int):       # async scheduling: the ids come from rank 0's device
                ids = _recv_ids(step.input_ids, device, model.parallel.group)
            else:
                ids = step.input_ids.to(device)
            batch = _moved(step.batch, device)
            if step.embeds is not None and first:
                shape, dtype = step.embeds
                batch.embeds = torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(batch.embeds, src=_first_rank(model.parallel.group), group=model.parallel.group)
            if model.pipeline.enabled:                    # this stage's part; the logits go to rank 0
                run_stage(model, ids, batch, cache, step.rows, step.bounds)
            else:
                hidden = model.forward_step(ids, batch, cache) if draft is None else \
                    draft.forward(model, ids, batch, cache)
                if step.rows:
                    model.compute_logits(hidden[torch.tensor(step.rows, device=device)])   # the vocab gather
        steps += 1
