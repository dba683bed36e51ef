"""Runner: turn one scheduled step into one packed varlen forward, then sample.

prepare (host lists -> ForwardBatch), run (state restores + one model call), sample (logit rows of
the sequences that reached their last token). On CUDA, pure decode steps of up to max_num_seqs
sequences take a small branch instead: ``prepare_decode`` packs padded host inputs and a captured
graph replays the step (``cuda_graphs.DecodeGraphs``); everything else runs eagerly.

Images: a chunk whose positions hold media pads gets those pads' embedding rows in the batch
(``embed_rows`` in packed coordinates, ``embeds``). Each image is encoded at the first chunk that
needs it (all images new to a step in one tower call), unless the encoder cache has its content
hash; the request holds the embeddings until its last pad is computed.
"""

from __future__ import annotations

import logging
import time

import torch

from kimik3.engine.cuda_graphs import DecodeGraphs, pack_decode_inputs
from kimik3.engine.encoder_cache import EncoderCache
from kimik3.engine.request import Request
from kimik3.engine.sampler import (
    ControlRow,
    SamplerOutput,
    SamplingBatch,
    apply_controls,
    draw,
    filter_logits,
    logprob_dicts,
    sample,
)
from kimik3.engine.speculative import accept_greedy, is_plain_greedy
from kimik3.engine.structured import fill_bitmasks
from kimik3.engine.scheduler import ScheduledChunk, SchedulerOutput
from kimik3.model.batch import ForwardBatch, HybridCache

logger = logging.getLogger(__name__)


def capture_or_none(graphs: DecodeGraphs) -> DecodeGraphs | None:
    """Capture the decode graphs; a model that cannot be captured runs eagerly (one warning)."""
    try:
        graphs.capture()
        return graphs
    except Exception as exc:        # capture errors come as RuntimeError or torch.AcceleratorError
        logger.warning("CUDA graph capture failed (%s: %s); decode steps run eagerly. Pass enforce_eager "
                       "to skip the attempt", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        graphs.graphs.clear()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return None


class ModelRunner:
    def __init__(self, model, cache: HybridCache, seed: int = 0, encoder_cache_tokens: int = 16384,
                 max_num_seqs: int = 64, max_model_len: int = 8192, enforce_eager: bool = True):
        self.model = model
        self.cache = cache
        self.encoder_cache = EncoderCache(encoder_cache_tokens)
        self.num_encoded_images = 0     # images run through the vision tower (cache misses)
        self.encoder_seconds = 0.0      # inside prepare, but counted as model time
        self.device = torch.device(model.device)
        self.vocab_size = model.config.text.vocab_size
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.host_seconds = 0.0     # prepare + sample (sampling waits for the device's step)
        self.prepare_seconds = 0.0  # host batch building alone
        self.model_seconds = 0.0
        self.num_steps = 0
        self.num_graph_steps = 0
        self.graphs: DecodeGraphs | None = None
        self._prompt_rows: list[tuple[Request, int, int]] = []   # (request, position, packed row) this step
        if not enforce_eager and self.device.type == "cuda":
            self.graphs = capture_or_none(DecodeGraphs(model, cache, max_num_seqs, max_model_len))

    @staticmethod
    def prompt_logprob_positions(c: ScheduledChunk) -> range:
        """Positions of this chunk whose logits score the next prompt token (prompt_logprobs not yet
        recorded there; a recompute after preemption records nothing twice)."""
        req = c.req
        if req.params.prompt_logprobs is None:
            return range(0)
        lo = max(c.start, len(req.prompt_logprobs) - 1)
        return range(lo, min(c.start + c.num_tokens, req.num_prompt_tokens - 1))

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, ForwardBatch, list[int]]:
        """Packed input ids [T], the batch metadata, and the packed rows that need logits (the
        sampling rows first, then the rows that score prompt tokens)."""
        ids: list[int] = []
        rows: list[int] = []
        self._prompt_rows = []
        for c in out.chunks:
            for p in self.prompt_logprob_positions(c):
                self._prompt_rows.append((c.req, p, len(ids) + p - c.start))
            ids.extend(c.req.token_ids[c.start:c.start + c.num_tokens - len(c.draft)])
            ids.extend(c.draft)
            if c.samples:          # a speculative chunk needs every row: row j verifies draft j + 1
                rows.extend(range(len(ids) - 1 - len(c.draft), len(ids)))
        batch = ForwardBatch.build(
            query_lens=[c.num_tokens for c in out.chunks],
            context_lens=[c.start for c in out.chunks],
            state_slots=[c.req.state_slot for c in out.chunks],
            block_tables=[c.req.block_ids for c in out.chunks],
            block_size=self.cache.block_size, device=self.device,
            checkpoints=tuple(out.checkpoints))
        if any(c.req.mm is not None for c in out.chunks):
            batch.embed_rows, batch.embeds = self._image_rows(out.chunks)
        rows.extend(r for _, _, r in self._prompt_rows)
        return torch.tensor(ids, dtype=torch.int64, device=self.device), batch, rows

    def _record_prompt_logprobs(self, logits: torch.Tensor | None) -> torch.Tensor | None:
        """Take the prompt-scoring rows off the end of ``logits`` and store their logprob dicts."""
        n = len(self._prompt_rows)
        if not n:
            return logits
        scored, logits = logits[-n:], logits[:-n]
        reqs = [q for q, _, _ in self._prompt_rows]
        targets = torch.tensor([q.token_ids[p + 1] for q, p, _ in self._prompt_rows], device=scored.device)
        for q, d in zip(reqs, logprob_dicts(scored, targets, [q.params.prompt_logprobs for q in reqs])):
            if not q.prompt_logprobs:
                q.prompt_logprobs.append(None)      # the first prompt token has no logprob
            q.prompt_logprobs.append(d)
        self._prompt_rows = []
        return logits if logits.shape[0] else None

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

    def graph_size(self, out: SchedulerOutput) -> int | None:
        """Padded size of the decode graph that runs this step, or None (eager): one token per
        sequence, each with history, no KDA checkpoint, no media pad, at most the largest graph."""
        if self.graphs is None or out.checkpoints:
            return None
        for c in out.chunks:
            if self.prompt_logprob_positions(c):
                return None
            if c.num_tokens != 1 or c.start == 0 or (c.req.mm is not None and c.req.mm.items_in(c.start, c.start + 1)):
                return None
        return self.graphs.size_for(len(out.chunks))

    def prepare_decode(self, out: SchedulerOutput, size: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Host inputs of a graph step padded to ``size`` rows, and the chunk indices that sample."""
        chunks = out.chunks
        meta, tables = pack_decode_inputs([c.req.token_ids[c.start] for c in chunks], [c.start for c in chunks],
                                          [c.req.state_slot for c in chunks], [c.req.block_ids for c in chunks],
                                          self.cache.block_size, size)
        return meta, tables, [i for i, c in enumerate(chunks) if c.samples]

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch, rows: list[int]) -> torch.Tensor | None:
        """The eager step: one packed forward, then the logits of the packed rows that sample."""
        hidden = self.model.forward_step(input_ids, batch, self.cache)
        return self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]) if rows else None

    def run_graph(self, meta: torch.Tensor, tables: torch.Tensor, rows: list[int], num_seqs: int) -> torch.Tensor | None:
        """The graph step: replay, then the logits of the chunks that sample."""
        logits = self.graphs.run(meta, tables, num_seqs)
        self.num_graph_steps += 1
        if len(rows) == num_seqs:
            return logits
        return logits[torch.tensor(rows, device=self.device)] if rows else None

    def sample(self, out: SchedulerOutput, logits: torch.Tensor | None) -> SamplerOutput:
        """One token per sampling chunk from its logits row (argmax when every row is plain greedy).
        A speculative chunk brings one row per draft plus one (row j verifies draft j + 1); its
        accepted drafts come before its token (``speculative.py``)."""
        if logits is None:
            return SamplerOutput([], [])
        chunks = [c for c in out.chunks if c.samples]
        reqs = [c.req for c in chunks]
        spans, r = [], 0
        for c in chunks:
            spans.append((r, r + 1 + len(c.draft)))
            r += 1 + len(c.draft)
        raw = logits
        if any(q.params.has_controls for q in reqs):
            logits = self._controlled(chunks, spans, logits)
        if not any(c.draft for c in chunks):
            return self._sample_last_rows(reqs, logits, raw)
        if all(is_plain_greedy(q.params) for q in reqs):
            targets = logits.argmax(-1).tolist()                   # one device sync for every row
            result = SamplerOutput([targets[b - 1] for a, b in spans], [None] * len(reqs))
        else:
            last = torch.tensor([b - 1 for _, b in spans], device=logits.device)
            result = self._sample_last_rows(reqs, logits[last], raw[last])
            targets = [0] * r                                      # greedy rows of speculative chunks only
            greedy_rows = [j for c, (a, b) in zip(chunks, spans) if c.draft and c.req.params.greedy
                           for j in range(a, b)]
            if greedy_rows:
                for j, t in zip(greedy_rows, logits[torch.tensor(greedy_rows, device=logits.device)].argmax(-1).tolist()):
                    targets[j] = t
        result.accepted = [[] for _ in chunks]
        sampled = []
        for i, (c, (a, _)) in enumerate(zip(chunks, spans)):
            if not c.draft:
                continue
            if c.req.params.greedy:
                m = accept_greedy(c.draft, targets[a:a + len(c.draft) + 1])
                result.accepted[i] = c.draft[:m]
                result.token_ids[i] = targets[a + m]
            else:
                sampled.append(i)
        if sampled:
            self._verify_sampled([chunks[i] for i in sampled], [spans[i] for i in sampled], logits, result, sampled)
        self._speculative_logprobs(chunks, spans, raw, result)
        return result

    def _controlled(self, chunks, spans, logits: torch.Tensor) -> torch.Tensor:
        """Logits with each controlled request's logit controls and grammar mask applied; row a + j of
        a speculative chunk sees the request's output followed by its drafts 1..j."""
        rows: list[int] = []
        controls: list[ControlRow] = []
        for c, (a, b) in zip(chunks, spans):
            q = c.req
            if not q.params.has_controls:
                continue
            out_ids = q.output_token_ids
            ends = [t for t in (q.eos_token_id, *q.params.stop_token_ids) if t is not None and not
                    (t == q.eos_token_id and q.params.ignore_eos)]
            for j in range(b - a):
                rows.append(a + j)
                controls.append(ControlRow(q.params, out_ids + c.draft[:j], ends, q.bad_word_ids, q.matcher,
                                           c.draft[:j]))
        bitmask = None
        if any(row.matcher is not None for row in controls):
            bitmask = fill_bitmasks([(row.matcher, row.pending) for row in controls])
        return apply_controls(logits, rows, controls, bitmask)

    @staticmethod
    def _speculative_logprobs(chunks, spans, logits: torch.Tensor, result: SamplerOutput) -> None:
        """Logprobs of the emitted tokens of speculative chunks that ask for them: row j for the
        accepted draft j + 1, row m for the final token."""
        rows, tokens, tops, where = [], [], [], []
        result.accepted_logprobs = [[None] * len(acc) for acc in result.accepted]
        for i, (c, (a, _)) in enumerate(zip(chunks, spans)):
            if c.draft and c.req.params.logprobs is not None:
                emitted = [*result.accepted[i], result.token_ids[i]]
                rows.extend(range(a, a + len(emitted)))
                tokens.extend(emitted)
                tops.extend([c.req.params.logprobs] * len(emitted))
                where.extend((i, j) for j in range(len(emitted)))
        if not rows:
            return
        dicts = logprob_dicts(logits[torch.tensor(rows, device=logits.device)],
                              torch.tensor(tokens, device=logits.device), tops)
        for (i, j), d in zip(where, dicts):
            if j < len(result.accepted[i]):
                result.accepted_logprobs[i][j] = d
            else:
                result.logprobs[i] = d

    def _verify_sampled(self, chunks, spans, logits: torch.Tensor, result: SamplerOutput, index: list[int]) -> None:
        """Speculative sampling of sampled requests: accept draft j + 1 with probability p_j(d),
        else draw from p_j without d; all accepted: keep the token drawn from the last row."""
        rows = [j for a, b in spans for j in range(a, b)]
        params = [c.req.params for c, (a, b) in zip(chunks, spans) for _ in range(a, b)]
        sb = SamplingBatch.build(params, [None] * len(rows), [[]] * len(rows), [[]] * len(rows),
                                 self.vocab_size, self.device)
        probs = filter_logits(logits[torch.tensor(rows, device=logits.device)], sb).softmax(-1)
        starts, local = [], 0                          # each chunk's first row in ``probs``
        for a, b in spans:
            starts.append(local)
            local += b - a
        draft_rows = [s + j for c, s in zip(chunks, starts) for j in range(len(c.draft))]
        p_draft = probs[torch.tensor(draft_rows, device=probs.device),
                        torch.tensor([t for c in chunks for t in c.draft], device=probs.device)].tolist()
        k = 0
        for i, c, start in zip(index, chunks, starts):
            n = len(c.draft)
            u = torch.rand(n, generator=c.req.generator or self.generator, device=self.generator.device).tolist()
            m = 0
            while m < n and u[m] < p_draft[k + m]:
                m += 1
            result.accepted[i] = c.draft[:m]
            if m < n:                                  # rejected: draw from p_m without the draft token
                residual = probs[start + m].clone()
                residual[c.draft[m]] = 0.0
                result.token_ids[i] = int(draw(residual[None], [c.req.generator], self.generator)[0])
            k += n

    def _sample_last_rows(self, reqs, logits: torch.Tensor, raw: torch.Tensor) -> SamplerOutput:
        if all(is_plain_greedy(r.params) for r in reqs):        # plain greedy: argmax, one sync
            return SamplerOutput(logits.argmax(-1).tolist(), [None] * len(reqs))
        sb = SamplingBatch.build([r.params for r in reqs], [r.generator for r in reqs],
                                 [r.prompt_token_ids for r in reqs], [r.output_token_ids for r in reqs],
                                 self.vocab_size, self.device)
        return sample(logits, sb, self.generator, raw)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> SamplerOutput:
        """Run one step; returns one token per sampling chunk, in chunk order.

        Timing: ``host_seconds`` is batch building plus sampling (which waits for the device),
        ``model_seconds`` the launch of the step and any image encoding."""
        t0 = time.perf_counter()
        enc0 = self.encoder_seconds
        for src, dst in out.state_copies:
            self.cache.copy_state(src, dst)
        for slot in out.state_resets:
            self.cache.reset_state(slot)
        size = self.graph_size(out)
        if size is None:
            input_ids, batch, rows = self.prepare(out)
            t1 = time.perf_counter()
            logits = self._record_prompt_logprobs(self.run(input_ids, batch, rows))
        else:
            meta, tables, rows = self.prepare_decode(out, size)
            t1 = time.perf_counter()
            logits = self.run_graph(meta, tables, rows, len(out.chunks))
        self._release_images(out.chunks)
        t2 = time.perf_counter()
        result = self.sample(out, logits)
        t3 = time.perf_counter()
        encode = self.encoder_seconds - enc0
        self.prepare_seconds += t1 - t0 - encode
        self.host_seconds += t1 - t0 - encode + t3 - t2
        self.model_seconds += t2 - t1 + encode
        self.num_steps += 1
        logger.debug("step %d: %d seqs, %d tokens, %s, prepare %.2f ms, launch %.2f ms, sample %.2f ms",
                     self.num_steps, len(out.chunks), out.num_tokens, "eager" if size is None else f"graph {size}",
                     (t1 - t0 - encode) * 1e3, (t2 - t1 + encode) * 1e3, (t3 - t2) * 1e3)
        return result
