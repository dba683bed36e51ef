"""CUDA graphs of the MoonViT tower: one graph per patch budget of a ladder, each running one item.

An item of L = t*h*w patches runs in the graph of the smallest budget B >= L: its pixels, position
embeddings and RoPE tables (``MoonViT.prepare``, eager: they depend on the grid) are copied into
static buffers of B rows, and the item bounds are [0, L, B], so the B - L padding rows form a second
item that attends only to itself and never reaches the real rows (their values are whatever an
earlier item left: finite, unused). Items larger than the ladder run eagerly. The merge and the
projector after the tower run eagerly on the real rows (a few launches).

Eagerly, the tower is some 40 launches a layer (27 layers in K3): for an image of a few hundred to a
few thousand patches those launches, not the matmuls, set its time. The graphs share one memory
pool, captured largest budget first; it lives outside the cache budget (the part of the GPU that
``gpu_memory_utilization`` leaves for activations and graphs).

Without capture (the CPU), ``encode`` runs the same padded steps eagerly: that is what the CPU tests
check against the unpadded tower.
"""

from __future__ import annotations

import bisect
import logging

import torch

from kimik3.model.cuda_graphs import capture_graph, captured_or_none, garbage_collection_paused
from kimik3.model.vision import MoonViT, TowerInputs
from kimik3.ops.attention import kernel_takes

logger = logging.getLogger(__name__)

# Patch budgets: steps of about 1.4x (padding wastes at most 50%, about 20% on average), from a
# 16x16-patch image (224 px) to the per-frame limit of the K3 preprocessor (in_patch_limit_each_frame).
ENCODER_GRAPH_BUDGETS = (256, 384, 576, 784, 1024, 1536, 2304, 3136, 4096, 6144, 9216, 12544, 16384)


class EncoderGraphs:
    """The tower's per-patch part (``MoonViT.encode``) over static buffers of the largest budget."""

    def __init__(self, tower: MoonViT, budgets: tuple[int, ...] = ENCODER_GRAPH_BUDGETS):
        if not budgets or any(b < 1 for b in budgets) or list(budgets) != sorted(set(budgets)):
            raise ValueError(f"encoder graph budgets must be increasing positive patch counts, got {budgets}")
        self.tower, self.budgets = tower, tuple(budgets)
        weight = tower.patch_embed.proj.weight
        B, p = self.budgets[-1], tower.patch_size
        probe = tower.prepare([(1, tower.merge_kernel_size[0], tower.merge_kernel_size[1])])
        self.pixels = torch.zeros(B, 3, p, p, dtype=weight.dtype, device=weight.device)
        self.pos = torch.zeros(B, probe.pos.shape[1], dtype=probe.pos.dtype, device=weight.device)
        self.cos = torch.ones(B, probe.cos.shape[1], dtype=probe.cos.dtype, device=weight.device)
        self.sin = torch.zeros(B, probe.sin.shape[1], dtype=probe.sin.dtype, device=weight.device)
        self.cu_seqlens = torch.zeros(3, dtype=torch.int32, device=weight.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0

    @staticmethod
    def can_capture(tower: MoonViT) -> bool:
        """Whether the tower's attention takes the varlen flash kernel (CUDA, half types, head dims
        such as K3's 128); a tower whose attention runs the reference loop is encoded eagerly."""
        ok = kernel_takes(tower.dtype, tower.encoder.head_dim, tower.patch_embed.proj.weight.device)
        if not ok:
            logger.info("vision tower encoded eagerly: its attention (%s, head dim %d) does not take the varlen "
                        "kernel that CUDA graphs capture", str(tower.dtype).removeprefix("torch."),
                        tower.encoder.head_dim)
        return ok

    def budget_for(self, num_patches: int) -> int | None:
        """The smallest budget holding ``num_patches``; None above the ladder (the item runs eagerly)."""
        i = bisect.bisect_left(self.budgets, num_patches)
        return self.budgets[i] if i < len(self.budgets) else None

    def step(self, B: int) -> torch.Tensor:
        """The tower over the first B rows of the static buffers: [B, D]."""
        items = TowerInputs(self.pos[:B], self.cos[:B], self.sin[:B], self.cu_seqlens, max_len=B)
        return self.tower.run(self.pixels[:B], items)

    @torch.inference_mode()
    @garbage_collection_paused()
    def capture(self) -> None:
        """Capture every budget, largest first, in one memory pool (warm-up runs first compile the kernels;
        no garbage collection meanwhile: ``garbage_collection_paused``)."""
        pool = None
        for B in sorted(self.budgets, reverse=True):
            self.cu_seqlens[1:] = B                      # one item of B rows while capturing
            graph, out = capture_graph(lambda: self.step(B), pool)
            pool = graph.pool()
            self.graphs[B] = (graph, out)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs of the vision tower for patch budgets %s", list(self.budgets))

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, shapes: list[tuple[int, int, int]]) -> torch.Tensor:
        """``MoonViT.encode``: per-patch states [P, D] of the items, each through its budget's graph."""
        out, start = [], 0
        for shape in shapes:
            L = shape[0] * shape[1] * shape[2]
            pixels = pixel_values[start:start + L]
            start += L
            B = self.budget_for(L)
            if B is None:
                out.append(self.tower.encode(pixels, [shape]))
                continue
            items = self.tower.prepare([shape])
            self.pixels[:L].copy_(pixels)
            self.pos[:L].copy_(items.pos)
            self.cos[:L].copy_(items.cos)
            self.sin[:L].copy_(items.sin)
            self.cu_seqlens.copy_(torch.tensor([0, L, B], dtype=torch.int32))
            if B in self.graphs:
                graph, states = self.graphs[B]
                graph.replay()
                self.num_replays += 1
            else:
                states = self.step(B)
            out.append(states[:L].clone())
        return torch.cat(out)


def capture_encoder_or_none(graphs: EncoderGraphs) -> EncoderGraphs | None:
    """Capture the tower's graphs; a tower that cannot be captured runs eagerly (one warning)."""
    return captured_or_none(graphs, "the vision tower", "images are encoded eagerly")
