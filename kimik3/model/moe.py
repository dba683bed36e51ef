"""Mixture of experts (spec text-backbone §3): fp32 router with bias-corrected grouped top-k,
routed experts, shared experts on the original input. Two variants, chosen once from the config
by ``build_moe``:

- ``MoE`` (plain, Kimi-Linear): the routed experts act on x itself, y = u + y_shared (§3.5 last
  paragraph);
- ``LatentMoE`` (K3): z = x W_down^T, the routed experts act on z, y = RMSNorm(u) W_up^T + y_shared
  (§3.5; the norm when ``latent_moe_use_norm``).

Under tensor/expert parallelism (spec parallelism §1.7, §2, §3) the router and the latent
down/up projections and norm are replicated; each rank runs its experts (its expert slice, and
its share of their intermediate) and the shared experts' intermediate share, then the block's
``reduce`` completes both partial sums (the latent variant's tail: technique (a) one all-reduce
over [latent | shared], or (b) the latent all-reduce, then each rank adds its column slice of the
up-projection into its shared partial and one more all-reduce stitches the slices). Token-sharded
modes ("a2a", "agrs") hand the whole layer to an ``ExpertExchange`` (``moe_exchange.py``). Eagerly a rank
runs the (token, expert) pairs on its experts alone, whose count comes to the host; inside
``fixed_shape_experts`` (what CUDA graphs capture) it runs every pair, other ranks' at weight 0
(``MoE.local_pairs``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from kimik3.config import TextConfig
from kimik3.distributed import ParallelContext
from kimik3.model.eplb import Placement, plan_moves
from kimik3.model.expert_offload import LayerOffload
from kimik3.model.layers import MLP, GLUActivation, RMSNorm, linear
from kimik3.model.moe_exchange import ExpertExchange, make_exchange
from kimik3.ops import mxfp4
from kimik3.ops.fp8 import FP8, quantize_weight
from kimik3.ops.moe import fused_moe, fused_moe_fp8, fused_moe_mxfp4
from kimik3.ops.norm import acc_dtype
from kimik3.ops.options import tuning
from kimik3.ops.router import route_tokens



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
    code placed so far (None: unknown, e.g. buffers written directly; the kernels then assume any).

    FP8 storage (``use_fp8_storage``, ``--quantization fp8`` of bf16 experts, Kimi-Linear's): w13/w2 hold
    E4M3 codes [E, N, K] and ``w13_scale`` / ``w2_scale`` one float32 scale per output channel [E, N]
    (``kimik3.ops.fp8.quantize_weight``); each expert tensor is quantised as it is placed, so the model
    dtype's copy of the experts never exists whole."""

    def __init__(self, num_experts: int, width: int, intermediate: int, first_expert: int = 0,
                 intermediate_shard: tuple[int, int] = (0, 1)):
        super().__init__()
        # this module holds global experts [first_expert, first_expert + num_experts), and of each
        # the intermediate slice ``intermediate_shard`` = (index, count) (the loader narrows to it)
        self.first_expert, self.intermediate_shard = first_expert, intermediate_shard
        # the logical expert of each local slot (EPLB: ``set_slots``); plain: first_expert + j
        self.slot_experts = list(range(first_expert, first_expert + num_experts))
        self.w13 = nn.Parameter(torch.zeros(num_experts, 2 * intermediate, width))
        self.w2 = nn.Parameter(torch.zeros(num_experts, width, intermediate))
        self.mxfp4 = False
        self.fp8 = False
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

    def use_fp8_storage(self) -> None:
        """Switch to E4M3 codes with per-output-channel float32 scales (before the weights are loaded)."""
        for which in ("w13", "w2"):
            w = getattr(self, which)
            setattr(self, which, nn.Parameter(torch.zeros(w.shape, dtype=FP8, device=w.device), requires_grad=False))
            self.register_buffer(f"{which}_scale", torch.zeros(w.shape[:2], dtype=torch.float32, device=w.device),
                                 persistent=False)
        self.fp8 = True

    @torch.no_grad()
    def to_fp8(self) -> None:
        """Quantise dense experts already placed into FP8 storage, expert by expert (what ``use_fp8_storage``
        before the load gives; for models built or loaded without it)."""
        if self.mxfp4 or self.fp8:
            raise ValueError("to_fp8 takes dense experts (these are MXFP4 or already FP8)")
        dense = {which: getattr(self, which).data for which in ("w13", "w2")}
        self.use_fp8_storage()
        for which, w in dense.items():
            for j in range(w.shape[0]):
                codes, scale = quantize_weight(w[j], block=None)
                getattr(self, which).data[j].copy_(codes)
                getattr(self, f"{which}_scale")[j].copy_(scale.view(-1))

    def packed(self, which: str) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, which), getattr(self, f"{which}_scale")

    def slot_tensors(self) -> list[torch.Tensor]:
        """Every tensor with one row per local slot (what an expert move copies): w13, w2 and, packed (MXFP4) or
        FP8, their scales; FP8 codes as bytes (views: every process-group backend sends bytes)."""
        out = [self.w13.data, self.w2.data]
        if self.fp8:
            out = [t.view(torch.uint8) for t in out]
        return out + [self.w13_scale, self.w2_scale] if (self.mxfp4 or self.fp8) else out

    def holds(self, expert: int) -> bool:
        return expert in self.slot_experts

    def set_slots(self, slot_experts: list[int]) -> None:
        """EPLB: the logical expert of each local slot (``first_expert`` is then the first slot's id); before
        the weights are loaded."""
        if len(slot_experts) != self.w1.shape[0]:
            raise ValueError(f"{len(slot_experts)} slot experts for {self.w1.shape[0]} local slots")
        self.slot_experts = list(slot_experts)

    def _slots_of(self, expert: int) -> list[int]:
        return [j for j, x in enumerate(self.slot_experts) if x == expert]

    def _check(self, expert: int, which: str, shape: tuple, name: str) -> None:
        if not self.holds(expert):
            raise ValueError(f"{name}: expert {expert} out of range (this module holds experts "
                             f"{sorted(set(self.slot_experts))})")
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
        if self.fp8:
            codes, scale = quantize_weight(tensor, block=None)
            for j in self._slots_of(expert):
                getattr(self, which).data[j].copy_(codes)
                getattr(self, f"{which}_scale")[j].copy_(scale.view(-1))
            return
        for j in self._slots_of(expert):
            getattr(self, which).data[j].copy_(tensor)

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
        for j in self._slots_of(expert):
            getattr(self, which).data[j].copy_(packed)
            getattr(self, f"{which}_scale")[j].copy_(scale)


@dataclass(frozen=True)
class MoEConfig:
    """What one MoE block needs of the text config (spec text-backbone §1.2, §3)."""

    hidden_size: int                 # D
    num_experts: int                 # E
    top_k: int                       # num_experts_per_token
    intermediate_size: int           # I_e, one expert's intermediate (and a shared expert's)
    num_shared_experts: int          # 0: no shared experts
    latent_size: int | None          # routed_expert_hidden_size: None -> plain variant (experts on D)
    latent_norm: bool                # latent_moe_use_norm (latent variant only)
    rms_norm_eps: float
    router_activation: str           # "sigmoid" or "softmax"
    num_expert_group: int
    topk_group: int
    renormalize: bool
    routed_scaling_factor: float
    router_renorm_eps: float
    combine_fp32: bool               # numerics D6: fp32 sum of the weighted expert outputs

    @classmethod
    def from_text(cls, cfg: TextConfig) -> MoEConfig:
        if cfg.num_experts is None:
            raise ValueError("MoEConfig.from_text: the text config has no experts (num_experts is None)")
        return cls(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size,
                   cfg.num_shared_experts, cfg.routed_expert_hidden_size, cfg.latent_moe_use_norm, cfg.rms_norm_eps,
                   cfg.moe_router_activation_func, cfg.num_expert_group, cfg.topk_group, cfg.moe_renormalize,
                   cfg.routed_scaling_factor, cfg.numerics.router_renorm_eps, cfg.numerics.moe_combine_fp32)

    @property
    def variant(self) -> str:
        return "plain" if self.latent_size is None else "latent"


def build_moe(cfg: TextConfig, act: GLUActivation, parallel: ParallelContext | None = None) -> MoE:
    """The MoE block of a text config: ``LatentMoE`` when it names a latent width, else ``MoE``."""
    moe = MoEConfig.from_text(cfg)
    return (MoE if moe.variant == "plain" else LatentMoE)(moe, act, parallel)


class MoE(nn.Module):
    """The plain variant: routed experts on x, y = u + y_shared (spec text-backbone §3). ``LatentMoE``
    changes ``to_latent`` (the routed experts' input) and ``from_latent`` (their sum -> the routed
    output) and the parallel ``reduce``; the rest is shared."""

    def __init__(self, cfg: MoEConfig, act: GLUActivation, parallel: ParallelContext | None = None):
        super().__init__()
        self.par = par = parallel or ParallelContext()
        self.cfg, self.act = cfg, act
        first, num_local, inter = 0, cfg.num_experts, cfg.intermediate_size
        self.num_slots = cfg.num_experts + par.num_redundant_experts         # EPLB: physical slots
        if par.enabled:
            first, num_local = par.split(self.num_slots, "routed expert slots", par.ep_size, par.ep_rank)
            _, inter = par.split(inter, "expert intermediate size", par.expert_tp_size, par.expert_tp_rank)
        self.gate = Router(cfg.hidden_size, cfg.num_experts, with_bias=True)
        self.experts = Experts(num_local, cfg.latent_size or cfg.hidden_size, inter, first,
                               (par.expert_tp_rank, par.expert_tp_size))
        self.shared_experts: MLP | None = None
        if cfg.num_shared_experts:
            # token-sharded modes run the shared experts on the rank's own tokens: replicated weights
            self.shared_experts = MLP(cfg.hidden_size, cfg.intermediate_size * cfg.num_shared_experts, act,
                                      None if par.tokens_sharded else par, reduce=False)
        self.exchange: ExpertExchange | None = make_exchange(par)     # token-sharded modes only
        self.side_stream: torch.cuda.Stream | None = None      # set by KimiForCausalLM.use_side_stream
        self.offload: LayerOffload | None = None                # set by ExpertOffload (expert_offload.py)
        # expert parallelism: this rank's share of the pairs in fixed shapes (``local_pairs``), no host
        # synchronisation; on inside ``fixed_shape_experts`` (the functions CUDA graphs capture)
        self.fixed_shapes = False
        # EPLB (``set_placement`` once loaded): logical -> physical routing and the logical experts' loads
        self.placement: Placement | None = None
        self.expert_load: torch.Tensor | None = None         # [E] tokens routed to each logical expert
        self.slot_load: torch.Tensor | None = None           # [E + R] tokens each physical slot ran

    def set_placement(self, slots: list[int]) -> None:
        """EPLB: the logical expert of every physical slot (all ranks'); this rank's slots take theirs. Resets
        the recorded loads. Call before loading the weights (or reload them after)."""
        par = self.par
        first, n = par.split(self.num_slots, "routed expert slots", par.ep_size, par.ep_rank)
        self.experts.set_slots(slots[first:first + n])
        device = self.gate.weight.device
        self.placement = Placement.build(slots, self.cfg.num_experts, device)
        self.expert_load = torch.zeros(self.cfg.num_experts, dtype=torch.int64, device=device)
        self.slot_load = torch.zeros(self.num_slots, dtype=torch.int64, device=device)

    def move_experts(self, slots: list[int]) -> bool:
        """EPLB, live: take placement ``slots`` (all ranks' slots), on every rank of the TP group at once, between
        two steps: the experts a rank lacks come from a rank that holds them (point-to-point, ``eplb.plan_moves``),
        the rest are copied within it; the weights and routing tables change in place (CUDA graphs stay valid) and
        the recorded loads start again. Returns whether the MXFP4 kernels' scale range changed (a decode graph
        captured before must not be replayed)."""
        par, e = self.par, self.experts
        per = self.num_slots // par.ep_size
        tensors = e.slot_tensors()
        new = [t.clone() for t in tensors]
        pending = []
        for tag, m in enumerate(plan_moves(self.placement.slots, slots, par.ep_size)):
            if m.src_rank == m.dst_rank == par.ep_rank:
                for t, n in zip(tensors, new):
                    n[m.dst].copy_(t[m.src])
            elif m.src_rank == par.ep_rank:
                pending += par.send_to_ep_rank([t[m.src] for t in tensors], m.dst_rank, tag)
            elif m.dst_rank == par.ep_rank:
                pending += par.recv_from_ep_rank([n[m.dst] for n in new], m.src_rank, tag)
        for work in pending:
            work.wait()
        for t, n in zip(tensors, new):
            t.copy_(n)
        e.set_slots(slots[par.ep_rank * per:(par.ep_rank + 1) * per])
        flipped = False
        if e.mxfp4 and e.scale_max is not None:
            top = max(int(e.w13_scale.max()), int(e.w2_scale.max()))
            flipped, e.scale_max = (top > 128) != (e.scale_max > 128), top
        self.placement.update(slots)
        self.expert_load.zero_()
        self.slot_load.zero_()
        return flipped

    # ---- the variant's parts (the plain variant's: identity, sum, one all-reduce) ---------------
    def to_latent(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' input: x itself."""
        return x

    def from_latent(self, u: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
        """Complete routed sum u and shared output s -> the layer output y = u + s (§3.7)."""
        return u if s is None else u + s

    def reduce(self, u: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
        """This rank's partials u and s (tokens replicated) -> the replicated layer output: linear in
        both, so sum first and reduce once."""
        return self.par.all_reduce(u if s is None else u + s)

    def output_parts(self, u: torch.Tensor, s: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One process: (routed, shared) apart, so the residual stream adds both in the norm that reads them."""
        return u, s

    # ---- forward --------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, s = self.forward_parts(x)
        return y if s is None else y + s

    def forward_parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's output as (routed, shared) when it is their plain sum (one process, plain
        variant: Kimi-Linear), so the residual stream adds both in the norm that reads them
        (``ResidualStream.add``); else (output, None)."""
        if self.exchange is not None:
            return self.exchange.forward(self, x), None
        # Small batches leave the GPU half idle in each GEMV, so with a side stream two run at once:
        # the router (GEMM + top-k) beside the routed down-projection, then the shared experts
        # beside the routed experts. Same kernels and results as one stream. Memory: ``side``
        # starts after everything queued so far (x is ready) and the main stream waits for it
        # before using its outputs and before returning, so no block the caching allocator hands
        # out here is reused while the other stream may still read it.
        # (batches up to ``KernelTuning.side_stream_max_tokens`` tokens, when the model was given a side stream)
        side = self.side_stream if x.shape[0] <= tuning().side_stream_max_tokens else None
        on_side = (lambda: torch.cuda.stream(side)) if side is not None else contextlib.nullcontext
        if side is not None:
            main = torch.cuda.current_stream()
            side.wait_stream(main)
        with on_side():
            weights, ids = self.route(x)
            if self.offload is not None:     # copy in the routed experts the GPU does not cache
                self.offload.stage(ids)
        z = self.to_latent(x)
        if side is not None:
            main.wait_stream(side)
        with on_side():
            s = self.shared(x)
        u = self.local_experts(z, weights, ids)
        if self.offload is not None:        # prefetch the next MoE layer's experts beside what follows
            self.offload.after_experts(x)
        if side is not None:
            main.wait_stream(side)
        if self.par.enabled:
            return self.reduce(u, s), None
        return self.output_parts(u, s)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> fp32 weights and expert ids [T, k] (§3.1-3.4; logits of both operands upcast); under
        EPLB the ids are physical slots (``eplb.Placement``)."""
        c = self.cfg
        weights, ids = route_tokens(x, self.gate.weight, self.gate.e_score_correction_bias, c.top_k,
                                    c.router_activation, c.num_expert_group, c.topk_group, c.renormalize,
                                    c.routed_scaling_factor, c.router_renorm_eps)
        if self.placement is None:
            return weights, ids
        # EPLB: count the logical experts' tokens (a graph's padding rows too), then route to physical slots
        self.expert_load.index_add_(0, ids.reshape(-1), torch.ones_like(ids.reshape(-1)))
        slots = self.placement.physical(ids)
        self.slot_load.index_add_(0, slots.reshape(-1), torch.ones_like(slots.reshape(-1)))
        return weights, slots

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """y_shared (§3.6; this rank's partial under TP), None without shared experts."""
        return None if self.shared_experts is None else self.shared_experts(x)

    def run_experts(self, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """z [T, L], weights/ids [T, k] (local expert ids) -> weighted sum [T, L] in z's dtype."""
        e, a = self.experts, self.act
        if z.shape[0] == 0:
            return z.new_zeros(z.shape)
        if self.offload is not None and self.offload.on_host:     # the host computes the uncached experts
            return self.offload.run_host(z, weights, ids)
        if self.offload is not None:         # the pool of cached and staged experts, rows by ``slots``
            w1, w2, w3, slots = self.offload.weights()
            if e.fp8:
                return fused_moe_fp8(z, w1, w2, w3, weights, ids, a.hidden_act, a.beta, a.linear_beta,
                                     self.cfg.combine_fp32, slots=slots)
            if e.mxfp4:
                return fused_moe_mxfp4(z, w1, w2, w3, weights, ids, a.hidden_act, a.beta, a.linear_beta,
                                       self.cfg.combine_fp32, e.scale_max, slots=slots)
            return fused_moe(z, w1, w2, w3, weights, ids, a.hidden_act, a.beta, a.linear_beta, self.cfg.combine_fp32,
                             slots=slots)
        if e.fp8:
            return fused_moe_fp8(z, e.packed("w1"), e.packed("w2"), e.packed("w3"), weights, ids, a.hidden_act,
                                 a.beta, a.linear_beta, self.cfg.combine_fp32)
        if e.mxfp4:
            return fused_moe_mxfp4(z, e.packed("w1"), e.packed("w2"), e.packed("w3"), weights, ids, a.hidden_act,
                                   a.beta, a.linear_beta, self.cfg.combine_fp32, e.scale_max)
        return fused_moe(z, e.w1, e.w2, e.w3, weights, ids, a.hidden_act, a.beta, a.linear_beta,
                         self.cfg.combine_fp32)

    def local_experts(self, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of the routed sum over all tokens ([T, L]; the whole sum in one process).
        Under EP only (token, slot) pairs routed to local experts run, one row per pair (their count comes to the
        host); with ``fixed_shapes`` (a CUDA graph's capture) every pair runs, other ranks' at weight 0
        (``local_pairs``)."""
        if self.par.ep_size == 1:
            return self.run_experts(z, weights, ids)
        if self.fixed_shapes and ids.numel():
            return self.run_experts(z, *self.local_pairs(weights, ids))
        local = ids - self.experts.first_expert
        tok, slot = ((local >= 0) & (local < self.experts.w1.shape[0])).nonzero(as_tuple=True)
        out = self.run_experts(z[tok], weights[tok, slot].unsqueeze(-1), local[tok, slot].unsqueeze(-1))
        return self.combine(z.shape[0], tok, out)

    def local_pairs(self, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert parallelism in fixed shapes: (weights, local expert ids) [T, k] of every (token, slot) pair, a pair
        routed to another rank's expert at weight 0 and pointed at a local expert the step reads anyway (its token's
        smallest local one, else the step's smallest; local 0 where no pair is local), so its row adds exactly 0
        and no other expert's weights are read. Device ops only: a CUDA graph captures them (the kernels then run T k
        rows, not the ~T k / e local ones: cheap at decode sizes, where reading the experts' weights dominates). The
        kernels' rows-per-expert choices (tiles; FP8 activations, W4A8: ``KernelTuning``) then see e times the local
        pairs' average: a draft's steps (<= 32 heads) stay below the thresholds that change values (K3 at EP16: 9
        rows an expert against 32 / 48), a large decode batch may cross one that its eager step would not."""
        n = self.experts.w1.shape[0]
        local = ids - self.experts.first_expert
        mine = (local >= 0) & (local < n)
        masked = torch.where(mine, local, n)
        own = masked.amin(dim=1, keepdim=True)                      # n: the token has no local expert
        fill = torch.where(own < n, own, masked.amin() % n)          # the step's smallest (no local pair: 0)
        return weights.masked_fill(~mine, 0.0), torch.where(mine, local, fill)

    def combine(self, num_tokens: int, tok: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Sum per-pair expert rows [n, L] into their tokens -> [num_tokens, L] (fp32 sum if official)."""
        acc = acc_dtype(rows.dtype) if self.cfg.combine_fp32 else rows.dtype
        u = torch.zeros(num_tokens, rows.shape[-1], dtype=acc, device=rows.device)
        return u.index_add_(0, tok, rows.to(acc)).to(rows.dtype)


def moe_blocks(module: nn.Module) -> list[MoE]:
    """Every MoE block inside ``module`` (a model, an MTP draft)."""
    return [m for m in module.modules() if isinstance(m, MoE)]


@contextlib.contextmanager
def fixed_shape_experts(moes: list[MoE]):
    """Inside, the blocks ``moes`` (``moe_blocks``) run their expert-parallel share in fixed shapes
    (``MoE.local_pairs``: no host synchronisation, which a CUDA graph's capture forbids); as before after. The
    graphs wrap what they capture in it (``cuda_graphs.DecodeGraphs.step``, ``draft_graphs.DraftGraphs``), so a
    warm-up, the capture and a CPU test's eager stand-in of a replay all run the captured path."""
    before = [m.fixed_shapes for m in moes]
    for m in moes:
        m.fixed_shapes = True
    try:
        yield
    finally:
        for m, was in zip(moes, before):
            m.fixed_shapes = was


class LatentMoE(MoE):
    """The latent variant (K3, spec text-backbone §3.5): z = x W_down^T [T, L]; the routed experts
    act on z; y_routed = RMSNorm(u) W_up^T (the norm when ``latent_norm``); y = y_routed + y_shared."""

    def __init__(self, cfg: MoEConfig, act: GLUActivation, parallel: ParallelContext | None = None):
        super().__init__(cfg, act, parallel)
        D, L, par = cfg.hidden_size, cfg.latent_size, self.par
        self.routed_expert_down_proj = linear(D, L)
        self.routed_expert_up_proj = linear(L, D)
        self.routed_expert_norm = RMSNorm(L, cfg.rms_norm_eps) if cfg.latent_norm else None
        self.can_slice_up = par.enabled and D % par.tp_size == 0

    def to_latent(self, x: torch.Tensor) -> torch.Tensor:
        return self.routed_expert_down_proj(x)

    def norm(self, u: torch.Tensor) -> torch.Tensor:
        return u if self.routed_expert_norm is None else self.routed_expert_norm(u)

    def from_latent(self, u: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
        y = self.routed_expert_up_proj(self.norm(u))
        return y if s is None else y + s

    def output_parts(self, u: torch.Tensor, s: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.from_latent(u, s), None

    def reduce(self, u: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
        """Partials u [T, L] and s [T, D] of this rank -> the replicated layer output [T, D]. The norm
        is not linear: the latent sum is complete (reduced) before it (§3.7)."""
        par = self.par
        if s is None:
            return self.from_latent(par.all_reduce(u), None)
        w_up = self.routed_expert_up_proj.weight                  # [D, L], replicated
        if self.can_slice_up and par.use_sliced_tail(u.shape[0]):
            # (b): rank r adds rows R_r of the up-projection into its own shared partial's columns
            # R_r; the reduce of s then sums the shared partials and stitches the routed slices.
            n = self.norm(par.all_reduce(u))
            lo, width = par.split(w_up.shape[0], "hidden size")
            s[:, lo:lo + width] = torch.addmm(s[:, lo:lo + width], n, w_up[lo:lo + width].t())
            return par.all_reduce(s)
        # (a): one all-reduce over [latent | shared], then the full up-projection onto the shared sum
        L = u.shape[-1]
        buf = par.all_reduce(torch.cat([u, s], dim=-1))
        return torch.addmm(buf[:, L:], self.norm(buf[:, :L]), w_up.t())
