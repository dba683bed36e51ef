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

Misses (``offload_policy.py``, ``--expert-offload-policy``): per batch size, from measured rates, either
copied in after routing (``copy``), or predicted while the previous MoE layer runs and copied on a side
stream (``copy_stream``, joined by an event before the layer's kernels; the first MoE layer's prediction
starts the step) with the unpredicted rest copied after routing (``prefetch``), or computed on the host
from the pinned weights (``host``: eager steps only). A prefetch writes only staging rows after the previous
layer's kernels have read theirs, and a layer reads what arrived only when the prefetch was made for it in
this step (``_pending``), so every strategy runs the same weights: the same tokens as resident.

Storage: bf16 (or the model dtype) experts, MXFP4 (packed codes and E8M0 scales) or FP8 (``--quantization fp8``:
E4M3 codes and one float32 scale per output channel): every tensor with one row per expert has its pool, and the
copies move codes and scales together, so a pool row is the host row bit for bit.

Parallelism (``cpu_offload_gb`` is a budget per GPU, as vLLM's flag): each rank offloads from what it holds: under
tensor parallelism its slices of all E experts, under expert parallelism its E / e experts (the router's global
ids are mapped to the rank's and other ranks' pairs left out, on the device: ``ExpertOffload.used``), under
pipeline parallelism its stage's MoE layers. A token-sharded exchange (``moe_exchange.py``) stages the pairs a
rank receives. Every rank refreshes its own hot set between steps (``parallel/worker.py`` as the runner does) from
its own counts; nothing is exchanged, and each rank's partial sum is the resident one, hence the same tokens.

The CPU path (tests): the pool is a CPU tensor too, so the whole mechanism (host pool -> "device" pool,
staging, refresh, exactness) runs in every engine mode without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

import torch

from kimik3.model.offload_policy import POLICIES, PREDICTORS, LayerShape, MissPolicy, MissRates, measure_rates, \
    predicts_all
from kimik3.ops.expert_copy import byte_rows, copy_experts
from kimik3.ops.moe_host import fused_moe_host_misses

logger = logging.getLogger(__name__)
GIB = 1 << 30


@dataclass(frozen=True)
class ExpertOffloadConfig:
    cpu_offload_bytes: int                  # routed-expert bytes of this process kept in host memory
    refresh_interval: int = 4               # engine steps between hot-set refreshes
    decay: float = 0.9                      # weight of the older routing counts at a refresh
    swap_margin: float = 0.25               # an expert replaces a cached one whose score it beats by this share
    policy: str = "auto"                    # how misses are served (``offload_policy.POLICIES``)
    prefetch_from: str = "router"           # what predicts a layer's experts (``offload_policy.PREDICTORS``)
    rates: MissRates | None = None          # the policy's rates; None: measured on CUDA, assumed on the CPU

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
        if self.policy not in POLICIES:
            raise ValueError(f"expert_offload_policy must be one of {POLICIES}, got {self.policy!r}")
        if self.prefetch_from not in PREDICTORS:
            raise ValueError(f"prefetch_from must be one of {PREDICTORS}, got {self.prefetch_from!r}")
        if self.rates is not None and not isinstance(self.rates, MissRates):
            raise ValueError(f"rates must be a MissRates, got {type(self.rates).__name__}")

    @classmethod
    def from_gib(cls, cpu_offload_gb: float, **kw) -> ExpertOffloadConfig:
        if isinstance(cpu_offload_gb, bool) or not isinstance(cpu_offload_gb, (int, float)) \
                or not math.isfinite(cpu_offload_gb) or cpu_offload_gb < 0:
            raise ValueError(f"cpu_offload_gb must be a number of GiB >= 0, got {cpu_offload_gb!r}")
        return cls(int(cpu_offload_gb * GIB), **kw)


def _kinds(experts) -> list[str]:
    """The tensors with one row per expert: w13, w2 and, MXFP4 or FP8, their scales."""
    return ["w13", "w2"] + (["w13_scale", "w2_scale"] if experts.mxfp4 or experts.fp8 else [])


def expert_bytes(experts) -> int:
    """Bytes of one expert of an ``Experts`` module (every stored tensor)."""
    return sum(getattr(experts, k)[0].numel() * getattr(experts, k).element_size() for k in _kinds(experts))


def check_budget(moes: list, config: ExpertOffloadConfig) -> int:
    """The routed-expert bytes of ``moes`` (meta modules will do): this rank's, the experts or expert slices it
    holds under tensor / expert / pipeline parallelism (``cpu_offload_gb`` is a budget per GPU, as vLLM's flag);
    ValueError when the offload asks for more."""
    if not moes:
        raise ValueError("cpu_offload_gb: the model (or this pipeline stage) has no routed experts to offload")
    n, E, per = len(moes), moes[0].experts.w13.shape[0], expert_bytes(moes[0].experts)
    total = n * E * per
    if config.cpu_offload_bytes > total:
        what = "the routed experts this rank holds" if moes[0].par.enabled else "the model's routed experts here"
        raise ValueError(f"cpu_offload_gb={config.cpu_offload_bytes / GIB:.4g} (per GPU) is more than {what} "
                         f"({total / GIB:.4g} GiB: {n} layers x {E} experts x {per:,} B); "
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

    def __init__(self, moes: list, config: ExpertOffloadConfig, device: torch.device,
                 dtype: torch.dtype = torch.bfloat16, layer_bytes: float = 0.0):
        """``dtype``: the experts' activations; ``layer_bytes``: the weight bytes a decoder layer reads besides its
        routed experts (the GPU time a prefetch overlaps, for the measured miss policy)."""
        self.config, self.device, self.compute_dtype = config, torch.device(device), dtype
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
        # expert parallelism: the router's ids are global, this rank holds experts [first_expert, first_expert + E)
        self.expert_parallel, self.first_expert = moes[0].par.ep_size > 1, first.first_expert
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
        self.steps = self.refreshes = self.swapped = self.host_pairs = 0
        # prefetch: the experts each layer used last (a predictor), the current prediction, and counts
        self.last_used = torch.zeros(n, E, dtype=torch.bool, device=self.device)
        self.predicted = torch.zeros(E, dtype=torch.bool, device=self.device)
        self.prefetched = torch.zeros(n, dtype=torch.int64, device=self.device)       # experts copied ahead
        self.prefetch_used = torch.zeros(n, dtype=torch.int64, device=self.device)    # ... that routing then used
        cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self._prefetch_done: torch.cuda.Event | None = None
        self._pending: int | None = None                # the layer the prediction in flight is for
        self._pending_input: torch.Tensor | None = None     # its input, kept until the main stream is past it
        self.mode = "copy"
        self._snapshot: torch.Tensor | None = None
        self._snapshot_done: torch.cuda.Event | None = None
        for i in range(n):
            for c, e in enumerate(self.cached[i]):
                self._fill(i, e, i * S + c)
        self._write_tables()
        for i, m in enumerate(moes):
            m.offload = LayerOffload(self, i)
        self.expert_bytes = per
        self.pair_flops = 6.0 * first.w2.shape[1] * (first.w13.shape[1] // 2)
        rates = config.rates or (measure_rates(self, layer_bytes) if cuda and M else MissRates())
        # the policy's chance that an expert is used follows the routing over all E experts of the model (under
        # expert parallelism this rank holds E / e of them: ``num_experts`` here)
        shape = LayerShape(moes[0].cfg.num_experts, moes[0].cfg.top_k, M, per, self.pair_flops)
        self.policy = MissPolicy(config.policy, shape, rates, host_exact=not cuda)
        logger.info("%s", self.policy.describe())
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

    # ---- within a step ------------------------------------------------------------------------------
    def begin_step(self, tokens: int) -> None:
        """Before a forward of ``tokens`` tokens: pick how its misses are served (a CUDA graph being captured
        cannot compute on the host) and, to prefetch, start predicting and copying the first MoE layer's."""
        graph = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        mode = self.policy.choose(tokens, graph) if self.staging_size else "copy"
        if mode != self.mode:
            logger.debug("expert offload: %d tokens%s -> %s", tokens, " (graph)" if graph else "", mode)
        self.mode, self._pending, self._pending_input = mode, None, None
        if mode == "prefetch":
            self.prefetch(0, None, tokens)

    def prefetch(self, i: int, x: torch.Tensor | None, tokens: int) -> None:
        """Predict layer i's experts (its router on ``x``, the previous MoE layer's input, and/or what layer i
        used in the previous step) and copy the predicted uncached ones into their staging rows: on the copy
        stream, after everything queued so far (the previous layer's kernels have read the staging rows)."""
        stream = self.copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self._predict(i, x, tokens)
            self.prefetched[i] += self.predicted[self.staged[i]].sum()
            for k in self.kinds:
                copy_experts(byte_rows(self._host(i, k)), byte_rows(self.pool[k]), self.staged[i],
                             self.staging_rows, self.predicted)
            if stream is not None:             # a fresh event each time: a captured graph keeps every edge
                self._prefetch_done = torch.cuda.Event()
                self._prefetch_done.record(stream)
        self._pending, self._pending_input = i, x

    def _predict(self, i: int, x: torch.Tensor | None, tokens: int) -> None:
        if predicts_all(self.policy.shape, tokens):
            self.predicted.fill_(True)
            return
        source = self.config.prefetch_from
        if x is None or source != "router":
            self.predicted.copy_(self.last_used[i])
        else:
            self.predicted.zero_()
        if x is not None and source != "previous_step":
            _, ids = self.moes[i].route(x)
            self.predicted.logical_or_(self.used(ids))

    def take_prefetch(self, i: int) -> torch.Tensor | None:
        """For layer i's staging: the experts prefetched for it in this step ([E] bool; None: none), once
        they have arrived (the current stream waits for the copy stream)."""
        if self._pending != i:
            return None
        if self.copy_stream is not None:
            torch.cuda.current_stream().wait_event(self._prefetch_done)
        self._pending = None
        return self.predicted

    def _local(self, ids: torch.Tensor, local: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Routed ids (flattened) as this rank's expert indices, and which of them it holds (None: all). Under
        expert parallelism another rank's id maps to 0 with valid False. Device work: no host synchronisation."""
        flat = ids.reshape(-1)
        if local or not self.expert_parallel:
            return flat, None
        flat = flat - self.first_expert
        valid = (flat >= 0) & (flat < self.num_experts)
        return torch.where(valid, flat, 0), valid

    def used(self, ids: torch.Tensor, local: bool = False) -> torch.Tensor:
        """[E] bool on the device: this rank's experts that ``ids`` route to (``local``: ids already local)."""
        flat, valid = self._local(ids, local)
        out = torch.zeros(self.num_experts + 1, dtype=torch.bool, device=flat.device)
        return out.index_fill_(0, flat if valid is None else flat.masked_fill(~valid, self.num_experts), True)[:-1]

    def count(self, i: int, ids: torch.Tensor, local: bool = False) -> None:
        """Add ``ids``' (token, expert) pairs on this rank's experts to layer i's routing counts."""
        flat, valid = self._local(ids, local)
        ones = torch.ones(flat.shape, dtype=torch.float32, device=flat.device) if valid is None else valid.float()
        self.counts[i].index_add_(0, flat, ones)

    def missed(self, i: int) -> torch.Tensor:
        """[E] bool on the host: layer i's experts the GPU does not cache."""
        out = torch.ones(self.num_experts, dtype=torch.bool)
        out[self.cached[i]] = False
        return out

    def stats(self) -> dict:
        return {"cache_experts_per_layer": self.cache_size, "host_experts_per_layer": self.staging_size,
                "staged_experts": int(self.copies.sum()), "prefetched_experts": int(self.prefetched.sum()),
                "prefetched_used": int(self.prefetch_used.sum()), "host_pairs": self.host_pairs,
                "refreshes": self.refreshes, "swapped": self.swapped, "policy": self.policy.name}


class LayerOffload:
    """One MoE layer's view of the pool: ``stage(ids)`` after routing, ``weights()`` for the kernels."""

    def __init__(self, owner: ExpertOffload, index: int):
        self.owner, self.index = owner, index

    def stage(self, ids: torch.Tensor, local: bool = False) -> None:
        """Count the batch's routed pairs; copy its uncached experts into their staging rows (those a prefetch
        brought in this step excepted; none when the host computes them). ``ids``: the router's (global; under
        expert parallelism the pairs on other ranks' experts are left out), or this rank's expert indices
        (``local``: a token-sharded exchange's received pairs)."""
        o, i = self.owner, self.index
        o.count(i, ids, local)
        if not o.staging_size:
            return
        used = o.used(ids, local)
        have = o.take_prefetch(i)
        o.last_used[i].copy_(used)
        if o.mode == "host":
            return
        if have is not None:
            o.prefetch_used[i] += (used & have)[o.staged[i]].sum()
            used &= ~have
        o.copies[i] += used[o.staged[i]].sum()
        for k in o.kinds:
            copy_experts(byte_rows(o._host(i, k)), byte_rows(o.pool[k]), o.staged[i], o.staging_rows, used)

    def after_experts(self, x: torch.Tensor) -> None:
        """Once this layer's expert kernels are queued: prefetch the next MoE layer's experts, predicted from
        ``x`` (this layer's MoE input)."""
        o = self.owner
        if o.mode == "prefetch" and self.index + 1 < o.num_layers:
            o.prefetch(self.index + 1, x, x.shape[0])

    @property
    def on_host(self) -> bool:
        return self.owner.mode == "host"

    def host_weights(self) -> tuple:
        """(w1, w2, w3) of the host pool (this layer's ``Experts``) in ``fused_moe``'s formats."""
        e = self.owner.moes[self.index].experts
        return (e.packed("w1"), e.packed("w2"), e.packed("w3")) if e.mxfp4 or e.fp8 else (e.w1, e.w2, e.w3)

    def run_host(self, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed sum with the uncached experts computed on the host (``ops.moe_host``)."""
        o, moe = self.owner, self.owner.moes[self.index]
        missed = o.missed(self.index)
        *pool, slots = self.weights()
        a = moe.act
        out = fused_moe_host_misses(z, tuple(pool), self.host_weights(), weights, ids, missed, a.hidden_act, a.beta,
                                    a.linear_beta, moe.cfg.combine_fp32, slots, moe.experts.scale_max,
                                    fp8=moe.experts.fp8)
        o.host_pairs += int(missed[ids.cpu()].sum())
        return out

    def weights(self):
        """(w1, w2, w3) over the whole pool in the ``Experts`` formats (MXFP4 or FP8: (codes, scales) pairs), and
        this layer's ``slots`` [E]."""
        o = self.owner
        if "w13_scale" in o.kinds:
            w13, s13 = o.pool["w13"], o.pool["w13_scale"]
            return ((_half(w13, 0), _half(s13, 0)), (o.pool["w2"], o.pool["w2_scale"]),
                    (_half(w13, 1), _half(s13, 1)), o.slots[self.index])
        w13 = o.pool["w13"]
        return _half(w13, 0), o.pool["w2"], _half(w13, 1), o.slots[self.index]
