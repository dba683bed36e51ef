"""Encoder data parallelism under tensor parallelism: the vision tower is replicated on every TP rank, so the
images new to a step are split over the ranks (each rank encodes its share) and the embeddings gathered with
one all-gather over the model's group (NCCL on GPUs: device to device).

Rank 0 (``ParallelRunner``) broadcasts the step's items (``EncodeImages``: pixels per item and their grids) on
the control group; every rank, rank 0 included, then calls ``encode_share``. The split is a deterministic
function of the grids (largest item first onto the least-loaded rank), so no rank waits for another's choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kimik3.model.vision import tokens_per_item


@dataclass
class EncodeImages:
    pixels: list[torch.Tensor]        # per item [P_i, 3, p, p], host
    grid_thws: torch.Tensor           # [n, 3] int64


def assign_items(sizes: list[int], ranks: int) -> list[int]:
    """Rank of each item: items by decreasing size (ties: lower index first) onto the least-loaded rank
    (ties: lower rank)."""
    load = [0] * ranks
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


@torch.inference_mode()
def encode_share(model, pixels: list[torch.Tensor], grid_thws: torch.Tensor, encode=None) -> torch.Tensor:
    """This rank's share of the items through the vision tower, then one all-gather: every rank returns the
    embeddings of all items, in item order [sum_i N_i, D] (model dtype). ``encode``: the tower's per-patch part
    (rank 0's encoder graphs), None for eager."""
    par = model.parallel
    vision = model.vision
    rows = tokens_per_item(grid_thws, vision.vision_tower.merge_kernel_size)
    owner = assign_items([p.shape[0] for p in pixels], par.tp_size)
    mine = [i for i, r in enumerate(owner) if r == par.tp_rank]
    D, device = model.config.text.hidden_size, torch.device(model.device)
    if mine:
        out = model.encode_images(torch.cat([pixels[i] for i in mine]).to(device), grid_thws[mine], encode)
        out = out.to(model.dtype)
    else:
        out = torch.empty(0, D, dtype=model.dtype, device=device)
    per_rank = [sum(rows[i] for i, r in enumerate(owner) if r == q) for q in range(par.tp_size)]
    width = max(per_rank)
    padded = torch.cat([out, out.new_zeros(width - out.shape[0], D)]) if out.shape[0] < width else out
    gathered = par.all_gather_rows(padded).view(par.tp_size, width, D)
    pieces, taken = [], [0] * par.tp_size
    for i, r in enumerate(owner):
        pieces.append(gathered[r, taken[r]:taken[r] + rows[i]])
        taken[r] += rows[i]
    return torch.cat(pieces)
