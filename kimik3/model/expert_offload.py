"""Expert offload (``--cpu-offload-gb``): routed experts beyond a GPU budget live in host memory.

Every MoE layer's experts stay whole in their ``Experts`` module, which the loader places in host memory
(pinned on CUDA): the host pool. The GPU holds one pool of expert rows for the whole model (``pool``,
one tensor per stored weight: w13, w2 and, MXFP4, their scales):

* rows ``[l S, (l + 1) S)``: layer l's cache of S hot experts;
* rows ``[n S, n S + M)``: a staging area shared by the n MoE layers, M = E - S rows: one for each expert
  layer l does not cache (layers run one after another, so they can share it).

M = ceil(cpu_offload_bytes / (n x one expert's bytes)): the budget is rounded up to whole experts a layer, and
the GPU holds (n S + M) experts, the staging area included.

``slots`` [n, E] maps each layer's expert ids to pool rows (cached: its cache row; else: its staging
row), so a layer's experts run through the usual kernels with ``slots`` (``kimik3.ops.moe``): the
assignments are sorted by expert id as always and only the weight rows are looked up, hence the same
tokens as with every expert resident, bit for bit. Once a layer has routed a batch, the experts it uses
that are not cached are copied from the host pool into their staging rows (``stage``: device work sized
by the routing, no host synchronisation; on CUDA the copy runs on the MoE layer's side stream beside the
latent down-projection while graphs are captured). All addresses are fixed, so decode steps capture into
CUDA graphs; a refresh only rewrites pool rows and ``slots`` in place.

Which experts a layer caches follows its router: ``stage`` counts each layer's routed (token, expert)
pairs on the device; before every ``refresh_interval``-th engine step (``refresh``) the counts join a
decayed score and each layer moves toward caching its S highest-scoring experts: the hottest newcomer
replaces the coldest cached expert while it beats it by ``swap_margin`` (a swap costs one expert's copy,
so near-ties do not churn). The first cache holds experts 0..S-1 of each layer.

Policy: misses are copied to the GPU and computed there. Computing them on the host instead would read
the same bytes from host memory, cannot run inside a CUDA graph, and its float sums would differ from the
GPU kernel's (not exact); ``kimik3 inspect`` prints both predictions.

The CPU path (tests): the pool is a CPU tensor too, so the whole mechanism (host pool -> "device" pool,
staging, refresh, exactness) runs in every engine mode without a GPU.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from kimik3.ops.expert_copy import byte_rows, copy_experts

logger = logging.getLogger(__name__)
GIB = 1 << 30


@dataclass(frozen=True)
class ExpertOffloadConfig:
    cpu_offload_bytes: int                  # routed-expert bytes of this process kept in host memory
    refresh_interval: int = 4               # engine steps between hot-set refreshes
    decay: float = 0.9                      # weight of the older routing counts at a refresh
    swap_margin: float = 0.25               # an expert replaces a cached one whose score it beats by this share

    def __post_init__(self) -> None:
        if not isinstance(self.cpu_offload_bytes, int) or isinstance(self.cpu_offload_bytes, bool) \
                or self.cpu_offload_bytes < 0:
            raise ValueError(f"cpu_offload_gb must be >= 0 (GiB of routed experts kept in host memory), "
                             f"got {self.cpu_offload_bytes!r} bytes")
        if not isinstance(self.refresh_interval, int) or self.refresh_interval < 1:
            raise ValueError(f"refresh_interval must be a positive integer, got {self.refresh_interval!r}")
        if not 0.0 <= self.decay <= 1.0:
            raise ValueError(f"decay must lie in [0, 1], got {self.decay!r}")
        if not self.swap_margin >= 0.0:
            raise ValueError(f"swap_margin must be >= 0, got {self.swap_margin!r}")

    @classmethod
    def from_gib(cls, cpu_offload_gb: float, **kw) -> ExpertOffloadConfig:
        if isinstance(cpu_offload_gb, bool) or not isinstance(cpu_offload_gb, (int, float)) \
                or not math.isfinite(cpu_offload_gb) or cpu_offload_gb < 0:
            raise ValueError(f"cpu_offload_gb must be a number of GiB >= 0, got {cpu_offload_gb!r}")
        return cls(int(cpu_offload_gb * GIB), **kw)


def _kinds(experts) -> list[str]:
    return ["w13", "w2"] + (["w13_scale", "w2_scale"] if experts.mxfp4 else [])


def expert_bytes(experts) -> int:
    """Bytes of one expert of an ``Experts`` module (every stored tensor)."""
    return sum(getattr(experts, k)[0].numel() * getattr(experts, k).element_size() for k in _kinds(experts))


def check_budget(moes: list, config: ExpertOffloadConfig) -> int:
    """The routed-expert bytes of ``moes`` (meta modules will do); ValueError when the offload asks for more."""
    if not moes:
        raise ValueError("cpu_offload_gb: the model has no routed experts to offload")
    n, E, per = len(moes), moes[0].experts.w13.shape[0], expert_bytes(moes[0].experts)
    total = n * E * per
    if config.cpu_offload_bytes > total:
        raise ValueError(f"cpu_offload_gb={config.cpu_offload_bytes / GIB:.4g} is more than the model's routed "
                         f"experts here ({total / GIB:.4g} GiB: {n} layers x {E} experts x {per:,} B); "
                         f"give at most {math.floor(total / GIB * 1e4) / 1e4:g}")
    return total


def move_to_host(experts) -> None:
    """Put an ``Experts`` module's tensors in pinned host memory (no-op when they are in host memory)."""
    if experts.w13.device.type == "cpu":
        return
    for p in experts.parameters():
        p.data = torch.empty(p.shape, dtype=p.dtype, pin_memory=True).copy_(p.data)
    for key, b in experts._buffers.items():
        experts._buffers[key] = torch.empty(b.shape, dtype=b.dtype, pin_memory=True).copy_(b)


def _half(t: torch.Tensor, i: int) -> torch.Tensor:
    n = t.shape[1] // 2
    return t[:, i * n:(i + 1) * n]


class ExpertOffload:
    """The GPU pool, the slot tables and the routing statistics of every offloaded MoE layer."""

    def __init__(self, moes: list, config: ExpertOffloadConfig, device: torch.device):
        self.config, self.device = config, torch.device(device)
        self.moes = moes
        total = check_budget(moes, config)
        for m in moes:          # a model built on the GPU (benchmarks): its experts move to pinned host memory
            move_to_host(m.experts)
        first = moes[0].experts
        self.kinds = _kinds(first)
        for m in moes:
            if [getattr(m.experts, k).shape for k in self.kinds] != [getattr(first, k).shape for k in self.kinds]:
                raise ValueError("expert offload needs every MoE layer's experts to have one shape")
        n, E, per = len(moes), first.w13.shape[0], expert_bytes(first)
        M = -(-config.cpu_offload_bytes // (n * per))          # experts a layer leaves in host memory
        S = E - M
        self.num_layers, self.num_experts, self.cache_size, self.staging_size = n, E, S, M
        self.pool = {k: torch.empty((n * S + M, *getattr(first, k).shape[1:]), dtype=getattr(first, k).dtype,
                                    device=self.device) for k in self.kinds}
        self.pool_bytes = (n * S + M) * per
        # host mirrors of the tables: which expert sits in each cache row / staging row
        self.cached = [list(range(S)) for _ in range(n)]
        self.staged_host = [list(range(S, E)) for _ in range(n)]
        self.slots = torch.empty(n, E, dtype=torch.int64, device=self.device)
        self.staged = torch.empty(n, M, dtype=torch.int64, device=self.device)
        self.staging_rows = torch.arange(n * S, n * S + M, dtype=torch.int64, device=self.device)
        self.counts = torch.zeros(n, E, dtype=torch.float32, device=self.device)      # routed pairs since refresh
        self.copies = torch.zeros(n, dtype=torch.int64, device=self.device)           # experts staged, per layer
        self.score = torch.zeros(n, E, dtype=torch.float64)
        self.steps = self.refreshes = self.swapped = 0
        self._snapshot: torch.Tensor | None = None
        self._snapshot_done: torch.cuda.Event | None = None
        for i in range(n):
            for c, e in enumerate(self.cached[i]):
                self._fill(i, e, i * S + c)
        self._write_tables()
        for i, m in enumerate(moes):
            m.offload = LayerOffload(self, i)
        logger.info("expert offload: %d of %d experts a layer cached on the GPU (%d layers, %.2f GiB with a "
                    "staging area of %d experts), %d a layer in host memory (%.2f GiB of %.2f)", S, E, n,
                    self.pool_bytes / GIB, M, M, n * M * per / GIB, total / GIB)

    # ---- tables -----------------------------------------------------------------------------------
    def _host(self, i: int, kind: str) -> torch.Tensor:
        return getattr(self.moes[i].experts, kind)

    def _fill(self, i: int, expert: int, row: int) -> None:
        for k in self.kinds:
            self.pool[k][row].copy_(self._host(i, k)[expert], non_blocking=True)

    def _write_tables(self) -> None:
        n, S = self.num_layers, self.cache_size
        slots = torch.empty(n, self.num_experts, dtype=torch.int64)
        for i in range(n):
            slots[i, self.cached[i]] = torch.arange(i * S, (i + 1) * S)
            slots[i, self.staged_host[i]] = torch.arange(n * S, n * S + self.staging_size)
        self.slots.copy_(slots)
        self.staged.copy_(torch.tensor(self.staged_host, dtype=torch.int64).view(n, self.staging_size))

    # ---- between steps -----------------------------------------------------------------------------
    def refresh(self) -> None:
        """Before an engine step: every ``refresh_interval`` steps, cache each layer's highest-scoring
        experts (decayed routing counts). Host work and stream-ordered copies; graphs stay valid."""
        self.steps += 1
        if self.steps % self.config.refresh_interval or not self.staging_size or not self.cache_size:
            return
        counts = self._take_counts()
        if counts is None:
            return
        self.score.mul_(self.config.decay).add_(counts)
        swaps = 0
        for i in range(self.num_layers):
            swaps += self._refresh_layer(i)
        if swaps:
            self._write_tables()
        self.refreshes += 1
        self.swapped += swaps

    def _take_counts(self) -> torch.Tensor | None:
        """The routing counts since the last refresh. On CUDA without waiting: the counts are copied to
        pinned memory behind the steps already launched, and the copy made at the previous refresh is
        used (the steps before the previous one; async scheduling has already waited for them)."""
        if self.device.type != "cuda":
            counts = self.counts.to(torch.float64)
            self.counts.zero_()
            return counts
        ready = None
        if self._snapshot_done is not None:
            self._snapshot_done.synchronize()
            ready = self._snapshot.to(torch.float64)
        else:
            self._snapshot = torch.empty(self.counts.shape, dtype=torch.float32, pin_memory=True)
        self._snapshot.copy_(self.counts, non_blocking=True)
        self.counts.zero_()
        self._snapshot_done = torch.cuda.Event()
        self._snapshot_done.record()
        return ready

    def _refresh_layer(self, i: int) -> int:
        S, cached = self.cache_size, self.cached[i]
        # the S highest scores; at equal scores what is cached stays (a stable sort, cached experts first)
        order = torch.tensor(cached + self.staged_host[i])
        rank = torch.argsort(self.score[i][order], descending=True, stable=True)
        want = set(order[rank[:S]].tolist())
        score = self.score[i].tolist()
        # the hottest newcomers against the coldest leavers; a swap costs a copy, so only a clear win swaps
        leaving = sorted((c for c, e in enumerate(cached) if e not in want), key=lambda c: score[cached[c]])
        entering = sorted(want.difference(cached), key=lambda e: -score[e])
        swaps = 0
        for c, e in zip(leaving, entering):
            out = cached[c]
            if score[e] <= score[out] * (1 + self.config.swap_margin):
                break
            r = self.staged_host[i].index(e)
            self._fill(i, e, i * S + c)
            cached[c], self.staged_host[i][r] = e, out
            swaps += 1
        return swaps

    def stats(self) -> dict:
        return {"cache_experts_per_layer": self.cache_size, "host_experts_per_layer": self.staging_size,
                "staged_experts": int(self.copies.sum()), "refreshes": self.refreshes, "swapped": self.swapped}


class LayerOffload:
    """One MoE layer's view of the pool: ``stage(ids)`` after routing, ``weights()`` for the kernels."""

    def __init__(self, owner: ExpertOffload, index: int):
        self.owner, self.index = owner, index

    def stage(self, ids: torch.Tensor) -> None:
        """Count the batch's routed pairs; copy its uncached experts into their staging rows."""
        o, i = self.owner, self.index
        flat = ids.reshape(-1)
        o.counts[i].index_add_(0, flat, torch.ones(flat.shape, dtype=torch.float32, device=flat.device))
        if not o.staging_size:
            return
        used = torch.zeros(o.num_experts, dtype=torch.bool, device=flat.device).index_fill_(0, flat, True)
        o.copies[i] += used[o.staged[i]].sum()
        for k in o.kinds:
            copy_experts(byte_rows(o._host(i, k)), byte_rows(o.pool[k]), o.staged[i], o.staging_rows, used)

    def weights(self):
        """(w1, w2, w3) over the whole pool in the ``Experts`` formats, and this layer's ``slots`` [E]."""
        o = self.owner
        if "w13_scale" in o.kinds:
            w13, s13 = o.pool["w13"], o.pool["w13_scale"]
            return ((_half(w13, 0), _half(s13, 0)), (o.pool["w2"], o.pool["w2_scale"]),
                    (_half(w13, 1), _half(s13, 1)), o.slots[self.index])
        w13 = o.pool["w13"]
        return _half(w13, 0), o.pool["w2"], _half(w13, 1), o.slots[self.index]
