"""Bytes per GPU under tensor (t) and expert (e) parallelism (spec parallelism.md §6), and the deployment
planner of ``kimik3 inspect``: what a layout keeps on its GPUs, what it offloads to host memory, how many
sequences its cache holds and what decode rate the bytes predict.

Each parameter is classified by how it scales: split across the TP ranks (heads, columns or rows,
vocab), split across the EP ranks (routed experts; across TP ranks when e = 1), or replicated
(latent MoE projections, router, MLA down-projections, KDA f_a / o_norm, norms, AttnRes vectors).
Stored bytes follow the release dtypes (MXFP4 experts, F32 conv/A_log/dt_bias/o_norm/router bias).

Options the engine takes change the bytes:

* ``--quantization fp8``: every projection weight (``*_proj``, the dense and shared MLPs; bf16 routed
  experts too, as Kimi-Linear's, offloaded or not) becomes 1 byte an
  element plus one float32 scale per output channel (``kimik3.loader.fp8``); the embedding, LM head, router,
  norms, convolutions and the vision tower stay as stored, and K3's MXFP4 experts stay MXFP4.
* ``--kv-cache-dtype fp8`` (``fp8_e4m3``): MLA latent rows in e4m3, 1 byte an element plus one float32
  scale per token row (``kimik3.ops.fp8``); KDA states stay float32 (conv windows in the model dtype).
* ``--cpu-offload-gb G`` (per GPU, vLLM's meaning): G GiB of each GPU's routed experts (those it holds: E / e
  whole experts a layer under expert parallelism, slices of all E under tensor parallelism), rounded up to whole
  experts a layer as the engine does, live in pinned host memory; each MoE layer keeps the rest as a cache of hot experts in fixed GPU slots, plus one staging area
  (one layer's offloaded experts) the layers share, and a decode step serves the experts it routes to but
  misses by the miss policy (``--expert-offload-policy``, ``kimik3.model.offload_policy``): copied over PCIe
  after routing, or prefetched while the previous layer runs (host compute is shown beside, eager steps only).

The decode estimate (``predict_decode``) is a byte count over stated rates (``Rates``, printed with every
answer; a GPU's measured rates replace them): a step (a CUDA graph) reads the weights it touches and its cache
from HBM, pays a fixed time per layer, and serves its missed experts with the strategy the engine's policy
picks for its batch size from the same costs (``offload_policy.miss_costs``: copies over PCIe after routing,
or prefetched with an assumed prediction accuracy, overlapping one layer's GPU time). Routing is taken as
uniform (each of a layer's E experts equally likely): a batch of B tokens then touches E (1 - (1 - k/E)^B)
distinct experts a layer, and a cache of S of a layer's E experts serves S/E of them. Skewed (real) routing
with the hot-expert cache misses less, so the offloaded figures are a floor.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kimik3.config import ModelConfig, load_config
from kimik3.inspect import SINGLE_GPUS, meta_model, stored_bytes
from kimik3.model.batch import KV_CACHE_DTYPES, HybridCache, latent_cache_dtype
from kimik3.model.offload_policy import LayerShape, MissPolicy, MissRates, miss_costs

H200_BYTES = SINGLE_GPUS["H200"]        # 140.4 GiB per GPU, as nvidia-smi reports
MEMORY_FRACTION = 0.92                  # u: share of GPU memory the engine may take
OVERHEAD_BYTES = 6 << 30                # O: CUDA context, NCCL buffers, activations, graphs (assumed)
GIB = 1 << 30

_REPLICATED = re.compile(
    r"routed_expert_(down_proj|up_proj|norm)|\.gate\.(weight|e_score_correction_bias)$|"
    r"self_attn\.(q_a_proj|kv_a_proj_with_mqa|q_a_layernorm|kv_a_layernorm|f_a_proj|o_norm)\.|"
    r"layernorm\.weight$|_res_(norm|proj)\.|^model\.norm\.|^vision\.")
# weights ``--quantization fp8`` stores in e4m3 (with one float32 scale per output channel): the projections
_FP8_WEIGHT = re.compile(r"^model\.layers\.\d+\..*(?<!_res)_proj(_with_mqa)?\.weight$")
QUANTIZATIONS = (None, "fp8")


@dataclass(frozen=True)
class GPU:
    name: str
    memory: int             # bytes, as nvidia-smi reports
    hbm_rate: float         # bytes/s a streaming read reaches (the copy rate our benchmarks measure)


GPUS = {"H200": GPU("H200", SINGLE_GPUS["H200"], 4.25e12),       # bench_slice.py copy rate, H200
        "H100": GPU("H100", SINGLE_GPUS["H100"], 3.0e12)}        # bench_slice.py copy rate, H100


@dataclass(frozen=True)
class Rates:
    """The rates the decode estimate assumes (printed with it); measured ones replace them."""
    pcie: float = 50e9                # pinned host -> GPU copy, per GPU (PCIe 5.0 x16: 64 GB/s raw)
    host_memory: float = 400e9        # host DRAM read rate of the whole node (two sockets)
    host_flops: float = 4e12          # host matmul rate of the whole node, for experts computed on the CPU
    layer_overhead: float = 10e-6     # fixed seconds a layer of a decode step (launch gaps, TP all-reduces)
    context: int = 4096               # history tokens of each sequence in a decode step
    host_sync: float = 50e-6          # a layer's round trip to the host, when the host computes misses
    prefetch_accuracy: float = 0.5    # share of a layer's misses a prefetch predicts

    def __post_init__(self) -> None:
        for name, flag in (("pcie", "--pcie-gbps"), ("host_memory", "--host-memory-gbps"), ("host_flops", "--host-tflops")):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{flag} must be a positive rate, got {v!r}")
        if not 0.0 <= self.prefetch_accuracy <= 1.0:
            raise ValueError(f"--prefetch-accuracy must lie in [0, 1], got {self.prefetch_accuracy!r}")

    def describe(self) -> str:
        return (f"assumed rates: PCIe {self.pcie / 1e9:.0f} GB/s per GPU (pinned copy), host memory "
                f"{self.host_memory / 1e9:.0f} GB/s and host matmul {self.host_flops / 1e12:.0f} TFLOP/s per node, "
                f"{self.layer_overhead * 1e6:.0f} us fixed per layer, {self.context} history tokens per sequence, "
                f"prefetch accuracy {self.prefetch_accuracy:.0%}, host round trip {self.host_sync * 1e6:.0f} us a layer")


@dataclass(frozen=True)
class Sizing:
    tp: int
    ep: int
    weights_sharded: int      # bytes split over the TP ranks
    weights_experts: int      # routed experts, split over e (or t)
    weights_replicated: int
    kv_bytes_per_token: int   # MLA latent, per GPU (TP replicates it)
    state_bytes_per_seq: int  # KDA conv + recurrent state, per GPU
    gpu: GPU = GPUS["H200"]
    offload_bytes: int = 0    # routed-expert bytes per GPU kept in host memory (--cpu-offload-gb)
    embedding_bytes: int = 0  # of weights_sharded: the embedding table (a decode step reads B of its rows)
    vision_bytes: int = 0     # of weights_replicated: the vision tower (a decode step reads none of it)
    moe_layers: int = 0
    num_experts: int = 0      # routed experts a MoE layer (E)
    expert_replicated: int = 0  # of weights_experts: FP8 w2 channel scales, whole on every rank sharing an expert

    @property
    def expert_ranks(self) -> int:
        """GPUs the routed experts are split over: e ranks each hold E / e experts, and with t > e each expert's
        intermediate is split over the t / e ranks sharing it (the engine's ``ParallelContext.expert_tp_size``)."""
        return max(self.ep, self.tp)

    @property
    def local_experts(self) -> int:
        """Experts a MoE layer holds on one GPU: E / e under expert parallelism, else all E (as slices)."""
        return self.num_experts // self.ep if self.ep > 1 else self.num_experts

    @property
    def experts_per_gpu(self) -> float:
        """Routed-expert bytes on one GPU: its share, and whole the FP8 w2 channel scales of its experts."""
        split = self.weights_experts - self.expert_replicated
        return split / self.expert_ranks + self.expert_replicated / max(1, self.ep)

    @property
    def weights_per_gpu(self) -> float:
        """Every weight byte of one GPU's share, offloaded experts included."""
        return self.weights_sharded / self.tp + self.experts_per_gpu + self.weights_replicated

    @property
    def expert_share(self) -> float:
        """One routed expert's bytes on one GPU (its slice under tensor parallelism; whole under EP = TP)."""
        return self.experts_per_gpu / (self.moe_layers * self.local_experts) if self.moe_layers * self.num_experts else 0.0

    @property
    def uncached_per_layer(self) -> int:
        """M: experts a MoE layer leaves in host memory on each GPU (the engine's rounding: the budget up to whole
        experts of those the GPU holds, ``ExpertOffload``)."""
        if not self.offload_bytes:
            return 0
        return min(self.local_experts, math.ceil(self.offload_bytes / (self.moe_layers * self.expert_share) - 1e-9))

    @property
    def offloaded_bytes(self) -> float:
        """Routed-expert bytes each GPU keeps in host memory: M experts a layer (the budget rounded up)."""
        return self.moe_layers * self.uncached_per_layer * self.expert_share

    @property
    def staging_bytes(self) -> float:
        """The GPU's staging area for the uncached experts: M experts, shared by the MoE layers."""
        return self.uncached_per_layer * self.expert_share

    @property
    def resident_per_gpu(self) -> float:
        return self.weights_per_gpu - self.offloaded_bytes + self.staging_bytes

    @property
    def resident_expert_fraction(self) -> float:
        """The share of a layer's experts the GPU caches (1 - M / its E / e)."""
        return 1.0 - self.uncached_per_layer / self.local_experts if self.num_experts else 1.0

    @property
    def cache_budget(self) -> float:
        """B = u * GPU memory - resident weights - overhead (negative: does not fit)."""
        return MEMORY_FRACTION * self.gpu.memory - self.resident_per_gpu - OVERHEAD_BYTES

    @property
    def fits(self) -> bool:
        return self.cache_budget > 0

    def sequences(self, context: int) -> int:
        per_seq = context * self.kv_bytes_per_token + self.state_bytes_per_seq
        return max(0, int(self.cache_budget // per_seq))


def check_degrees(config: ModelConfig, tp: int, ep: int) -> None:
    t = config.text
    heads = {"KDA heads": t.kda.num_heads, "MLA heads": t.num_attention_heads}
    for what, n in heads.items():
        if n % tp:
            raise ValueError(f"--tensor-parallel-size {tp} must divide the {what} ({n})")
    if t.num_experts and ep > 1 and t.num_experts % ep:
        raise ValueError(f"--expert-parallel-size {ep} must divide num_experts ({t.num_experts})")
    if ep > 1 and ep % tp and tp % ep:
        raise ValueError(f"expert parallel size {ep} and tensor parallel size {tp} must nest (one divides the other)")


def fp8_bytes(shape: tuple[int, ...]) -> int:
    """One e4m3 byte an element plus a float32 scale per output channel (row) of the last two dims [N, K]."""
    *lead, n, k = shape
    return math.prod(lead) * (n * k + 4 * n)


def latent_bytes_per_token(text_config, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """MLA latent bytes of one token over every MLA layer: the model dtype (auto), or e4m3 with one
    float32 scale per row (fp8, fp8_e4m3)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return HybridCache.bytes_per_block(text_config, 1, dtype, latent_cache_dtype(kv_cache_dtype, dtype))


def compute_sizing(config: ModelConfig, tp: int, ep: int, dtype: torch.dtype = torch.bfloat16, *,
                   gpu: str = "H200", cpu_offload_gb: float = 0, kv_cache_dtype: str = "auto",
                   quantization: str | None = None) -> Sizing:
    check_degrees(config, tp, ep)
    if gpu not in GPUS:
        raise ValueError(f"--gpu must be one of {list(GPUS)}, got {gpu!r}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization must be fp8 or left out, got {quantization!r}")
    sharded, experts, replicated, embedding, vision, w2_scales = weight_bytes(config, quantization)
    t = config.text
    ranks = max(ep, tp)
    offload = check_offload(cpu_offload_gb, experts / ranks)
    return Sizing(tp, ep, sharded, experts, replicated,
                  kv_bytes_per_token=latent_bytes_per_token(t, dtype, kv_cache_dtype),
                  state_bytes_per_seq=HybridCache.bytes_per_slot(t, dtype) // tp,
                  gpu=GPUS[gpu], offload_bytes=offload, embedding_bytes=embedding, vision_bytes=vision,
                  moe_layers=sum(t.is_moe_layer(i) for i in range(t.num_hidden_layers)), num_experts=t.num_experts or 0,
                  expert_replicated=w2_scales)


@functools.lru_cache(maxsize=8)
def weight_bytes(config: ModelConfig, quantization: str | None) -> tuple[int, int, int, int, int, int]:
    """(TP-split, routed-expert, replicated, embedding, vision, FP8 expert w2 scales) stored bytes of the whole
    model (the embedding is also counted in the TP-split bytes, the vision tower in the replicated ones, the w2
    scales in the routed experts'); under ``quantization`` fp8 bf16 routed experts are FP8 too, offloaded or not:
    a down-projection's channel scales are not split with its intermediate (each rank sharing an expert holds
    them whole). Cached: K3 has 250k checkpoint tensors, a few seconds to walk."""
    mxfp4 = config.text.expert_quantization == "mxfp4"
    sharded = experts = replicated = embedding = vision = w2_scales = 0
    for name, p in meta_model(config).checkpoint_weights():
        _, nbytes = stored_bytes(name, p.numel(), mxfp4)
        expert = ".experts." in name
        if quantization == "fp8" and ((expert and not mxfp4) or (not expert and _FP8_WEIGHT.search(name))):
            nbytes = fp8_bytes(tuple(p.shape))
            w2_scales += 4 * p.shape[0] if expert and name.endswith(".w2.weight") else 0
        if expert:
            experts += nbytes
        elif _REPLICATED.search(name):
            replicated += nbytes
            vision += nbytes if name.startswith("vision.") else 0
        else:
            sharded += nbytes
            embedding += nbytes if "embed_tokens" in name else 0
    return sharded, experts, replicated, embedding, vision, w2_scales


def check_offload(cpu_offload_gb: float, experts_per_gpu: float) -> int:
    """``--cpu-offload-gb`` in bytes, or ValueError naming the valid range (0 .. the GPU's expert bytes)."""
    if isinstance(cpu_offload_gb, bool) or not isinstance(cpu_offload_gb, (int, float)) or not math.isfinite(cpu_offload_gb):
        raise ValueError(f"--cpu-offload-gb must be a number of GiB, got {cpu_offload_gb!r}")
    if cpu_offload_gb < 0:
        raise ValueError(f"--cpu-offload-gb must be >= 0 (GiB of routed experts per GPU kept in host memory), "
                         f"got {cpu_offload_gb}")
    offload = int(cpu_offload_gb * GIB)
    if offload > experts_per_gpu:
        raise ValueError(f"--cpu-offload-gb {cpu_offload_gb} is more than the {experts_per_gpu / GIB:.1f} GiB of "
                         f"routed experts each GPU holds; give at most that")
    return offload


# ---- the decode estimate -------------------------------------------------------------------------------
def distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts a batch of ``tokens`` routes to in one layer, routing uniform."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens) if num_experts else 0.0


@dataclass(frozen=True)
class DecodeEstimate:
    batch: int
    gpu_seconds: float          # HBM reads + fixed per-layer time
    copy_seconds: float         # missed experts copied over PCIe after routing
    prefetch_seconds: float     # ... prefetched (the part a layer's GPU time does not hide, and the mispredicted)
    host_seconds: float         # the same misses computed on the host instead (eager steps only)
    missed_bytes: float         # per GPU per step
    strategy: str = "none"      # how the policy serves the misses in a decode graph ("none": no misses)

    @property
    def miss_seconds(self) -> float:
        return {"copy": self.copy_seconds, "prefetch": self.prefetch_seconds, "host": self.host_seconds}.get(
            self.strategy, 0.0)

    @property
    def step_seconds(self) -> float:
        return self.gpu_seconds + self.miss_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.batch / self.step_seconds


def predict_decode(config: ModelConfig, s: Sizing, batch: int, rates: Rates = Rates(),
                   policy: str = "auto") -> DecodeEstimate:
    """One decode step of ``batch`` sequences (``rates.context`` tokens of history each) on every GPU at once,
    as a CUDA graph; its misses served as the engine's ``policy`` picks for the batch size."""
    t = config.text
    n, E, k = s.moe_layers, s.num_experts, t.num_experts_per_token
    per, M = s.expert_share, s.uncached_per_layer
    touched = distinct_experts(E, k, batch) * n * s.local_experts / E if E else 0.0      # of this GPU's, a step reads
    other = (s.weights_sharded - s.embedding_bytes) / s.tp + s.weights_replicated - s.vision_bytes   # dense weights read
    cache = batch * (rates.context * s.kv_bytes_per_token + s.state_bytes_per_seq)
    gpu_bytes = other + touched * s.resident_expert_fraction * per + cache
    gpu_seconds = gpu_bytes / s.gpu.hbm_rate + t.num_hidden_layers * rates.layer_overhead
    missed = touched * (1.0 - s.resident_expert_fraction) * per
    if not M:
        return DecodeEstimate(batch, gpu_seconds, 0.0, 0.0, 0.0, 0.0)
    gpus = s.tp * max(1, s.ep // s.tp)
    # every GPU copies (and its host share computes) at once: the node's host rates split over the GPUs
    miss_rates = MissRates(copy=min(rates.pcie, rates.host_memory / gpus), host_bytes=rates.host_memory / gpus,
                           host_flops=rates.host_flops / gpus, host_sync=rates.host_sync,
                           layer_seconds=gpu_seconds / t.num_hidden_layers, prefetch_accuracy=rates.prefetch_accuracy)
    width = t.routed_expert_hidden_size or t.hidden_size
    shape = LayerShape(E, k, M, per, 6.0 * width * t.moe_intermediate_size / max(1, s.tp // s.ep))     # E: all of them
    costs = miss_costs(shape, miss_rates, batch)
    strategy = MissPolicy(policy, shape, miss_rates, host_exact=False).choose(batch, graph=True)
    return DecodeEstimate(batch, gpu_seconds, n * costs["copy"], n * costs["prefetch"], n * costs["host"], missed,
                          strategy)


# ---- the answer ----------------------------------------------------------------------------------------
CONTEXTS = (4096, 131072, 1 << 20)
BATCHES = (1, 8, 32)


@dataclass
class PlanOptions:
    tp: int = 1
    ep: int = 1
    gpu: str = "H200"
    cpu_offload_gb: float = 0
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    rates: Rates = field(default_factory=Rates)
    expert_offload_policy: str = "auto"


def min_offload_gb(s: Sizing, headroom: float) -> float:
    """The smallest --cpu-offload-gb that leaves ``headroom`` bytes of cache per GPU (inf: not enough experts)."""
    need = s.resident_per_gpu + s.offloaded_bytes - (MEMORY_FRACTION * s.gpu.memory - OVERHEAD_BYTES - headroom)
    if need <= 0:
        return 0.0
    return math.ceil(need / GIB) if need <= s.experts_per_gpu else math.inf


def format_sizing(path: str | Path, tp: int, ep: int, options: PlanOptions | None = None) -> str:
    o = options or PlanOptions(tp, ep)
    config = load_config(path)
    s = compute_sizing(config, tp, ep, gpu=o.gpu, cpu_offload_gb=o.cpu_offload_gb, kv_cache_dtype=o.kv_cache_dtype,
                       quantization=o.quantization)
    gpus = tp * max(1, ep // tp)
    layout = f"TP{tp}" + (f"/EP{ep}" if ep > 1 else "")
    fp8_what = "projections" if config.text.expert_quantization == "mxfp4" else "projections and routed experts"
    settings = (f"weights {f'fp8 ({fp8_what}) + ' if o.quantization else ''}as stored, kv cache "
                f"{o.kv_cache_dtype}, --cpu-offload-gb {o.cpu_offload_gb:g}")
    total = s.weights_sharded + s.weights_experts + s.weights_replicated
    lines = [f"layout {layout} on {gpus} x {s.gpu.name} ({s.gpu.memory / GIB:.1f} GiB each, {gpus * s.gpu.memory / GIB:,.1f} "
             f"GiB in all; the model's weights {total / GIB:,.1f} GiB; {settings}):",
             f"  weights per GPU: {s.weights_per_gpu / GIB:.1f} GiB (experts {s.experts_per_gpu / GIB:.1f}, "
             f"TP-split {s.weights_sharded / tp / GIB:.1f}, replicated {s.weights_replicated / GIB:.1f})"]
    if s.offload_bytes:
        M = s.uncached_per_layer
        E = s.local_experts
        cached = (E - M) * s.moe_layers * s.expert_share
        lines.append(f"  resident per GPU: {s.resident_per_gpu / GIB:.1f} GiB, of which routed experts "
                     f"{cached / GIB:.1f} GiB (the hot-expert cache: {E - M} of the {E} experts a layer it holds, "
                     f"{100 * s.resident_expert_fraction:.1f}%) and their staging area {s.staging_bytes / GIB:.2f} GiB "
                     f"({M} experts, shared by the layers); offloaded to pinned host memory "
                     f"{s.offloaded_bytes / GIB:.1f} GiB per GPU, {s.offloaded_bytes * gpus / GIB:.1f} GiB for the node")
    lines.append(f"  cache per GPU: MLA latent {s.kv_bytes_per_token:,} B/token, KDA state "
                 f"{s.state_bytes_per_seq / (1 << 20):.1f} MiB/sequence")
    if s.fits:
        lines.append(f"  fits: yes; cache budget {s.cache_budget / GIB:.1f} GiB (u = {MEMORY_FRACTION}, "
                     f"{OVERHEAD_BYTES / GIB:.0f} GiB overhead) -> sequences at 4K / 128K / 1M tokens: "
                     + " / ".join(str(s.sequences(n)) for n in CONTEXTS))
        lines.extend(format_decode(config, s, o.rates, o.expert_offload_policy))
    else:
        lines.append(f"  fits: no; {-s.cache_budget / GIB:.1f} GiB short per GPU before any cache")
    room = s.state_bytes_per_seq + CONTEXTS[1] * s.kv_bytes_per_token
    need = min_offload_gb(s, 8 * room)
    if need and math.isfinite(need) and not s.fits:
        lines.append(f"  fits with --cpu-offload-gb {need:g} or more (room for 8 sequences of 128K)")
    return "\n".join(lines)


def format_decode(config: ModelConfig, s: Sizing, rates: Rates, policy: str = "auto") -> list[str]:
    head = (f"  predicted decode (steps as CUDA graphs, uniform routing; {rates.describe()}; HBM "
            f"{s.gpu.hbm_rate / 1e12:.2f} TB/s")
    if s.offload_bytes:
        head += (f"; misses by --expert-offload-policy {policy}: "
                 + {"auto": "the cheaper of copy and prefetch per batch", "host": "the cheaper of copy and prefetch "
                    "in graphs (host compute: eager steps)"}.get(policy, policy))
    lines = [head + "):"]
    for b in BATCHES:
        d = predict_decode(config, s, b, rates, policy)
        miss = (f", misses {d.missed_bytes / GIB:.2f} GiB/GPU by {d.strategy} {1e3 * d.miss_seconds:.1f} ms "
                f"(copy {1e3 * d.copy_seconds:.1f}, prefetch {1e3 * d.prefetch_seconds:.1f}, host compute "
                f"{1e3 * d.host_seconds:.1f})" if d.missed_bytes else "")
        lines.append(f"    batch {b:>2}: {d.tokens_per_second:8.1f} tok/s (step {1e3 * d.step_seconds:.1f} ms: "
                     f"GPU {1e3 * d.gpu_seconds:.1f} ms{miss})")
    return lines
