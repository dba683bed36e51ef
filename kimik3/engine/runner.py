"""Runner: turn one scheduled step into one packed varlen forward, then sample.

prepare (host lists -> ForwardBatch), run (state restores + one model call), sample (logit rows of
the sequences that reached their last token). Batch building stays apart from the model call so
a CUDA-graph decode path can later replay into static buffers.

Images: a chunk whose positions hold media pads gets those pads' embedding rows in the batch
(``embed_rows`` in packed coordinates, ``embeds``). Each image is encoded at the first chunk that
needs it (all images new to a step in one tower call), unless the encoder cache has its content
hash; the request holds the embeddings until its last pad is computed.
"""

from __future__ import annotations

import logging
import time

import torch

from kimik3.engine.encoder_cache import EncoderCache
from kimik3.engine.request import Request
from kimik3.engine.sampler import SamplerOutput, SamplingBatch, sample
from kimik3.engine.scheduler import ScheduledChunk, SchedulerOutput
from kimik3.model.batch import ForwardBatch, HybridCache

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model, cache: HybridCache, seed: int = 0, encoder_cache_tokens: int = 16384):
        self.model = model
        self.cache = cache
        self.encoder_cache = EncoderCache(encoder_cache_tokens)
        self.num_encoded_images = 0     # images run through the vision tower (cache misses)
        self.encoder_seconds = 0.0      # inside prepare, but counted as model time
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
        if any(c.req.mm is not None for c in out.chunks):
            batch.embed_rows, batch.embeds = self._image_rows(out.chunks)
        return torch.tensor(ids, dtype=torch.int64, device=self.device), batch, rows

    def _image_rows(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Packed rows [M] of the media pads in this step and their embeddings [M, D] (None, None if none)."""
        self._fetch_images([(c.req, i) for c in chunks if c.req.mm is not None
                            for i in c.req.mm.items_in(c.start, c.start + c.num_tokens)
                            if i not in c.req.image_embeds])
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        offset = 0
        for c in chunks:
            mm = c.req.mm
            if mm is not None:
                lo, hi = mm.rows_in(c.start, c.start + c.num_tokens)
                for i in mm.items_in(c.start, c.start + c.num_tokens):
                    a, b = max(lo, mm.row_offsets[i]), min(hi, mm.row_offsets[i + 1])
                    parts.append(c.req.image_embeds[i][a - mm.row_offsets[i]:b - mm.row_offsets[i]])
                rows.extend(offset + p - c.start for p in mm.pad_positions[lo:hi])
            offset += c.num_tokens
        if not rows:
            return None, None
        return torch.tensor(rows, dtype=torch.int64, device=self.device), torch.cat(parts)

    def _fetch_images(self, wanted: list[tuple[Request, int]]) -> None:
        """Give each (request, item) its embeddings: from the encoder cache, else one tower call for all."""
        missing: dict[bytes, tuple[Request, int]] = {}
        for req, i in wanted:
            h = req.mm.hashes[i]
            embeds = self.encoder_cache.get(h) if h not in missing else None
            if embeds is not None:
                req.image_embeds[i] = embeds
            else:
                missing.setdefault(h, (req, i))
        if not missing:
            return
        t0 = time.perf_counter()
        items = list(missing.values())
        pixels = torch.cat([req.mm.pixels(i) for req, i in items])
        grids = torch.stack([req.mm.grid_thws[i] for req, i in items])
        encoded = self.model.encode_images(pixels.to(self.device), grids)
        sizes = [req.mm.row_offsets[i + 1] - req.mm.row_offsets[i] for req, i in items]
        by_hash = dict(zip(missing, encoded.split(sizes)))
        for h, embeds in by_hash.items():
            self.encoder_cache.put(h, embeds)
        for req, i in wanted:
            req.image_embeds.setdefault(i, by_hash.get(req.mm.hashes[i]))
        self.num_encoded_images += len(items)
        self.encoder_seconds += time.perf_counter() - t0

    @staticmethod
    def _release_images(chunks: list[ScheduledChunk]) -> None:
        """Drop the embeddings of items whose last pad this step computed (the cache may keep them)."""
        for c in chunks:
            if c.req.image_embeds:
                end = c.start + c.num_tokens
                for i in [i for i in c.req.image_embeds if c.req.mm.last_position(i) < end]:
                    del c.req.image_embeds[i]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> SamplerOutput:
        """Run one step; returns one token per sampling chunk, in chunk order."""
        t0 = time.perf_counter()
        enc0 = self.encoder_seconds
        input_ids, batch, rows = self.prepare(out)
        for src, dst in out.state_copies:
            self.cache.copy_state(src, dst)
        for slot in out.state_resets:
            self.cache.reset_state(slot)
        t1 = time.perf_counter()
        hidden = self.model.forward_step(input_ids, batch, self.cache)
        self._release_images(out.chunks)
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
        encode = self.encoder_seconds - enc0
        host = (t1 - t0) + (t3 - t2) - encode
        self.host_seconds += host
        self.model_seconds += t2 - t1 + encode
        self.num_steps += 1
        logger.debug("step %d: %d seqs, %d tokens, host %.2f ms, model %.2f ms", self.num_steps,
                     len(out.chunks), batch.num_tokens, host * 1e3, (t2 - t1) * 1e3)
        return result
