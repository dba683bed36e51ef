"""Runner: turn one scheduled step into one packed varlen forward, then sample.

prepare (host lists -> ForwardBatch), run (state restores + one model call), sample (logit rows of
the sequences that reached their last token). Batch building stays apart from the model call so
a CUDA-graph decode path can later replay into static buffers.
"""

from __future__ import annotations

import logging
import time

import torch

from kimik3.engine.sampler import SamplerOutput, SamplingBatch, sample
from kimik3.engine.scheduler import SchedulerOutput
from kimik3.model.batch import ForwardBatch, HybridCache

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model, cache: HybridCache, seed: int = 0):
        self.model = model
        self.cache = cache
        self.device = torch.device(model.device)
        self.vocab_size = model.config.text.vocab_size
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.host_seconds = 0.0     # Python time spent outside the model call (prepare + sample)
        self.model_seconds = 0.0
        self.num_steps = 0

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, ForwardBatch, list[int]]:
        """Packed input ids [T], the batch metadata, and the packed rows that need logits."""
        ids: list[int] = []
        rows: list[int] = []
        for c in out.chunks:
            ids.extend(c.req.token_ids[c.start:c.start + c.num_tokens])
            if c.samples:
                rows.append(len(ids) - 1)
        batch = ForwardBatch.build(
            query_lens=[c.num_tokens for c in out.chunks],
            context_lens=[c.start for c in out.chunks],
            state_slots=[c.req.state_slot for c in out.chunks],
            block_tables=[c.req.block_ids for c in out.chunks],
            block_size=self.cache.block_size, device=self.device,
            checkpoints=tuple(out.checkpoints))
        return torch.tensor(ids, dtype=torch.int64, device=self.device), batch, rows

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> SamplerOutput:
        """Run one step; returns one token per sampling chunk, in chunk order."""
        t0 = time.perf_counter()
        input_ids, batch, rows = self.prepare(out)
        for src, dst in out.state_copies:
            self.cache.copy_state(src, dst)
        for slot in out.state_resets:
            self.cache.reset_state(slot)
        t1 = time.perf_counter()
        hidden = self.model.forward_step(input_ids, batch, self.cache)
        result = SamplerOutput([], [])
        if rows:
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
            t2 = time.perf_counter()
            reqs = [c.req for c in out.chunks if c.samples]
            sb = SamplingBatch.build(
                [r.params for r in reqs], [r.generator for r in reqs],
                [r.prompt_token_ids for r in reqs], [r.output_token_ids for r in reqs],
                self.vocab_size, self.device) if any(not r.params.greedy or r.params.has_penalties
                                                     or r.params.logprobs is not None for r in reqs) else None
            result = sample(logits, sb, self.generator) if sb is not None else \
                SamplerOutput(logits.argmax(-1).tolist(), [None] * len(rows))
        else:
            t2 = time.perf_counter()
        t3 = time.perf_counter()
        host = (t1 - t0) + (t3 - t2)
        self.host_seconds += host
        self.model_seconds += t2 - t1
        self.num_steps += 1
        logger.debug("step %d: %d seqs, %d tokens, host %.2f ms, model %.2f ms", self.num_steps,
                     len(out.chunks), batch.num_tokens, host * 1e3, (t2 - t1) * 1e3)
        return result
