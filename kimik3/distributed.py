"""Who this rank is in the tensor/expert-parallel group, and the collectives the model uses
(spec parallelism.md §1-3). Modules take a ``ParallelContext``; ``ParallelContext()`` (size 1) is
the single-process code path: no collective is ever issued. This module sits below the model (it
imports only torch); starting the processes of a group is ``kimik3.parallel``'s job.

Layout: the world is p pipeline stages (``PipelineContext``) of one TP group of t ranks each (p = 1: one TP group;
no data parallelism); expert parallelism reuses a stage's TP group with
degree e | t; decode context parallelism (DCP, spec §4.4) stripes the MLA latent cache's token
positions over groups of c | t consecutive TP ranks (``dcp_size``, ``dcp_group``). Experts are cut into e contiguous slices (rank r owns slice r // (t/e)), and each
slice's intermediate is split over the t/e ranks that share it (e = 1: TP-split experts; e = t:
whole experts, "TEP"). Token-sharded MoE modes ("a2a", "agrs") need e = t.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

MOE_MODES = ("tep", "a2a", "agrs")
MOE_TAILS = ("auto", "concat", "sliced")
# Token count above which the latent-MoE tail switches from (a) one all-reduce over
# [latent | shared] to (b) the column-sliced up-projection folded into the shared reduce.
# 2xH200, K3 widths, eager (benchmarks/history/01-2026-11-30.md "Multi-GPU"): (a) faster up to 1024 tokens
# (0.43 vs 0.46 ms), (b) from 2048 on (0.53 vs 0.58 ms; 1.58 vs 1.88 ms at 8192).
SLICED_TAIL_MIN_TOKENS = 1024


@dataclass
class ParallelContext:
    """Rank, size and process group of the TP group, the EP degree and the MoE choices.

    ``moe_mode`` (e > 1): "tep" tokens replicated, each rank runs its experts, partials reduced in
    the MoE tail; "a2a" each rank takes 1/t of the tokens, routes them, and sends latent rows to
    the expert owners with ``all_to_all_single``; "agrs" the same shards, all-gather of the
    latents, reduce-scatter of the expert partials. ``moe_tail``: "auto" picks by token count
    (``SLICED_TAIL_MIN_TOKENS``), "concat" / "sliced" force technique (a) / (b).
    """

    tp_rank: int = 0
    tp_size: int = 1
    group: object = None               # torch.distributed group of the TP ranks (None: world)
    ep_size: int = 1
    moe_mode: str = "tep"
    moe_tail: str = "auto"
    sliced_tail_min_tokens: int = SLICED_TAIL_MIN_TOKENS
    trace: list | None = field(default=None, repr=False)   # (op, bytes) of each collective, when a list
    dcp_size: int = 1                  # decode context parallel degree c (c | t): latent positions striped c ways
    dcp_group: object = None           # torch.distributed group of this rank's c DCP ranks (None: the TP group)
    eplb: bool = False                 # expert slots placed by load, logical -> physical routing (model/eplb.py)
    num_redundant_experts: int = 0     # R extra expert slots (EPLB): E + R slots, (E + R) / e per EP rank

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside [0, {self.tp_size})")
        if self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ValueError(f"expert parallel size {self.ep_size} must divide the tensor parallel size "
                             f"{self.tp_size} (experts are split over the TP ranks)")
        if self.moe_mode not in MOE_MODES:
            raise ValueError(f"moe_mode must be one of {MOE_MODES}, got {self.moe_mode!r}")
        if self.moe_mode != "tep" and self.ep_size != self.tp_size:
            raise ValueError(f"moe_mode {self.moe_mode!r} shards tokens over the EP ranks and needs expert "
                             f"parallel size = tensor parallel size (--enable-expert-parallel), got {self.ep_size} "
                             f"and {self.tp_size}")
        if not isinstance(self.dcp_size, int) or self.dcp_size < 1 or self.tp_size % self.dcp_size:
            raise ValueError(f"decode context parallel size {self.dcp_size} must divide the tensor parallel size "
                             f"{self.tp_size} (the latent cache is striped over TP ranks)")
        if self.eplb and self.ep_size == 1:
            raise ValueError("expert load balancing (--enable-eplb) places experts over expert-parallel ranks: "
                             "add --enable-expert-parallel with a tensor parallel size > 1")
        if self.num_redundant_experts and not self.eplb:
            raise ValueError("num_redundant_experts needs --enable-eplb")
        if self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
        if self.moe_tail not in MOE_TAILS:
            raise ValueError(f"moe_tail must be one of {MOE_TAILS}, got {self.moe_tail!r}")

    @property
    def enabled(self) -> bool:
        return self.tp_size > 1

    # ---- expert placement --------------------------------------------------------------------
    @property
    def expert_tp_size(self) -> int:
        """Ranks sharing one expert slice (each holds 1/expert_tp_size of its intermediate)."""
        return self.tp_size // self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.tp_rank // self.expert_tp_size

    @property
    def expert_tp_rank(self) -> int:
        return self.tp_rank % self.expert_tp_size

    @property
    def dcp_rank(self) -> int:
        """This rank's stripe of the latent cache: it holds the token positions p with p % dcp_size == dcp_rank."""
        return self.tp_rank % self.dcp_size

    @property
    def tokens_sharded(self) -> bool:
        """The MoE runs on 1/t of the tokens per rank (all-to-all or all-gather/reduce-scatter)."""
        return self.enabled and self.moe_mode != "tep"

    def use_sliced_tail(self, num_tokens: int) -> bool:
        if self.moe_tail == "auto":
            return num_tokens > self.sliced_tail_min_tokens
        return self.moe_tail == "sliced"

    def split(self, n: int, what: str, size: int | None = None, rank: int | None = None) -> tuple[int, int]:
        """(start, length) of this rank's contiguous 1/size share of n items."""
        size = self.tp_size if size is None else size
        rank = self.tp_rank if rank is None else rank
        if n % size:
            raise ValueError(f"{what} ({n}) is not divisible by the parallel degree {size}")
        return rank * (n // size), n // size

    # ---- collectives (no-ops at size 1) --------------------------------------------------------
    def _log(self, op: str, t: torch.Tensor) -> None:
        if self.trace is not None:
            self.trace.append((op, t.numel() * t.element_size()))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the TP group, in place; returns x."""
        if self.enabled:
            self._log("all_reduce", x)
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[n, ...] on every rank -> [t*n, ...] (rank order)."""
        if not self.enabled:
            return x
        self._log("all_gather", x)
        out = x.new_empty((self.tp_size * x.shape[0], *x.shape[1:]))
        _ALL_GATHER(out, x.contiguous(), group=self.group)
        return out

    def reduce_scatter_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[t*n, ...] partials -> this rank's [n, ...] block of the sum."""
        if not self.enabled:
            return x
        self._log("reduce_scatter", x)
        out = x.new_empty((x.shape[0] // self.tp_size, *x.shape[1:]))
        _REDUCE_SCATTER(out, x.contiguous(), group=self.group)
        return out

    def gather_columns_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """[n, c] on every rank -> [n, t*c] on TP rank 0 (None elsewhere): the vocab-parallel logits."""
        if not self.enabled:
            return x
        self._log("gather", x)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(x, parts, dst=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                    group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                   async_op: bool = False):
        """Rows [sum(send_counts), ...] -> [sum(recv_counts), ...]: rows for rank d go to d."""
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        self._log("all_to_all", x)
        work = dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=self.group,
                                      async_op=async_op)
        return (out, work) if async_op else out

    # ---- decode context parallelism (spec §4.4) -------------------------------------------------
    def _dcp(self):
        if self.dcp_group is not None:
            return self.dcp_group
        return self.group if self.dcp_size == self.tp_size else _missing_dcp_group()

    def dcp_gather_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[T, h, D] (this rank's heads) -> [T, c*h, D]: the heads of the c DCP ranks, in rank order."""
        if self.dcp_size == 1:
            return x
        self._log("dcp_all_gather", x)
        out = x.new_empty((self.dcp_size * x.shape[1], x.shape[0], *x.shape[2:]))
        _ALL_GATHER(out, x.transpose(0, 1).contiguous(), group=self._dcp())
        return out.transpose(0, 1)

    def dcp_scatter_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[T, c*h, D] partials of every DCP rank's heads -> [c, T, h, D]: the partials of this rank's
        heads from each of the c ranks (one all-to-all)."""
        c = self.dcp_size
        if c == 1:
            return x.unsqueeze(0)
        T, ch = x.shape[:2]
        send = x.reshape(T, c, ch // c, *x.shape[2:]).transpose(0, 1).contiguous()      # [c (dest), T, h, D]
        self._log("dcp_all_to_all", send)
        out = torch.empty_like(send)
        dist.all_to_all_single(out, send, group=self._dcp())
        return out

    # ---- expert moves (EPLB's live rebalance) -------------------------------------------------------
    def ep_peer(self, ep_rank: int) -> int:
        """The world rank of EP rank ``ep_rank``'s member that holds this rank's share of an expert's intermediate."""
        r = ep_rank * self.expert_tp_size + self.expert_tp_rank
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def send_to_ep_rank(self, tensors: list[torch.Tensor], ep_rank: int, tag: int) -> list:
        """Each tensor to EP rank ``ep_rank`` (tags ``tag * 16 + i``), not waited for: the pending sends."""
        self._log("send", tensors[0])
        return [dist.isend(t.contiguous(), self.ep_peer(ep_rank), tag=tag * 16 + i) for i, t in enumerate(tensors)]

    def recv_from_ep_rank(self, tensors: list[torch.Tensor], ep_rank: int, tag: int) -> list:
        """Into each (contiguous) tensor, what ``send_to_ep_rank`` sent with ``tag``: the pending receives."""
        return [dist.irecv(t, self.ep_peer(ep_rank), tag=tag * 16 + i) for i, t in enumerate(tensors)]

    def exchange_counts(self, send_counts: torch.Tensor) -> list[int]:
        """Each rank's int64 count per destination -> the counts this rank receives from each."""
        recv = torch.empty_like(send_counts)
        dist.all_to_all_single(recv, send_counts, group=self.group)
        return recv.tolist()


def _missing_dcp_group():
    raise RuntimeError("decode context parallel size < tensor parallel size needs its DCP group: build the "
                       "context with make_dcp_group")


def make_dcp_group(tp_ranks: list[int], dcp_size: int, rank: int):
    """The group of ``rank``'s c consecutive TP ranks (spec §4.4), None when c is 1 or the whole TP group.
    Every rank of the world calls it with the same arguments (``new_group`` is collective)."""
    if dcp_size in (1, len(tp_ranks)):
        return None
    mine = None
    for g in range(0, len(tp_ranks), dcp_size):
        ranks = tp_ranks[g:g + dcp_size]
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


@dataclass(frozen=True)
class PipelineContext:
    """This rank's pipeline stage (spec parallelism §4.3): stage s holds decoder layers ``ranges[s]`` =
    [start, end); the world's rank of (stage s, TP rank r) is s * tp_size + r. One stage: no transfer ever.
    The transfers of a step (``kimik3.parallel.pipeline``): each micro-batch's stream to the next stage's rank of
    the same TP rank, the last stage's logits to world rank 0; sends are not waited for (``wait_sent``).
    ``timeline``: when a list, each step appends the (micro-batch, start, end) of the work this stage did on its
    micro-batches, ``time.monotonic`` seconds (what the overlap test reads)."""

    stage: int = 0
    ranges: tuple[tuple[int, int], ...] = ()
    tp_rank: int = 0
    tp_size: int = 1
    timeline: list | None = field(default=None, compare=False, repr=False)

    @property
    def num_stages(self) -> int:
        return max(len(self.ranges), 1)

    @property
    def enabled(self) -> bool:
        return self.num_stages > 1

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def holds(self, layer: int) -> bool:
        return not self.enabled or self.ranges[self.stage][0] <= layer < self.ranges[self.stage][1]

    def peer(self, stage: int) -> int:
        """The world rank with this rank's TP rank in ``stage``."""
        return stage * self.tp_size + self.tp_rank

    @property
    def logits_source(self) -> int:
        """The world rank that sends rank 0 the logits: TP rank 0 of the last stage."""
        return (self.num_stages - 1) * self.tp_size

    def send(self, tensors: list[torch.Tensor]) -> list:
        """To the next stage's rank of the same TP rank, not waited for: a count, then each tensor (shapes
        known there). Returns the pending sends for ``wait_sent`` (each holds its tensor until it is sent)."""
        dst = self.peer(self.stage + 1)
        count = torch.tensor([len(tensors)], dtype=torch.int64, device=tensors[0].device)
        return [(dist.isend(t, dst), t) for t in (count, *(t.contiguous() for t in tensors))]

    def recv(self, shape: tuple, dtype: torch.dtype, device) -> list[torch.Tensor]:
        """From the previous stage (waits for them): the tensors ``send`` sent, each of ``shape``."""
        src = self.peer(self.stage - 1)
        n = torch.empty(1, dtype=torch.int64, device=device)
        dist.recv(n, src)
        out = [torch.empty(shape, dtype=dtype, device=device) for _ in range(int(n.item()))]
        for t in out:
            dist.recv(t, src)
        return out

    def send_logits(self, logits: torch.Tensor) -> list:
        """Last stage's TP rank 0: logits rows to world rank 0, which samples (not waited for: ``wait_sent``)."""
        logits = logits.contiguous()
        return [(dist.isend(logits, 0), logits)]

    def recv_logits(self, rows: int, vocab: int, dtype: torch.dtype, device) -> torch.Tensor:
        out = torch.empty(rows, vocab, dtype=dtype, device=device)
        dist.recv(out, self.logits_source)
        return out

    @staticmethod
    def wait_sent(pending: list) -> None:
        """Wait for the sends ``send`` / ``send_logits`` returned."""
        for work, _ in pending:
            work.wait()


def plan_stages(layer_bytes: list[int], stages: int, block_size: int | None = None) -> tuple[tuple[int, int], ...]:
    """Contiguous layer ranges, one per stage, balancing the layers' weight bytes; with attention residuals
    (``block_size``) a cut may move by up to two layers, within one layer's bytes of the balance, to send
    fewer block vectors: a cut before layer c sends ceil(c / block_size) blocks and the partial, the same
    count for every cut inside a block (spec §4.3), so it moves back to a block's end when that is near."""
    L = len(layer_bytes)
    if not 1 <= stages <= L:
        raise ValueError(f"pipeline parallel size {stages} must lie in [1, {L}] (the decoder layers)")
    total, cuts, start = sum(layer_bytes), [], 0
    for s in range(1, stages):
        target, acc, cut = total * s / stages, 0, start + 1
        for i in range(L):
            acc += layer_bytes[i]
            if acc >= target:
                cut = i + 1 if acc - target < target - (acc - layer_bytes[i]) else i
                break
        cut = min(max(cut, start + 1), L - (stages - s))
        if block_size:      # a cut before layer c sends ceil(c / block_size) blocks and the partial
            off = abs(sum(layer_bytes[:cut]) - target) + max(layer_bytes)
            near = [c for c in range(cut - 2, cut + 3) if start < c <= L - (stages - s)
                    and abs(sum(layer_bytes[:c]) - target) <= off]
            cut = min(near, key=lambda c: (-(-c // block_size), abs(sum(layer_bytes[:c]) - target), c))
        cuts.append(cut)
        start = cut
    bounds = [0, *cuts, L]
    return tuple((bounds[i], bounds[i + 1]) for i in range(stages))


# torch 2.13 renamed the tensor collectives (the old names warn); the GPU machines run 2.11
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
