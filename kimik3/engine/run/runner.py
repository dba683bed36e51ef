"""Runner: run one scheduled step on the model, eagerly or as a captured decode graph, then sample.

``execute`` = ``launch``: the step's KDA state copies and resets, its inputs (``batch_builder.py``; images
through the vision tower's graphs, ``encoder_graphs.py``), one forward (a ``cuda_graphs.DecodeGraphs``
replay for a decode or verify step that fits one, else one packed varlen ``forward_step``), the logits
rows; then ``sample``: the sampler or, for drafts, the verifier (``spec/verify.py``). Async scheduling
calls the two apart, with the previous step's commit between.
"""

from __future__ import annotations

import logging
import time
from operator import attrgetter

import torch

from kimik3.engine.config import EngineConfig
from kimik3.engine.images.encoder_cache import ImageEncoder
from kimik3.engine.run.batch_builder import BatchBuilder
from kimik3.engine.sample.logit_controls import controlled_logits
from kimik3.engine.sample.logprobs import record_prompt_logprobs
from kimik3.engine.sample.sampler import PendingOutput, Sampler, SamplerOutput
from kimik3.engine.spec.verify import row_spans, verify
from kimik3.engine.transfer import on_device
from kimik3.model.batch import ForwardBatch, HybridCache
from kimik3.model.cuda_graphs import DecodeGraphs, capture_or_none
from kimik3.model.draft_graphs import DraftGraphs, capture_draft_or_none
from kimik3.model.encoder_graphs import EncoderGraphs, capture_encoder_or_none

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model, cache: HybridCache, config: EngineConfig, aux_layers: tuple[int, ...] = ()):
        """``aux_layers``: a draft model's target layers, whose input states every step keeps (eager and graph
        steps alike) for the drafter (``SchedulerOutput.draft_states``)."""
        self.model = model
        self.cache = cache
        self.device = torch.device(model.device)
        graphs = not config.enforce_eager and self.device.type == "cuda"
        self.encoder_graphs: EncoderGraphs | None = None
        if graphs and hasattr(model, "vision") and EncoderGraphs.can_capture(model.vision.vision_tower):
            self.encoder_graphs = capture_encoder_or_none(EncoderGraphs(model.vision.vision_tower))
        self.images = ImageEncoder(model, config.encoder_cache_tokens,
                                   self.encoder_graphs.encode if self.encoder_graphs else None)
        self.batches = BatchBuilder(cache.block_size, self.device, self.images)
        self.sampler = Sampler(model.config.text.vocab_size, self.device, config.seed, config.max_num_seqs)
        self.host_seconds = 0.0     # batch building + sampling's host work (not the wait for the device)
        self.prepare_seconds = 0.0  # batch building alone
        self.model_seconds = 0.0    # the step's launch and any image encoding
        self.num_steps = self.num_graph_steps = 0
        self.aux_layers = tuple(aux_layers)     # a draft model's layers: each step keeps their states
        self.last_states: torch.Tensor | None = None
        self.graphs: DecodeGraphs | None = None
        self.graph_limits = (config.graph_max_seqs, config.max_model_len)     # the draft's graphs' too
        if graphs:
            self.graphs = self.capture_graphs(DecodeGraphs(model, cache, config.graph_max_seqs, config.max_model_len,
                                                           1 + config.num_speculative_tokens, self.aux_layers))

    def attach_draft(self, drafter) -> None:
        """A draft model's drafter (``engine/spec/draft_model.py``): with decode / verify graphs, whose verify steps
        replay only where every request carries as many drafts, its controller plans one depth per step, and the
        draft's own steps replay graphs too where it can be captured (``model/draft_graphs.py``)."""
        drafter.controller.uniform = self.graphs is not None
        if self.graphs is not None and DraftGraphs.can_capture(drafter.draft):
            seqs, max_len = self.graph_limits
            drafter.executor.graphs = self.capture_draft_graphs(DraftGraphs(
                drafter.draft, drafter.cache, drafter.block_size, seqs, max_len, drafter.k, self.model.dtype))

    def capture_draft_graphs(self, graphs: DraftGraphs) -> DraftGraphs | None:
        """Capture the draft's graphs, or None (its steps eager) when it cannot be captured."""
        return capture_draft_or_none(graphs)

    def capture_graphs(self, graphs: DecodeGraphs) -> DecodeGraphs | None:
        """Capture the decode graphs, or None (eager) when the model cannot be captured."""
        return capture_or_none(graphs)

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch, rows: list[int]) -> torch.Tensor | None:
        """The eager step: one packed forward, then the logits of ``rows``."""
        if self.aux_layers:
            hidden, aux = self.model.forward_step(input_ids, batch, self.cache, self.aux_layers)
            self.last_states = torch.cat(aux, dim=-1)
        else:
            hidden = self.model.forward_step(input_ids, batch, self.cache)
        return self.model.compute_logits(hidden[on_device(rows, torch.int64, self.device)]) if rows else None

    def run_graph(self, meta: torch.Tensor, tables: torch.Tensor, rows: list[int], num_seqs: int,
                  input_ids: torch.Tensor | None = None, drafts=None) -> torch.Tensor | None:
        """The graph step: replay, then the logits of the chunks that sample (``drafts``: device drafts' rows and
        tokens, ``DeviceDrafts.gather``)."""
        logits = self.graphs.run(meta, tables, num_seqs, input_ids, drafts)
        self.last_states = self.graphs.states(num_seqs, meta.shape[1] // tables.shape[0])
        self.num_graph_steps += 1
        if len(rows) == logits.shape[0]:
            return logits
        return logits[on_device(rows, torch.int64, self.device)] if rows else None

    @torch.inference_mode()
    def sample(self, out, logits: torch.Tensor | None, greedy: list[int] | None = None) -> SamplerOutput | PendingOutput:
        """One token per sampling chunk, in chunk order (after its accepted drafts, if it has any):
        logit controls first (``logit_controls.py``), then the sampler or the draft verifier (``greedy``:
        the rows' argmax on the host, for a verify step of plain greedy chunks, ``spec/verify.py``)."""
        t0 = time.perf_counter()
        if out.pending_drafts is not None:      # the drafts this step verified, on the host now
            out.pending_drafts.resolve(out.chunks)
        chunks = out.chunks if out.plain_decode else [c for c in out.chunks if c.samples]
        raw = logits
        if logits is None:
            result = SamplerOutput([], [])
        else:
            reqs = list(map(attrgetter("req"), chunks))
            if any(map(attrgetter("has_controls"), reqs)):
                logits = controlled_logits(chunks, row_spans(chunks), logits)
            if not out.plain_decode and any(c.draft for c in chunks):
                result = verify(self.sampler, chunks, logits, raw, greedy)
            else:
                result = self.sampler.sample_rows(reqs, logits, raw)
        self.host_seconds += time.perf_counter() - t0
        return result

    def execute(self, out) -> SamplerOutput:
        """Run one step; returns one token per sampling chunk, in chunk order."""
        return self.sample(out, self.launch(out)).result()

    @torch.inference_mode()
    def launch(self, out, input_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Start one step on the device; returns the logits of its sampling rows. ``input_ids``: the
        device tensor of an async-scheduled step's input tokens (each chunk's ``input_pending`` token,
        the previous step's sample, in chunk order)."""
        t0, enc0 = time.perf_counter(), self.images.seconds
        offload = getattr(self.model, "expert_offload", None)
        if offload is not None:         # cache the hot experts of the routing so far (between steps)
            offload.refresh()
        self.cache.apply_state_ops(out.state_copies, out.state_resets)
        size = self.batches.graph_size(out, self.graphs)
        if size is None:
            step = self.batches.build(out)
            t1 = time.perf_counter()
            ids = step.input_ids
            if input_ids is not None:       # the pending chunks' first rows (a drafting chunk has more rows)
                ids = ids.index_copy(0, on_device(step.pending_rows, torch.int64, self.device), input_ids)
            drafts = out.pending_drafts and out.pending_drafts.gather(out.chunks, _first_draft_rows(out.chunks))
            if drafts:                      # drafts still on the device (``spec/device_drafts.py``)
                ids = ids.index_copy(0, *drafts)
            logits = self.run(ids, step.batch, step.rows)
            if step.prompt_rows:      # the prompt-scoring rows come last
                n = len(step.prompt_rows)
                record_prompt_logprobs(step.prompt_rows, logits[-n:])
                logits = logits[:-n] if logits.shape[0] > n else None
        else:
            meta, tables, rows = self.batches.build_decode(out, size)
            t1 = time.perf_counter()
            L = meta.shape[1] // size
            drafts = out.pending_drafts and out.pending_drafts.gather(out.chunks, [s * L + 1 for s in range(size)])
            logits = self.run_graph(meta, tables, rows, len(out.chunks), input_ids, drafts)
        out.draft_states, self.last_states = self.last_states, None   # a graph's: valid until the next replay
        self.images.release(out.chunks)
        encode = self.images.seconds - enc0         # images encoded while building the batch count as model time
        prepare, launch = t1 - t0 - encode, time.perf_counter() - t1 + encode
        self.prepare_seconds += prepare
        self.host_seconds += prepare
        self.model_seconds += launch
        self.num_steps += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("step %d: %d seqs, %d tokens, %s, prepare %.2f ms, launch %.2f ms", self.num_steps,
                         len(out.chunks), out.num_tokens, "eager" if size is None else f"graph {size}",
                         prepare * 1e3, launch * 1e3)
        return logits


def _first_draft_rows(chunks) -> list[int]:
    """The packed input row of each chunk's first draft (after its input rows)."""
    rows, offset = [], 0
    for c in chunks:
        rows.append(offset + c.num_tokens - len(c.draft))
        offset += c.num_tokens
    return rows
