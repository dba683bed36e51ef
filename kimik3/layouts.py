"""Multi-GPU layouts ``kimik3 inspect --layouts`` proposes (spec parallelism §6): for a machine of N GPUs,
every TP x PP = N split (TP within a node unless a stage spans nodes), with whole experts over each stage's
TP ranks (EP = TP; split by their intermediate where they do not divide), and decode context parallelism
over the TP ranks (DCP 1 or TP; the engine then needs --block-size a multiple of DCP); per GPU: the weights, the cache budget, the latent and KDA state of one 1M-token sequence,
and how many 1M-token sequences fit. Ranked: fits, then most 1M sequences, then fewer stages.

Bytes per GPU of a layout, as kimik3 places them: the decoder layers' weights / PP (stages hold their
layers; the planner balances their bytes), the embedding and LM head and the replicated parts (router,
latent projections, norms, vision tower) on every stage (kimik3 keeps them on each stage today); routed
experts / EP (or / TP, split by intermediate); the MLA latent / PP / DCP; the KDA state / TP / PP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kimik3.config import ModelConfig
from kimik3.sizing import GIB, GPUS, MEMORY_FRACTION, OVERHEAD_BYTES, GPU, compute_sizing

# B300-class: 288 GB HBM3e, ~8 TB/s (vendor figures; no such card was measured here)
B300 = GPU("B300", 288_000_000_000, 7.0e12)
MACHINES = {"16 x H200": (GPUS["H200"], 16, 8), "32 x H100": (GPUS["H100"], 32, 8), "8 x B300": (B300, 8, 8)}
CONTEXT = 1 << 20


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    ep: int
    dcp: int
    weights: float            # bytes per GPU
    cache_budget: float       # bytes per GPU left for the cache (negative: does not fit)
    latent_1m: float          # MLA latent of one 1M-token sequence, per GPU
    state_1m: float           # KDA state of one sequence, per GPU

    @property
    def fits(self) -> bool:
        return self.cache_budget > 0

    @property
    def sequences_1m(self) -> int:
        return max(0, int(self.cache_budget // (self.latent_1m + self.state_1m)))

    def name(self) -> str:
        parts = [f"TP{self.tp}"] + [f"PP{self.pp}"] * (self.pp > 1) + [f"EP{self.ep}"] * (self.ep > 1) + \
            [f"DCP{self.dcp}"] * (self.dcp > 1)
        return " x ".join(parts)


def layout_bytes(config: ModelConfig, gpu: GPU, tp: int, pp: int, ep: int, dcp: int,
                 dtype: torch.dtype = torch.bfloat16) -> Layout:
    """One layout's bytes per GPU (ValueError when TP / EP cannot cut the model)."""
    s = compute_sizing(config, tp, ep, dtype, gpu=gpu.name if gpu.name in GPUS else "H200")
    everywhere = s.embedding_bytes / tp * 2 + s.weights_replicated      # embedding + LM head, replicated parts
    layers = s.weights_sharded / tp - s.embedding_bytes / tp * 2
    weights = everywhere + (layers + s.experts_per_gpu) / pp
    budget = MEMORY_FRACTION * gpu.memory - weights - OVERHEAD_BYTES
    return Layout(tp, pp, ep, dcp, weights, budget, CONTEXT * s.kv_bytes_per_token / pp / dcp,
                  s.state_bytes_per_seq / pp)


def propose(config: ModelConfig, gpu: GPU, gpus: int, per_node: int) -> list[Layout]:
    """Every layout of ``gpus`` GPUs that TP / EP can cut the model into, best first."""
    out = []
    for pp in [p for p in range(1, gpus + 1) if gpus % p == 0 and p <= config.text.num_hidden_layers]:
        tp = gpus // pp
        if tp > per_node and tp % per_node:
            continue                      # a TP group spans whole nodes or stays inside one
        for dcp in sorted({1, tp}):
            for ep in (tp, 1):            # whole experts over the TP ranks where they divide, else TP-split
                try:
                    out.append(layout_bytes(config, gpu, tp, pp, ep, dcp))
                    break
                except ValueError:
                    continue
    return sorted(out, key=lambda x: (not x.fits, -x.sequences_1m, x.pp, x.dcp, -x.ep))


def format_layouts(config: ModelConfig, top: int = 4) -> str:
    lines = [f"layouts for 1M-token sequences (bf16 weights as stored, bf16 latent; u = {MEMORY_FRACTION}, "
             f"{OVERHEAD_BYTES / GIB:.0f} GiB overhead per GPU; embedding and LM head on every pipeline stage):"]
    for machine, (gpu, n, per_node) in MACHINES.items():
        lines.append(f"  {machine} ({gpu.memory / GIB:.0f} GiB each, {per_node} a node):")
        lines.append(f"    {'layout':<26} {'weights':>9} {'cache':>9} {'latent/1M':>10} {'KDA/seq':>8} {'1M seqs':>8}")
        proposals = propose(config, gpu, n, per_node)
        if not proposals:
            lines.append(f"    no layout cuts this model over {n} GPUs (its heads or layers do not divide)")
        for x in proposals[:top]:
            cache = f"{x.cache_budget / GIB:.1f}" if x.fits else "no fit"
            lines.append(f"    {x.name():<26} {x.weights / GIB:>8.1f}G {cache:>8}G {x.latent_1m / GIB:>9.2f}G "
                         f"{x.state_1m / GIB * 1024:>6.1f}M {x.sequences_1m:>8}")
    return "\n".join(lines)
