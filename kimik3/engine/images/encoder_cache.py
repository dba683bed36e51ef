"""Image embeddings of a step: each image is encoded at the first chunk that needs it (every image
new to a step in one vision-tower call) unless the encoder cache has its content hash, and the
request holds the embeddings until its last pad is computed.

The encoder cache is a bounded LRU by content hash, so a repeated image or a recomputed request
(after preemption) is not encoded again. The bound counts embedding rows (image tokens), like the
token budget of the text cache; an item larger than the whole bound is used by its request but not kept.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()   # hash -> [N, D], LRU first
        self.num_tokens = 0
        self.num_hits = 0
        self.num_misses = 0

    def get(self, h: bytes) -> torch.Tensor | None:
        embeds = self.entries.get(h)
        if embeds is None:
            self.num_misses += 1
            return None
        self.entries.move_to_end(h)
        self.num_hits += 1
        return embeds

    def put(self, h: bytes, embeds: torch.Tensor) -> None:
        n = embeds.shape[0]
        if n > self.max_tokens or h in self.entries:
            return
        while self.num_tokens + n > self.max_tokens:
            _, old = self.entries.popitem(last=False)
            self.num_tokens -= old.shape[0]
        self.entries[h] = embeds
        self.num_tokens += n

    def clear(self) -> None:
        self.entries.clear()
        self.num_tokens = 0


class ImageEncoder:
    """The step's media-pad rows and their embeddings, from the encoder cache or the vision tower."""

    def __init__(self, model, max_tokens: int, encode=None):
        self.model = model
        self.encode = encode            # the tower's per-patch part (``EncoderGraphs.encode``), None: eager
        self.device = torch.device(model.device)
        self.cache = EncoderCache(max_tokens)
        # items' pixels (host, one tensor each) and grids -> their embeddings, in order; the parallel runner
        # replaces it with the ranks' shared encode (``kimik3.parallel.encoder_dp``)
        self.encode_items = self._encode_here
        self.num_encoded_images = 0     # images run through the vision tower (cache misses)
        self.seconds = 0.0              # time in the vision tower

    def rows(self, chunks) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Packed rows [M] of the media pads in this step's chunks and their embeddings [M, D] (None, None if none)."""
        self._fetch([(c.req, i) for c in chunks if c.req.mm is not None
                     for i in c.req.mm.items_in(c.start, c.start + c.num_tokens) if i not in c.req.image_embeds])
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

    def _fetch(self, wanted: list) -> None:
        """Give each (request, item) its embeddings: from the encoder cache, else one tower call for all."""
        missing: dict[bytes, tuple] = {}
        for req, i in wanted:
            h = req.mm.hashes[i]
            embeds = self.cache.get(h) if h not in missing else None
            if embeds is not None:
                req.image_embeds[i] = embeds
            else:
                missing.setdefault(h, (req, i))
        if not missing:
            return
        t0 = time.perf_counter()
        items = list(missing.values())
        grids = torch.stack([req.mm.grid_thws[i] for req, i in items])
        encoded = self.encode_items([req.mm.pixels(i) for req, i in items], grids)
        sizes = [req.mm.row_offsets[i + 1] - req.mm.row_offsets[i] for req, i in items]
        by_hash = dict(zip(missing, encoded.split(sizes)))
        for h, embeds in by_hash.items():
            self.cache.put(h, embeds)
        for req, i in wanted:
            req.image_embeds.setdefault(i, by_hash.get(req.mm.hashes[i]))
        self.num_encoded_images += len(items)
        self.seconds += time.perf_counter() - t0

    def _encode_here(self, pixels: list[torch.Tensor], grids: torch.Tensor) -> torch.Tensor:
        return self.model.encode_images(torch.cat(pixels).to(self.device), grids, self.encode)

    @staticmethod
    def release(chunks) -> None:
        """Drop the embeddings of items whose last pad this step computed (the cache may keep them)."""
        for c in chunks:
            if c.req.image_embeds:
                end = c.start + c.num_tokens
                for i in [i for i in c.req.image_embeds if c.req.mm.last_position(i) < end]:
                    del c.req.image_embeds[i]
