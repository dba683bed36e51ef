"""Rank 0's runner under tensor/expert parallelism: the plain ``ModelRunner`` plus one broadcast
of each step before its forward (the workers' side and the step protocol: ``kimik3.parallel.worker``)."""

from __future__ import annotations

import dataclasses
import logging

import torch

from kimik3.engine.config import EngineConfig
from kimik3.engine.runner import ModelRunner
from kimik3.model.batch import ForwardBatch
from kimik3.parallel.worker import send_geometry, send_step

logger = logging.getLogger(__name__)


class ParallelRunner(ModelRunner):
    """``control``: the group's gloo control group; ``on_failure(why)``: called when a step raises
    (the group is then lost: ``ParallelGroup.fail``). Decode CUDA graphs stay off whatever
    ``enforce_eager`` says: a graph replay would skip the step broadcast."""

    def __init__(self, model, cache, config: EngineConfig, *, control, on_failure=None):
        if not config.enforce_eager:
            logger.info("decode CUDA graphs are off under tensor parallelism (a replay would skip the step "
                        "broadcast); steps run eagerly")
        super().__init__(model, cache, dataclasses.replace(config, enforce_eager=True))
        self.control = control
        self.on_failure = on_failure
        self._ops: tuple[list, list] = ([], [])
        self._ids_on_device = False
        send_geometry(cache, control)

    def launch(self, out, input_ids: torch.Tensor | None = None):
        """The step's forward on every rank (sampling, after it, is rank 0's alone). ``input_ids``:
        async scheduling's device tokens, which reach the workers on the model's group."""
        self._ops = (list(out.state_copies), list(out.state_resets))
        self._ids_on_device = input_ids is not None
        try:
            return super().launch(out, input_ids)
        except BaseException as e:
            # a half-run step leaves the workers inside (or before) a collective: the group is lost
            if self.on_failure is not None:
                self.on_failure(f"rank 0 failed during a tensor-parallel step: {e!r}")
            raise

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch, rows: list[int]):
        send_step(self.control, input_ids, batch, rows, *self._ops, model_group=self.model.parallel.group,
                  ids_on_device=self._ids_on_device)
        return super().run(input_ids, batch, rows)
