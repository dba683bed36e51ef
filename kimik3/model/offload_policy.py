"""Expert offload's miss policy: how a batch's misses (experts it routes to that the GPU does not cache) are
served, chosen per batch size from measured rates (``--expert-offload-policy``, ``expert_offload.py``):

* ``copy``: copied from pinned host memory into their staging rows right after the layer's routing;
* ``prefetch``: while layer l runs, layer l+1's experts are predicted (layer l+1's router on layer l's MoE
  input, and/or the experts layer l+1 used in the previous step) and the predicted misses copied on a side
  stream, overlapping layer l's work and layer l+1's attention; after routing, the misses not predicted
  are copied as in ``copy``;
* ``host``: the host computes the missed experts' rows from the pinned weights and sends back their
  weighted sum. It waits for the routing on the host, so only eager steps can take it (a CUDA graph
  cannot); on a GPU its sums round differently from the GPU kernels' (not bit-exact), on the CPU path it is
  the same arithmetic (exact).

The cost of a layer's misses for a batch of T tokens, routing taken as uniform (an uncached expert is used
with probability p = 1 - (1 - k/E)^T; M of a layer's E experts are not cached):

    m = M p missed experts;  c = one expert's bytes / copy rate
    copy:     m c
    prefetch: max(0, m c - W) + (1 - a) m c       (a: the share of misses predicted; W: the layer's GPU time
                                                   the copy overlaps). When the batch's routing covers most
                                                   experts (p >= 0.9) the prediction is every uncached
                                                   expert: max(0, M c - W)
    host:     s + m b / h + T k (M / E) f / F     (s: the device -> host -> device round trip; b / h: one
                                                   expert's weights read (MXFP4: decoded) at the host rate h;
                                                   f: one (token, expert) pair's FLOPs at the host rate F)

Policies: ``copy`` and ``prefetch`` always take that strategy; ``auto`` takes, per batch size, the cheaper
of copy and prefetch, and host compute where it is cheaper and exact (the CPU path); ``host`` is ``auto``
that also lets the host compute the misses of eager steps on a GPU where that is cheaper. The planner
(``kimik3.sizing``) predicts decode with the same costs.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace

import torch

logger = logging.getLogger(__name__)

POLICIES = ("auto", "copy", "prefetch", "host")
STRATEGIES = ("copy", "prefetch", "host")
PREDICT_ALL = 0.9           # batches whose routing covers this share of the experts prefetch every uncached one
PREDICTORS = ("router", "previous_step", "both")


@dataclass(frozen=True)
class MissRates:
    """The rates the miss policy weighs (measured on the GPU at start-up: ``measure_rates``)."""
    copy: float = 50e9              # bytes/s of experts staged from pinned host memory (PCIe 5.0 x16: 64 raw)
    host_bytes: float = 50e9        # bytes/s the host reads (decodes) an expert's weights to compute with them
    host_flops: float = 0.5e12      # FLOP/s of the host's expert products (one GPU's share of the node)
    host_sync: float = 50e-6        # s: a layer's round trip to the host (routing down, rows and sums back)
    layer_seconds: float = 0.0      # W: a layer's GPU time a prefetch overlaps
    prefetch_accuracy: float = 0.5  # a: the share of a layer's misses the prediction names (assumed)
    source: str = "assumed"

    def __post_init__(self) -> None:
        for name in ("copy", "host_bytes", "host_flops"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"MissRates.{name} must be a positive rate, got {v!r}")
        for name in ("host_sync", "layer_seconds"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"MissRates.{name} must be seconds >= 0, got {v!r}")
        if not 0.0 <= self.prefetch_accuracy <= 1.0:
            raise ValueError(f"MissRates.prefetch_accuracy must lie in [0, 1], got {self.prefetch_accuracy!r}")

    def describe(self) -> str:
        return (f"{self.source} rates: copy {self.copy / 1e9:.1f} GB/s, host {self.host_bytes / 1e9:.1f} GB/s of "
                f"weights and {self.host_flops / 1e9:.0f} GFLOP/s, host round trip {self.host_sync * 1e6:.0f} us, "
                f"layer GPU time {self.layer_seconds * 1e6:.0f} us; assumed prefetch accuracy "
                f"{self.prefetch_accuracy:.0%}")


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer as the policy sees it."""
    num_experts: int                # E
    top_k: int                      # k
    uncached: int                   # M: experts a layer keeps in host memory
    expert_bytes: float             # one expert's bytes (this GPU's share)
    pair_flops: float               # FLOPs of one (token, expert) pair: 6 x width x intermediate


def used_share(shape: LayerShape, tokens: int) -> float:
    """p: the chance a given expert is used by ``tokens`` tokens, routing uniform."""
    E, k = shape.num_experts, shape.top_k
    return 1.0 - (1.0 - min(k, E) / E) ** max(tokens, 0) if E else 0.0


def predicts_all(shape: LayerShape, tokens: int) -> bool:
    """Whether a prefetch for ``tokens`` tokens names every uncached expert (the routing covers most of them)."""
    return used_share(shape, tokens) >= PREDICT_ALL


def miss_costs(shape: LayerShape, rates: MissRates, tokens: int) -> dict[str, float]:
    """Seconds a layer spends on its misses for a batch of ``tokens`` tokens, per strategy."""
    p = used_share(shape, tokens)
    c = shape.expert_bytes / rates.copy
    m = shape.uncached * p
    W, a = rates.layer_seconds, rates.prefetch_accuracy
    prefetch = max(0.0, shape.uncached * c - W) if predicts_all(shape, tokens) else max(0.0, m * c - W) + (1 - a) * m * c
    pairs = tokens * shape.top_k * shape.uncached / shape.num_experts if shape.num_experts else 0.0
    host = (rates.host_sync + m * shape.expert_bytes / rates.host_bytes + pairs * shape.pair_flops / rates.host_flops
            if m else 0.0)
    return {"copy": m * c, "prefetch": prefetch, "host": host}


class MissPolicy:
    """Picks a strategy per batch size; ``choose(tokens, graph)`` (memoised), ``describe()`` for the log."""

    def __init__(self, name: str, shape: LayerShape, rates: MissRates, host_exact: bool):
        if name not in POLICIES:
            raise ValueError(f"expert offload policy must be one of {POLICIES}, got {name!r}")
        self.name, self.shape, self.rates, self.host_exact = name, shape, rates, host_exact
        self._memo: dict[tuple[int, bool], str] = {}

    def allowed(self, graph: bool) -> tuple[str, ...]:
        if self.name in ("copy", "prefetch"):
            return (self.name,)
        host = not graph and (self.host_exact or self.name == "host")
        return ("copy", "prefetch", "host") if host else ("copy", "prefetch")

    def choose(self, tokens: int, graph: bool = False) -> str:
        key = (tokens, graph)
        if key not in self._memo:
            costs = miss_costs(self.shape, self.rates, tokens)
            self._memo[key] = min(self.allowed(graph), key=lambda s: costs[s])     # ties: the first named
        return self._memo[key]

    def describe(self, batches=(1, 2, 4, 8, 16, 32, 64, 128, 256)) -> str:
        rows = []
        for t in batches:
            c = miss_costs(self.shape, self.rates, t)
            graph, eager = self.choose(t, True), self.choose(t, False)
            pick = graph if graph == eager else f"{graph} in graphs, {eager} eager"
            rows.append(f"{t} tokens: {pick} (copy {c['copy'] * 1e3:.2f} / prefetch {c['prefetch'] * 1e3:.2f} / "
                        f"host {c['host'] * 1e3:.2f} ms a layer)")
        return f"expert offload policy {self.name} ({self.rates.describe()}): " + "; ".join(rows)


# ---- measured rates (CUDA) -----------------------------------------------------------------------------
def _cuda_seconds(fn, iters: int = 3) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def _host_seconds(fn, iters: int = 2) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def measure_rates(offload, layer_bytes: float, base: MissRates = MissRates()) -> MissRates:
    """The rates of this GPU and host: staging copies of a few experts from pinned memory, a device copy
    (the HBM rate W follows from: ``layer_bytes`` / rate), one expert computed on the host for 1 and 8 tokens,
    and a device -> host -> device round trip. About a second at start-up."""
    from kimik3.ops.expert_copy import byte_rows, copy_experts
    from kimik3.ops.moe_host import expert_rows
    o, dev = offload, offload.device
    n = max(1, min(8, o.staging_size))
    experts, rows = o.staged[0, :n].clone(), o.staging_rows[:n]
    used = torch.ones(o.num_experts, dtype=torch.bool, device=dev)

    def stage():
        for k in o.kinds:
            copy_experts(byte_rows(o._host(0, k)), byte_rows(o.pool[k]), experts, rows, used)

    copy = n * o.expert_bytes / _cuda_seconds(stage)
    buf = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    hbm = 2 * buf.numel() / _cuda_seconds(lambda: buf.clone())
    moe, e = o.moes[0], int(o.staged_host[0][0])
    host = moe.offload.host_weights()
    one, eight = (torch.randn(t, moe.experts.w2.shape[1], dtype=o.compute_dtype) for t in (1, 8))
    h1 = _host_seconds(lambda: expert_rows(one, *host, e, moe.act))
    h8 = _host_seconds(lambda: expert_rows(eight, *host, e, moe.act))
    flops = 7 * o.pair_flops / (h8 - h1) if h8 > h1 else base.host_flops
    read = max(h1 - o.pair_flops / flops, 1e-9)
    small = torch.zeros(16, device=dev)
    sync = _host_seconds(lambda: small.cpu().to(dev).sum().item(), iters=5)
    rates = replace(base, copy=copy, host_bytes=o.expert_bytes / read, host_flops=flops, host_sync=sync,
                    layer_seconds=layer_bytes / hbm + 10e-6, source="measured")
    logger.info("expert offload: %s", rates.describe())
    return rates
