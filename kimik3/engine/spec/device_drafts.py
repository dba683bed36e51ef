"""Drafts still on the device when their verify step is scheduled and launched.

A draft model's graphs (``model/draft_graphs.py``) leave each step's drafts in a device buffer; ``ModelDrafter``
hands the scheduler placeholders of the right count instead of waiting for them (``propose``), so the next
step is scheduled, built and launched while the device drafts. The runner writes the device's tokens into the
step's draft rows (``gather``: input rows and values, one index copy), and before verifying, the sampler's
host work sees the real drafts (``resolve``: the chunks' ``draft`` lists replaced, waiting for the copy to the
host if it has not landed). Greedy tokens are the same as with the drafts on the host: the rows compute the
same inputs.
"""

from __future__ import annotations

import torch

from kimik3.engine.transfer import on_device


class DeviceDrafts:
    """``tokens`` [k, N] on the device (draft j of head i at [j, i]); ``heads``: each placeholder request's head
    index (by ``id``); ``take``: waits for the drafts and returns each head request's, by ``id``."""

    def __init__(self, tokens: torch.Tensor, heads: dict[int, int], take):
        self.tokens, self.heads, self._take = tokens, heads, take

    def gather(self, chunks, first_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(input rows, their tokens), device tensors, for the placeholder drafts of ``chunks`` (``first_rows[s]``:
        the input row of chunk s's first draft); None when none has any."""
        rows, flat, n = [], [], self.tokens.shape[1]
        for c, r in zip(chunks, first_rows):
            i = self.heads.get(id(c.req))
            if i is not None and c.draft:
                rows.extend(range(r, r + len(c.draft)))
                flat.extend(j * n + i for j in range(len(c.draft)))
        if not rows:
            return None
        device = self.tokens.device
        return on_device(rows, torch.int64, device), self.tokens.view(-1)[on_device(flat, torch.int64, device)]

    def resolve(self, chunks) -> None:
        """Replace the placeholders of ``chunks`` by the drafts themselves (host lists)."""
        real = self._take()
        for c in chunks:
            if c.draft and id(c.req) in self.heads:
                c.draft = list(real[id(c.req)][:len(c.draft)])
