"""Rank 0's runner under tensor/expert parallelism: the plain ``ModelRunner`` plus one broadcast
of each step before its forward or graph replay, and the images encoded by all ranks (the workers' side and the step protocol:
``kimik3.parallel.worker``)."""

from __future__ import annotations

import logging

import torch

from kimik3.engine.config import EngineConfig
from kimik3.engine.run.runner import ModelRunner
from kimik3.model.batch import ForwardBatch
from kimik3.model.cuda_graphs import DecodeGraphs, capture_or_none
from kimik3.model.draft_graphs import DraftGraphs, capture_draft_or_none
from kimik3.parallel.encoder_dp import EncodeImages, encode_share
from kimik3.parallel.pipeline import micro_batch_bounds, run_stage
from kimik3.parallel.worker import (CaptureDraftGraphs, CaptureGraphs, DraftSetup, ExpertLoads, RebalanceExperts, agree,
                                    broadcast, gather_loads, rebalance, send_draft_work, send_geometry, send_graph_step,
                                    send_step)

logger = logging.getLogger(__name__)


class ParallelRunner(ModelRunner):
    """``control``: the group's gloo control group; ``on_failure(why)``: called when a step raises
    (the group is then lost: ``ParallelGroup.fail``). Decode CUDA graphs: every rank captures its
    own (``CaptureGraphs``), and a graph step is broadcast before each rank replays it. A draft model runs on every
    rank (``attach_draft``), its own steps' graphs captured by every rank as well."""

    def __init__(self, model, cache, config: EngineConfig, *, control, on_failure=None, aux_layers: tuple[int, ...] = ()):
        self.control = control
        self.on_failure = on_failure
        self._ops: tuple[list, list] = ([], [])
        self._ids_on_device = False
        self._drafter = None                       # the drafter whose draft the workers loaded (``attach_draft``)
        # pipeline parallelism: micro-batches per step (``kimik3.parallel.pipeline``), by default one per stage
        self.micro_batches = config.pp_micro_batches or model.pipeline.num_stages
        send_geometry(cache, control)              # before the base class captures graphs (with the workers)
        super().__init__(model, cache, config, aux_layers)
        self.images.encode_items = self.encode_images

    def encode_images(self, pixels: list[torch.Tensor], grids: torch.Tensor) -> torch.Tensor:
        """Encoder data parallelism: every rank encodes its share of the step's new images, one all-gather
        (``kimik3.parallel.encoder_dp``)."""
        broadcast(EncodeImages([p.cpu() for p in pixels], grids.cpu()), self.control)
        return encode_share(self.model, pixels, grids, self.images.encode)

    def capture_graphs(self, graphs: DecodeGraphs) -> DecodeGraphs | None:
        """Every rank captures at once (the graphs hold the step's collectives); all keep them only
        if all succeeded, else every rank runs eagerly."""
        broadcast(CaptureGraphs(graphs.sizes[-1], graphs.max_model_len, graphs.max_query_len, graphs.aux_layers),
                  self.control)
        captured = capture_or_none(graphs, decode_only_retry=False)
        if not agree(captured is not None, self.control):
            if captured is not None:
                logger.warning("another rank could not capture its decode graphs; every rank runs eagerly")
            return None
        return captured

    def expert_loads(self) -> dict[int, tuple[list[int], list[int]]]:
        """EPLB: per MoE layer of every stage, its recorded logical loads and its placement (``worker.gather_loads``)."""
        if not self.model.parallel.eplb:
            raise ValueError("no expert loads are recorded: start with enable_eplb=True (and expert parallelism)")
        broadcast(ExpertLoads(), self.control)
        return gather_loads(self.model, self.control)

    def rebalance_experts(self) -> dict[int, tuple[float, float]]:
        """EPLB, live: every rank re-places its experts from the loads recorded so far (``worker.rebalance``),
        between two steps. Returns per MoE layer the max/mean of the EP ranks' measured loads and the max/mean the
        same loads give under the new placement. Decode graphs are dropped (eager from then on) when a move
        changed the MXFP4 kernels' scale range they were captured with."""
        if not self.model.parallel.eplb:
            raise ValueError("rebalance_experts needs enable_eplb=True (with enable_expert_parallel)")
        broadcast(RebalanceExperts(), self.control)
        try:
            report, flipped = rebalance(self.model, self.control)
        except BaseException as e:
            if self.on_failure is not None:
                self.on_failure(f"rank 0 failed while the experts were moved: {e!r}")
            raise
        if flipped and self.graphs is not None:
            logger.warning("a rebalance moved MXFP4 experts whose scale range differs from the decode graphs' "
                           "capture; decode steps run eagerly from now on")
            self.graphs = None
        return report

    def attach_draft(self, drafter) -> None:
        """A draft model runs on every rank: the workers load their share of it (``DraftSetup``, once per drafter)
        and keep the target's states the draft reads; each step's draft work reaches them before rank 0 launches
        it. Then as on one device (``ModelRunner.attach_draft``): with decode graphs, every rank captures the draft's
        own steps (``capture_draft_graphs``); attaching again captures them again."""
        if drafter.source is None:
            raise ValueError("under tensor parallelism every rank loads the draft from its checkpoint: give "
                             "speculative_config's 'model' (a draft passed as an object cannot reach the workers)")
        if self._drafter is not drafter:
            self._drafter = drafter
            broadcast(DraftSetup(drafter.method, str(drafter.source), drafter.num_cache_blocks, drafter.block_size,
                                 drafter.num_cache_slots), self.control)
            launch, control = drafter.executor.launch, self.control
            drafter.may_lag = False       # every rank catches up from its own states: no rows wait on rank 0

            def launch_on_every_rank(work, states):
                send_draft_work(control, work)
                return launch(work, states)
            drafter.executor.launch = launch_on_every_rank
        super().attach_draft(drafter)

    def capture_draft_graphs(self, graphs: DraftGraphs) -> DraftGraphs | None:
        """Every rank captures the draft's steps at once (their collectives inside); all keep them only if all
        succeeded, else every rank drafts eagerly."""
        broadcast(CaptureDraftGraphs(graphs.max_num_seqs, graphs.max_model_len, graphs.k, graphs.states.dtype,
                                     graphs.min_span), self.control)
        captured = capture_draft_or_none(graphs)
        if not agree(captured is not None, self.control):
            if captured is not None:
                logger.warning("another rank could not capture its draft's graphs; every rank drafts eagerly")
            return None
        return captured

    def launch(self, out, input_ids: torch.Tensor | None = None):
        """The step's forward on every rank (sampling, after it, is rank 0's alone). ``input_ids``:
        async scheduling's device tokens, which reach the workers on the model's group; so do an eager step's ids
        when drafts still on the device were written into them (``out.pending_drafts``)."""
        self._ops = (list(out.state_copies), list(out.state_resets))
        self._ids_on_device = input_ids is not None or out.pending_drafts is not None
        try:
            return super().launch(out, input_ids)
        except BaseException as e:
            # a half-run step leaves the workers inside (or before) a collective: the group is lost
            if self.on_failure is not None:
                self.on_failure(f"rank 0 failed during a tensor-parallel step: {e!r}")
            raise

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch, rows: list[int]):
        pipe = self.model.pipeline
        bounds = micro_batch_bounds(batch, self.micro_batches) if pipe.enabled else None
        send_step(self.control, input_ids, batch, rows, *self._ops, model_group=self.model.parallel.group,
                  ids_on_device=self._ids_on_device, bounds=bounds)
        if not pipe.enabled:
            return super().run(input_ids, batch, rows)
        # pipeline: the first stage's part of each micro-batch, then the last stage's logits of ``rows``
        return run_stage(self.model, input_ids, batch, self.cache, rows, bounds)

    def run_graph(self, meta: torch.Tensor, tables: torch.Tensor, rows: list[int], num_seqs: int,
                  input_ids: torch.Tensor | None = None, drafts=None):
        send_graph_step(self.control, meta, tables, num_seqs, *self._ops, input_ids, self.model.parallel.group,
                        drafts)
        return super().run_graph(meta, tables, rows, num_seqs, input_ids, drafts)
