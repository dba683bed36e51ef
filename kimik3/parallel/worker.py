"""Lock-step execution (spec parallelism §7.3): rank 0 schedules and samples, every rank runs
each step's forward on its shards. This is the workers' side (the model only); rank 0's side is
``kimik3.engine.parallel_runner.ParallelRunner``.

Per step rank 0 broadcasts one ``StepDescriptor`` (the packed input ids, the ``ForwardBatch``,
the rows to sample, the KDA state copies/resets of the step) on the gloo control group; each
worker applies the cache ops, runs ``forward_step`` and joins the LM-head gather. Under async
scheduling a step's input ids are the previous step's samples, still on rank 0's device: the
descriptor then carries their count, and the ids follow as a broadcast on the model's own group
(NCCL on GPUs: from device to device, without a wait on rank 0's host). The cache
geometry goes once at start (``CacheGeometry``); ``None`` ends the loop. Workers decide nothing:
the prefix registry, block and slot choices live on rank 0 only.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kimik3.model.batch import ForwardBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheGeometry:
    num_slots: int
    num_blocks: int
    block_size: int


@dataclass
class StepDescriptor:
    input_ids: torch.Tensor | int            # [T] int64 on the host, or T: the ids follow on the model's group
    batch: ForwardBatch                      # tensors on the host
    rows: list[int]                          # packed rows whose logits are gathered
    state_copies: list[tuple[int, int]]      # applied before the forward, in order
    state_resets: list[int]


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
    broadcast(CacheGeometry(cache.kda_state.shape[1], cache.mla_latent.shape[1], cache.block_size), control)


def send_step(control, input_ids: torch.Tensor, batch: ForwardBatch, rows: list[int],
              state_copies: list[tuple[int, int]], state_resets: list[int], model_group=None,
              ids_on_device: bool = False) -> None:
    """Rank 0, before each forward: the step every worker runs with it. ``ids_on_device``: the ids
    are a device tensor still being computed (async scheduling); they go on ``model_group``."""
    ids = input_ids.numel() if ids_on_device else input_ids.cpu()
    broadcast(StepDescriptor(ids, _moved(batch, torch.device("cpu")), list(rows), list(state_copies),
                             list(state_resets)), control)
    if ids_on_device:
        dist.broadcast(input_ids, src=_first_rank(model_group), group=model_group)


def _first_rank(group) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)


def stop_workers(control) -> None:
    """Rank 0: tell the workers to leave their loop (before or after the cache geometry)."""
    broadcast(None, control)


@torch.inference_mode()
def worker_loop(model, control) -> int:
    """Run steps as rank 0 describes them until it says stop; returns the number of steps."""
    device = torch.device(model.device)
    geometry: CacheGeometry | None = broadcast(None, control)
    if geometry is None:                 # rank 0 stopped before its engine was built
        return 0
    cache = model.allocate_cache(geometry.num_slots, geometry.num_blocks, geometry.block_size)
    steps = 0
    while True:
        step: StepDescriptor | None = broadcast(None, control)
        if step is None:
            return steps
        for src, dst in step.state_copies:
            cache.copy_state(src, dst)
        for slot in step.state_resets:
            cache.reset_state(slot)
        if isinstance(step.input_ids, int):       # async scheduling: the ids come from rank 0's device
            ids = torch.empty(step.input_ids, dtype=torch.int64, device=device)
            dist.broadcast(ids, src=_first_rank(model.parallel.group), group=model.parallel.group)
        else:
            ids = step.input_ids.to(device)
        hidden = model.forward_step(ids, _moved(step.batch, device), cache)
        if step.rows:
            model.compute_logits(hidden[torch.tensor(step.rows, device=device)])
        steps += 1
