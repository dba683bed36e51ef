"""Runner: run one scheduled step on the model, eagerly or as a captured decode graph, then sample.

``execute``: the step's KDA state copies and resets, its inputs (``batch_builder.py``), one forward (a
``cuda_graphs.DecodeGraphs`` replay for a pure decode step that fits one, else one packed varlen
``forward_step``), the logits rows, then the sampler or, for drafts, the verifier (``speculative.py``).
"""

from __future__ import annotations

import logging
import time

import torch

from kimik3.engine.batch_builder import BatchBuilder
from kimik3.engine.config import EngineConfig
from kimik3.engine.cuda_graphs import DecodeGraphs, capture_or_none
from kimik3.engine.encoder_cache import ImageEncoder
from kimik3.engine.logit_controls import controlled_logits
from kimik3.engine.sampler import Sampler, SamplerOutput, on_device
from kimik3.engine.speculative import row_spans, verify
from kimik3.model.batch import ForwardBatch, HybridCache

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model, cache: HybridCache, config: EngineConfig):
        self.model = model
        self.cache = cache
        self.device = torch.device(model.device)
        self.images = ImageEncoder(model, config.encoder_cache_tokens)
        self.batches = BatchBuilder(cache.block_size, self.device, self.images)
        self.sampler = Sampler(model.config.text.vocab_size, self.device, config.seed)
        self.host_seconds = 0.0     # batch building + sampling (sampling waits for the device's step)
        self.prepare_seconds = 0.0  # batch building alone
        self.model_seconds = 0.0    # the step's launch and any image encoding
        self.num_steps = self.num_graph_steps = 0
        self.graphs: DecodeGraphs | None = None
        if not config.enforce_eager and self.device.type == "cuda":
            self.graphs = capture_or_none(DecodeGraphs(model, cache, config.max_num_seqs, config.max_model_len))

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch, rows: list[int]) -> torch.Tensor | None:
        """The eager step: one packed forward, then the logits of ``rows``."""
        hidden = self.model.forward_step(input_ids, batch, self.cache)
        return self.model.compute_logits(hidden[on_device(rows, torch.int64, self.device)]) if rows else None

    def run_graph(self, meta: torch.Tensor, tables: torch.Tensor, rows: list[int], num_seqs: int) -> torch.Tensor | None:
        """The graph step: replay, then the logits of the chunks that sample."""
        logits = self.graphs.run(meta, tables, num_seqs)
        self.num_graph_steps += 1
        if len(rows) == num_seqs:
            return logits
        return logits[on_device(rows, torch.int64, self.device)] if rows else None

    def sample(self, out, logits: torch.Tensor | None) -> SamplerOutput:
        """One token per sampling chunk, in chunk order (after its accepted drafts, if it has any):
        logit controls first (``logit_controls.py``), then the sampler or the draft verifier."""
        chunks = [c for c in out.chunks if c.samples]
        if logits is None:
            return SamplerOutput([], [])
        raw = logits
        if any(c.req.params.has_controls for c in chunks):
            logits = controlled_logits(chunks, row_spans(chunks), logits)
        if any(c.draft for c in chunks):
            return verify(self.sampler, chunks, logits, raw)
        return self.sampler.sample_rows([c.req for c in chunks], logits, raw)

    @torch.inference_mode()
    def execute(self, out) -> SamplerOutput:
        """Run one step; returns one token per sampling chunk, in chunk order."""
        t0, enc0 = time.perf_counter(), self.images.seconds
        for src, dst in out.state_copies:
            self.cache.copy_state(src, dst)
        for slot in out.state_resets:
            self.cache.reset_state(slot)
        size = self.batches.graph_size(out, self.graphs)
        if size is None:
            step = self.batches.build(out)
            t1 = time.perf_counter()
            logits = self.run(step.input_ids, step.batch, step.rows)
            if step.prompt_rows:      # the prompt-scoring rows come last
                n = len(step.prompt_rows)
                self.sampler.record_prompt_logprobs(step.prompt_rows, logits[-n:])
                logits = logits[:-n] if logits.shape[0] > n else None
        else:
            meta, tables, rows = self.batches.build_decode(out, size)
            t1 = time.perf_counter()
            logits = self.run_graph(meta, tables, rows, len(out.chunks))
        self.images.release(out.chunks)
        t2 = time.perf_counter()
        result = self.sample(out, logits)
        encode = self.images.seconds - enc0         # images encoded while building the batch count as model time
        prepare, launch, sampling = t1 - t0 - encode, t2 - t1 + encode, time.perf_counter() - t2
        self.prepare_seconds += prepare
        self.host_seconds += prepare + sampling
        self.model_seconds += launch
        self.num_steps += 1
        logger.debug("step %d: %d seqs, %d tokens, %s, prepare %.2f ms, launch %.2f ms, sample %.2f ms",
                     self.num_steps, len(out.chunks), out.num_tokens, "eager" if size is None else f"graph {size}",
                     prepare * 1e3, launch * 1e3, sampling * 1e3)
        return result
