"""Mixture of experts (spec text-backbone §3): fp32 router with bias-corrected grouped top-k,
routed experts (on a latent width for K3), shared experts on the original input.

Under tensor/expert parallelism (spec parallelism §1.7, §2, §3) the router and the latent
down/up projections and norm are replicated; each rank runs its experts (its expert slice, and
its share of their intermediate) and the shared experts' intermediate share, then the MoE tail
completes both partial sums: technique (a) one all-reduce over [latent | shared], or (b) the
latent all-reduce, then each rank adds its column slice of the up-projection into its shared
partial and one more all-reduce stitches the slices. Token-sharded modes ("a2a", "agrs") run
the MoE on 1/t of the tokens per rank with replicated shared experts and all-gather the result.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from kimik3.config import TextConfig
from kimik3.distributed import ParallelContext
from kimik3.model.layers import MLP, GLUActivation, RMSNorm, linear
from kimik3.ops import ceil_div, mxfp4
from kimik3.ops.moe import fused_moe, fused_moe_mxfp4
from kimik3.ops.norm import acc_dtype
from kimik3.ops.router import route_tokens

# Batches up to this many tokens run the router and the shared experts on a side CUDA stream
# (when the model was given one), beside the routed down-projection and the routed experts.
SIDE_STREAM_MAX_TOKENS = 256


class Router(nn.Module):
    """``gate.weight`` [E, D] and ``gate.e_score_correction_bias`` [E] (fp32 by default, D4)."""

    def __init__(self, hidden_size: int, num_experts: int, with_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        if with_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))


def _half(t: torch.Tensor, i: int) -> torch.Tensor:
    """Half i (0 or 1) of t's rows per expert: [E, 2n, k] -> [E, n, k], a view."""
    n = t.shape[1] // 2
    return t[:, i * n:(i + 1) * n]


class Experts(nn.Module):
    """Routed experts stacked per projection: w1 (gate) and w3 (up) [E, I, L], w2 (down) [E, L, I].
    w1 and w3 are the two halves of one parameter ``w13`` [E, 2I, L] (views), so the grouped-GEMM path
    runs gate and up as one GEMM over the gathered tokens. The checkpoint stores them one by one
    (``experts.{e}.w{1,2,3}``); ``load_expert`` places them.

    MXFP4 storage (``use_mxfp4_storage``, chosen by the loader on CUDA): w13/w2 hold the packed
    uint8 codes [E, N, K/2] and ``w13_scale`` / ``w2_scale`` the E8M0 scales [E, N, K/32]; the kernels
    dequantize on the fly (a quarter of the bytes of bf16). ``scale_max`` is the largest scale
    code placed so far (None: unknown, e.g. buffers written directly; the kernels then assume any)."""

    def __init__(self, num_experts: int, width: int, intermediate: int, first_expert: int = 0,
                 intermediate_shard: tuple[int, int] = (0, 1)):
        super().__init__()
        # this module holds global experts [first_expert, first_expert + num_experts), and of each
        # the intermediate slice ``intermediate_shard`` = (index, count) (the loader narrows to it)
        self.first_expert, self.intermediate_shard = first_expert, intermediate_shard
        self.w13 = nn.Parameter(torch.zeros(num_experts, 2 * intermediate, width))
        self.w2 = nn.Parameter(torch.zeros(num_experts, width, intermediate))
        self.mxfp4 = False
        self.scale_max: int | None = None

    # w1 / w3 (and their MXFP4 scales): the first and second halves of w13 (of w13_scale)
    w1 = property(lambda self: _half(self.w13, 0))
    w3 = property(lambda self: _half(self.w13, 1))
    w1_scale = property(lambda self: _half(self.w13_scale, 0))
    w3_scale = property(lambda self: _half(self.w13_scale, 1))

    def use_mxfp4_storage(self) -> None:
        """Switch to packed storage (before the weights are loaded)."""
        E, I2, L = self.w13.shape
        for which, (n, k) in {"w13": (I2, L), "w2": (L, I2 // 2)}.items():
            dev = getattr(self, which).device
            setattr(self, which, nn.Parameter(torch.zeros(E, n, k // 2, dtype=torch.uint8, device=dev),
                                              requires_grad=False))
            self.register_buffer(f"{which}_scale", torch.zeros(E, n, k // mxfp4.GROUP, dtype=torch.uint8, device=dev),
                                 persistent=False)
        self.mxfp4 = True
        self.scale_max = None

    def packed(self, which: str) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, which), getattr(self, f"{which}_scale")

    def holds(self, expert: int) -> bool:
        return self.first_expert <= expert < self.first_expert + self.w1.shape[0]

    def _check(self, expert: int, which: str, shape: tuple, name: str) -> None:
        E = self.w1.shape[0]
        if not self.holds(expert):
            raise ValueError(f"{name}: expert {expert} out of range (this module holds experts "
                             f"{self.first_expert}..{self.first_expert + E - 1})")
        E, a, b = self.w1.shape if which != "w2" else self.w2.shape
        want = (a, b * 2) if self.mxfp4 else (a, b)
        if tuple(shape) != want:
            raise ValueError(f"{name}: shape {tuple(shape)}, expected {want}")

    def load_expert(self, expert: int, which: str, tensor: torch.Tensor, name: str) -> None:
        """Place a dense expert weight (quantized to MXFP4 when the storage is packed)."""
        self._check(expert, which, tensor.shape, name)
        if self.mxfp4:
            packed, scale = mxfp4.quantize(tensor.float().cpu())
            return self.load_expert_mxfp4(expert, which, packed, scale, name)
        getattr(self, which).data[expert - self.first_expert].copy_(tensor)

    def load_expert_mxfp4(self, expert: int, which: str, packed: torch.Tensor, scale: torch.Tensor,
                          name: str) -> None:
        """Place a checkpoint's MXFP4 pair as is (packed storage), or dequantized (dense storage)."""
        if not self.mxfp4:
            return self.load_expert(expert, which, mxfp4.dequantize(packed, scale, torch.float32, name=name), name)
        n, half = packed.shape
        self._check(expert, which, (n, 2 * half), name)
        if packed.dtype != torch.uint8 or scale.dtype != torch.uint8 or tuple(scale.shape) != (n, 2 * half // mxfp4.GROUP):
            raise ValueError(f"{name}: MXFP4 pair {packed.dtype} {tuple(packed.shape)} / {scale.dtype} "
                             f"{tuple(scale.shape)} does not match [N, K/2] uint8 / [N, K/32] uint8")
        top = int(scale.max())
        if top == 255:
            raise ValueError(f"{name}: weight_scale holds 255, the E8M0 NaN encoding")
        self.scale_max = max(self.scale_max or 0, top)
        getattr(self, which).data[expert - self.first_expert].copy_(packed)
        getattr(self, f"{which}_scale")[expert - self.first_expert].copy_(scale)


class MoE(nn.Module):
    def __init__(self, cfg: TextConfig, act: GLUActivation, parallel: ParallelContext | None = None):
        super().__init__()
        self.par = par = parallel or ParallelContext()
        D = cfg.hidden_size
        width = cfg.routed_expert_hidden_size or D
        self.cfg = cfg
        self.act = act
        first, num_local, inter = 0, cfg.num_experts, cfg.moe_intermediate_size
        if par.enabled:
            first, num_local = par.split(cfg.num_experts, "routed experts", par.ep_size, par.ep_rank)
            _, inter = par.split(inter, "expert intermediate size", par.expert_tp_size, par.expert_tp_rank)
        self.gate = Router(D, cfg.num_experts, with_bias=True)
        self.experts = Experts(num_local, width, inter, first, (par.expert_tp_rank, par.expert_tp_size))
        if cfg.routed_expert_hidden_size is not None:
            self.routed_expert_down_proj = linear(D, width)
            self.routed_expert_up_proj = linear(width, D)
        if cfg.latent_moe_use_norm:
            self.routed_expert_norm = RMSNorm(width, cfg.rms_norm_eps)
        if cfg.num_shared_experts:
            # token-sharded modes run the shared experts on the rank's own tokens: replicated weights
            shared_par = None if par.tokens_sharded else par
            self.shared_experts = MLP(D, cfg.moe_intermediate_size * cfg.num_shared_experts, act, shared_par,
                                      reduce=False)
        self.can_slice_up = par.enabled and hasattr(self, "routed_expert_up_proj") and D % par.tp_size == 0
        self.side_stream: torch.cuda.Stream | None = None      # set by KimiForCausalLM.use_side_stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, s = self.forward_parts(x)
        return y if s is None else y + s

    def forward_parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's output as (routed, shared) when it is their plain sum (one process, no routed
        up-projection: Kimi-Linear), so the residual stream adds both in the norm that reads them
        (``ResidualStream.add``); else (output, None)."""
        if self.par.tokens_sharded:
            return self._forward_token_sharded(x), None
        # Small batches leave the GPU half idle in each GEMV, so with a side stream two run at once:
        # the router (GEMM + top-k) beside the routed down-projection, then the shared experts
        # beside the routed experts. Same kernels and results as one stream. Memory: ``side``
        # starts after everything queued so far (x is ready) and the main stream waits for it
        # before using its outputs and before returning, so no block the caching allocator hands
        # out here is reused while the other stream may still read it.
        side = self.side_stream if x.shape[0] <= SIDE_STREAM_MAX_TOKENS else None
        on_side = (lambda: torch.cuda.stream(side)) if side is not None else contextlib.nullcontext
        if side is not None:
            main = torch.cuda.current_stream()
            side.wait_stream(main)
        with on_side():
            weights, ids = self._route(x)
        z = self.routed_expert_down_proj(x) if hasattr(self, "routed_expert_down_proj") else x
        if side is not None:
            main.wait_stream(side)
        with on_side():
            s = self.shared_experts(x) if hasattr(self, "shared_experts") else None
        u = self._local_experts(z, weights, ids)
        if side is not None:
            main.wait_stream(side)
        if self.par.enabled:
            return self._tail(u, s), None
        if hasattr(self, "routed_expert_norm") or hasattr(self, "routed_expert_up_proj"):
            return self._finish(u, s), None
        return u, s

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        # logits of both operands upcast, fp32 (spec §3.1)
        return route_tokens(x, self.gate.weight, self.gate.e_score_correction_bias, cfg.num_experts_per_token,
                            cfg.moe_router_activation_func, cfg.num_expert_group, cfg.topk_group,
                            cfg.moe_renormalize, cfg.routed_scaling_factor, cfg.numerics.router_renorm_eps)

    def _run_experts(self, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """z [T, L], weights/ids [T, k] (local expert ids) -> weighted sum [T, L] in z's dtype."""
        cfg, e = self.cfg, self.experts
        if z.shape[0] == 0:
            return z.new_zeros(z.shape)
        if e.mxfp4:
            return fused_moe_mxfp4(z, e.packed("w1"), e.packed("w2"), e.packed("w3"), weights, ids, self.act.hidden_act,
                                   self.act.beta, self.act.linear_beta, cfg.numerics.moe_combine_fp32, e.scale_max)
        return fused_moe(z, e.w1, e.w2, e.w3, weights, ids, self.act.hidden_act, self.act.beta, self.act.linear_beta,
                         cfg.numerics.moe_combine_fp32)

    def _local_experts(self, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of the routed sum over all tokens ([T, L]; the whole sum in one process).
        Under EP only (token, slot) pairs routed to local experts run, one row per pair."""
        if self.par.ep_size == 1:
            return self._run_experts(z, weights, ids)
        local = ids - self.experts.first_expert
        tok, slot = ((local >= 0) & (local < self.experts.w1.shape[0])).nonzero(as_tuple=True)
        out = self._run_experts(z[tok], weights[tok, slot].unsqueeze(-1), local[tok, slot].unsqueeze(-1))
        return self._combine(z.shape[0], tok, out)

    def _combine(self, num_tokens: int, tok: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Sum per-pair expert rows [n, L] into their tokens -> [num_tokens, L] (fp32 sum if official)."""
        acc = acc_dtype(rows.dtype) if self.cfg.numerics.moe_combine_fp32 else rows.dtype
        u = torch.zeros(num_tokens, rows.shape[-1], dtype=acc, device=rows.device)
        return u.index_add_(0, tok, rows.to(acc)).to(rows.dtype)

    def _finish(self, u: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
        """Complete latent sum u [T, L] and shared output s -> layer output [T, D]."""
        if hasattr(self, "routed_expert_norm"):
            u = self.routed_expert_norm(u)
        y = self.routed_expert_up_proj(u) if hasattr(self, "routed_expert_up_proj") else u
        return y if s is None else y + s

    def _tail(self, u: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
        """Partials u [T, L] and s [T, D] of this rank -> the replicated layer output [T, D]."""
        par = self.par
        if s is None or not hasattr(self, "routed_expert_up_proj"):
            if not hasattr(self, "routed_expert_norm"):       # linear in u: sum first, reduce once
                return par.all_reduce(u if s is None else u + s)
            return self._finish(par.all_reduce(u), None if s is None else par.all_reduce(s))
        w_up = self.routed_expert_up_proj.weight                  # [D, L], replicated
        norm = self.routed_expert_norm if hasattr(self, "routed_expert_norm") else (lambda v: v)
        if self.can_slice_up and par.use_sliced_tail(u.shape[0]):
            # (b): rank r adds rows R_r of the up-projection into its own shared partial's columns
            # R_r; the reduce of s then sums the shared partials and stitches the routed slices.
            n = norm(par.all_reduce(u))
            lo, width = par.split(w_up.shape[0], "hidden size")
            s[:, lo:lo + width] = torch.addmm(s[:, lo:lo + width], n, w_up[lo:lo + width].t())
            return par.all_reduce(s)
        # (a): one all-reduce over [latent | shared], then the full up-projection onto the shared sum
        L = u.shape[-1]
        buf = par.all_reduce(torch.cat([u, s], dim=-1))
        return torch.addmm(buf[:, L:], norm(buf[:, :L]), w_up.t())

    def _forward_token_sharded(self, x: torch.Tensor) -> torch.Tensor:
        """Rank r takes tokens [r n, (r+1) n) (n = ceil(T/t)), runs router, down-projection, expert
        exchange, latent tail and replicated shared experts on them, then all-gathers [T, D]."""
        par = self.par
        T = x.shape[0]
        n = ceil_div(T, par.tp_size)
        lo = min(par.tp_rank * n, T)
        own = x[lo:min(lo + n, T)]
        weights, ids = self._route(own)
        z = self.routed_expert_down_proj(own) if hasattr(self, "routed_expert_down_proj") else own
        if par.moe_mode == "a2a":
            u, s = self._all_to_all_experts(own, z, weights, ids)
        else:
            u, s = self._gathered_experts(own, z, weights, ids, n)
        y = self._finish(u, s)
        if y.shape[0] < n:
            y = torch.cat([y, y.new_zeros(n - y.shape[0], y.shape[1])])
        return par.all_gather_rows(y)[:T]

    def _shared(self, own: torch.Tensor) -> torch.Tensor | None:
        return self.shared_experts(own) if hasattr(self, "shared_experts") else None

    def _all_to_all_experts(self, own, z, weights, ids):
        """Spec §2.2 protocol with deduplication: one latent row per (token, destination rank),
        whatever the number of that token's experts there. Exchange row and pair counts, send the
        rows and, per (token, expert) pair, (row within the sender's block, local expert id,
        weight); the destination runs each pair, sums a row's pairs (fp32 when the combine is) and
        sends one row back per (token, destination); the owner adds them per token. The shared
        experts run while the rows travel."""
        par = self.par
        n, k = ids.shape
        ranks = par.tp_size
        per_rank = self.experts.w1.shape[0]
        dest = ids // per_rank                                              # [n, k] destination rank
        token = torch.arange(n, device=z.device).unsqueeze(1).expand(n, k)
        keys, pair_row = torch.unique((token * ranks + dest).reshape(-1), return_inverse=True)
        row_dest = keys % ranks
        order = torch.argsort(row_dest, stable=True)                        # send buffer: rows by rank
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel(), device=z.device)
        row_counts = torch.bincount(row_dest, minlength=ranks)
        row_start = torch.cumsum(row_counts, 0) - row_counts
        pair_dest = dest.reshape(-1)
        # row of each pair within its destination's block (< 2**24 rows: exact in fp32 metadata)
        local_row = position[pair_row] - row_start[pair_dest]
        pair_order = torch.argsort(pair_dest, stable=True)
        meta = torch.stack([local_row.to(weights.dtype), (ids.reshape(-1) % per_rank).to(weights.dtype),
                            weights.reshape(-1)], -1)[pair_order]
        pair_counts = torch.bincount(pair_dest, minlength=ranks)
        recv_rows = par.exchange_counts(row_counts)
        recv_pairs = par.exchange_counts(pair_counts)
        send_rows = row_counts.tolist()
        rows, rows_sent = par.all_to_all(z[(keys // ranks)[order]], send_rows, recv_rows, async_op=True)
        recv_meta = par.all_to_all(meta, pair_counts.tolist(), recv_pairs)
        s = self._shared(own)
        rows_sent.wait()
        recv_start = torch.cumsum(torch.tensor(recv_rows, device=z.device), 0) - torch.tensor(recv_rows, device=z.device)
        source = torch.repeat_interleave(torch.arange(ranks, device=z.device),
                                         torch.tensor(recv_pairs, device=z.device))
        row_of_pair = recv_start[source] + recv_meta[:, 0].long()
        out = self._run_experts(rows[row_of_pair], recv_meta[:, 2:], recv_meta[:, 1:2].long())
        back = par.all_to_all(self._combine(rows.shape[0], row_of_pair, out), recv_rows, send_rows)
        return self._combine(n, (keys // ranks)[order], back), s

    def _gathered_experts(self, own, z, weights, ids, n):
        """All-gather the shards' latents and routes (padded to n rows, pad ids -1), run the local
        experts for every token, reduce-scatter the partials back to their owners."""
        par = self.par
        pad = n - z.shape[0]
        if pad:
            z = torch.cat([z, z.new_zeros(pad, z.shape[1])])
            weights = torch.cat([weights, weights.new_zeros(pad, weights.shape[1])])
            ids = torch.cat([ids, ids.new_full((pad, ids.shape[1]), -1)])
        z_all = par.all_gather_rows(z)
        w_all, ids_all = par.all_gather_rows(weights), par.all_gather_rows(ids)
        s = self._shared(own)
        u = par.reduce_scatter_rows(self._local_experts(z_all, w_all, ids_all))
        return u[:own.shape[0]], s
