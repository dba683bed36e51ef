"""Token-sharded expert parallelism (spec parallelism §2): the MoE layer runs on 1/t of the tokens
per rank and an exchange takes each token's latent row to the ranks that own its experts and the
results back. "a2a" (``AllToAllExchange``): rows sent with ``all_to_all_single``; "agrs"
(``GatherScatterExchange``): every rank's latents all-gathered, the expert partials
reduce-scattered. The shared experts (replicated weights) run on the rank's own tokens while the
rows travel. The block (``moe.MoE``) supplies the math: route, to_latent, shared, run_experts,
combine, from_latent.
"""

from __future__ import annotations

import torch

from kimik3.distributed import ParallelContext
from kimik3.ops import ceil_div


class ExpertExchange:
    """Runs a whole token-sharded MoE layer: rank r takes tokens [r n, (r+1) n) (n = ceil(T/t)),
    routes them, projects them to the latent width, exchanges (``experts``), completes the
    output of its tokens and all-gathers [T, D]."""

    def __init__(self, par: ParallelContext):
        self.par = par

    def forward(self, moe, x: torch.Tensor) -> torch.Tensor:
        par = self.par
        T = x.shape[0]
        n = ceil_div(T, par.tp_size)
        lo = min(par.tp_rank * n, T)
        own = x[lo:min(lo + n, T)]
        weights, ids = moe.route(own)
        u, s = self.experts(moe, own, moe.to_latent(own), weights, ids, n)
        y = moe.from_latent(u, s)
        if y.shape[0] < n:
            y = torch.cat([y, y.new_zeros(n - y.shape[0], y.shape[1])])
        return par.all_gather_rows(y)[:T]

    def experts(self, moe, own, z, weights, ids, n) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The complete routed sum of this rank's tokens [len(own), L] and their shared output."""
        raise NotImplementedError


class AllToAllExchange(ExpertExchange):
    def experts(self, moe, own, z, weights, ids, n):
        """Spec §2.2 protocol with deduplication: one latent row per (token, destination rank),
        whatever the number of that token's experts there. Exchange row and pair counts, send the
        rows and, per (token, expert) pair, (row within the sender's block, local expert id,
        weight); the destination runs each pair, sums a row's pairs (fp32 when the combine is) and
        sends one row back per (token, destination); the owner adds them per token. The shared
        experts run while the rows travel."""
        par = self.par
        n, k = ids.shape
        ranks = par.tp_size
        per_rank = moe.experts.w1.shape[0]
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
        s = moe.shared(own)
        rows_sent.wait()
        recv_start = torch.cumsum(torch.tensor(recv_rows, device=z.device), 0) - torch.tensor(recv_rows, device=z.device)
        source = torch.repeat_interleave(torch.arange(ranks, device=z.device),
                                         torch.tensor(recv_pairs, device=z.device))
        row_of_pair = recv_start[source] + recv_meta[:, 0].long()
        local = recv_meta[:, 1:2].long()
        if moe.offload is not None:          # expert offload: copy in the received pairs' uncached experts
            moe.offload.stage(local, local=True)
        out = moe.run_experts(rows[row_of_pair], recv_meta[:, 2:], local)
        back = par.all_to_all(moe.combine(rows.shape[0], row_of_pair, out), recv_rows, send_rows)
        return moe.combine(n, (keys // ranks)[order], back), s


class GatherScatterExchange(ExpertExchange):
    def experts(self, moe, own, z, weights, ids, n):
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
        s = moe.shared(own)
        if moe.offload is not None:          # expert offload: copy in the uncached experts every shard routed to
            moe.offload.stage(ids_all)
        u = par.reduce_scatter_rows(moe.local_experts(z_all, w_all, ids_all))
        return u[:own.shape[0]], s


def make_exchange(par: ParallelContext) -> ExpertExchange | None:
    """The exchange of ``par.moe_mode`` when the MoE runs token-sharded, else None (tokens replicated)."""
    if not par.tokens_sharded:
        return None
    return {"a2a": AllToAllExchange, "agrs": GatherScatterExchange}[par.moe_mode](par)
