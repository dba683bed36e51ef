"""``load_model``: build the model on the meta device, then fill it tensor by tensor."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import torch
from tqdm import tqdm

from kimik3.config import ModelConfig, load_config
from kimik3.distributed import ParallelContext, PipelineContext
from kimik3.loader.fp8 import BlockFp8Checkpoint, check_quantization, quantize_fp8
from kimik3.loader.safetensors_files import CheckpointError, checkpoint_files, file_size_ok, iter_slices
from kimik3.model.kimi_k3 import EXPERT_WEIGHT, KimiForCausalLM
from kimik3.model.moe import Experts
from kimik3.ops import mxfp4
from kimik3.ops.options import kernel_options

logger = logging.getLogger(__name__)

_PACKED = re.compile(r"^(.*)\.weight_(packed|scale)$")
_DTYPES = {torch.float64, torch.float32, torch.bfloat16, torch.float16}


def _text_name(name: str, architecture: str, has_vision: bool) -> str | None:
    """Checkpoint name -> model name (vision under ``vision.``); None for vision tensors of a
    config without ``vision_config`` (skipped, logged)."""
    if architecture != "kimi_k3":
        return name
    if name.startswith(("vision_tower.", "mm_projector.")):
        return "vision." + name if has_vision else None
    if name.startswith("language_model.layers."):       # vLLM's alternate export (D20 alias)
        return "model." + name[len("language_model."):]
    if name.startswith("language_model."):
        return name[len("language_model."):]
    raise CheckpointError(f"unexpected tensor '{name}': K3 text tensors live under 'language_model.'")


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               packed_experts: bool | None = None, parallel: ParallelContext | None = None,
               language_model_only: bool = False, progress: bool = False, expert_offload=None,
               expert_loads: dict[int, list[float]] | None = None, quantization: str | None = None,
               pipeline: PipelineContext | None = None,
               **switches) -> KimiForCausalLM:
    """Load a Kimi-K3 or Kimi-Linear checkpoint directory.

    ``dtype``: float64, float32, bfloat16 (float16 also works). ``switches`` set the numeric
    switches of spec README §4 (e.g. ``mla_latent_norm_eps=1e-5`` for vLLM parity).
    ``packed_experts``: keep MXFP4 routed experts packed (the CUDA kernels dequantize on the fly);
    None chooses it for an MXFP4 checkpoint loaded in bfloat16 onto a CUDA device.
    ``parallel``: this rank's place in a TP/EP group; only the rank's shards are read (each
    TP-split tensor through a safetensors slice, other ranks' experts not at all).
    ``language_model_only``: skip the vision tower (its tensors are not read; the model takes no images).
    ``progress``: a progress bar (bytes read, on stderr) while the files load.
    ``expert_offload``: an ``ExpertOffloadConfig`` (``--cpu-offload-gb``): the routed experts load into host
    memory (pinned on CUDA) and the GPU keeps a cache of them (``kimik3.model.expert_offload``).
    ``pipeline``: this rank's pipeline stage; other stages' decoder layers are not read.
    ``expert_loads``: under EPLB (``parallel.eplb``), each MoE layer's recorded expert loads, which place its
    redundant slots (``model/eplb.py``); layers without one are placed evenly.
    Returns the text model; ``model(ids)`` gives logits [T, vocab] (float32).
    """
    parallel = parallel or ParallelContext()
    path = Path(path)
    config = _checked_config(path, dtype, quantization, language_model_only, switches)
    block_fp8 = _block_fp8(config, parallel)
    files = checkpoint_files(path)
    for f in files:
        file_size_ok(f)
    if packed_experts is None:
        packed_experts = _packs_experts_by_default(config, device, dtype)
    model = _meta_model(config, parallel, pipeline, dtype, packed_experts,
                        _fp8_experts(config, quantization, packed_experts))
    offload = _materialize(model, device, expert_offload)
    if parallel.eplb:
        model.place_experts(expert_loads)
    placer = _Placer(model, config, torch.device(device), packed_experts, model.shard_table(), block_fp8)
    bar = tqdm(total=sum(f.stat().st_size for f in files), desc=f"loading {path.name}", unit="B", unit_scale=True,
               unit_divisor=1024, disable=not progress or parallel.tp_rank != 0)
    for file in files:
        for raw_name, read in iter_slices(file):
            placer.take(raw_name, read, file)
        bar.update(file.stat().st_size)
    bar.close()
    placer.check_complete(path, model.expected_weights())
    _log_left_out(placer.skipped, placer.mtp, placer.other_ranks, config, parallel)
    if block_fp8 is not None:
        block_fp8.check_complete()
        block_fp8.install(model)
    if quantization == "fp8":
        quantize_fp8(model)
    if offload:                # after the FP8 projections: the miss policy weighs the bytes a layer reads
        model.offload_experts(expert_offload)
    model.eval()
    return model


def _checked_config(path: Path, dtype: torch.dtype, quantization: str | None, language_model_only: bool,
                    switches: dict) -> ModelConfig:
    """The checkpoint's config (with the numeric ``switches``; without the vision tower when
    ``language_model_only``), after the directory, quantization and dtype are checked (before anything is read)."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    check_quantization(quantization)                  # an unknown method fails before anything is read
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(str(d) for d in _DTYPES)}, got {dtype}")
    config = load_config(path, **switches)
    if language_model_only and config.vision is not None:
        config = dataclasses.replace(config, vision=None)
        logger.info("language_model_only: the vision tower is not loaded")
    return config


def _packs_experts_by_default(config: ModelConfig, device: str | torch.device, dtype: torch.dtype) -> bool:
    """MXFP4 routed experts stay packed for a bfloat16 model on CUDA (the kernels dequantize on the fly), and on
    any device under W4A8 (``KernelOptions.w4a8_moe``: the CPU reference then rounds as the kernels do)."""
    if config.text.expert_quantization != "mxfp4":
        return False
    return (torch.device(device).type == "cuda" and dtype == torch.bfloat16) or kernel_options().w4a8_moe


def _fp8_experts(config: ModelConfig, quantization: str | None, packed_experts: bool) -> bool:
    """``--quantization fp8`` stores routed experts the checkpoint holds in bf16 (Kimi-Linear's) as E4M3 with
    channel scales, quantised as they load (offloaded ones too: the offload pool carries the codes and their
    scales); MXFP4 experts stay MXFP4."""
    return quantization == "fp8" and config.text.num_experts is not None and not packed_experts \
        and config.text.expert_quantization != "mxfp4"


def _meta_model(config: ModelConfig, parallel: ParallelContext, pipeline, dtype: torch.dtype, packed_experts: bool,
                fp8_experts: bool = False) -> KimiForCausalLM:
    """The model built on the meta device and cast, its experts switched to packed (MXFP4) or FP8 storage when
    asked."""
    with torch.device("meta"):
        model = KimiForCausalLM(config, parallel, pipeline)
    model.cast(dtype)
    if packed_experts or fp8_experts:
        for module in model.modules():
            if isinstance(module, Experts):
                if packed_experts:
                    module.use_mxfp4_storage()
                else:
                    module.use_fp8_storage()
        logger.info("routed experts kept in MXFP4 (packed uint8 + E8M0 scales)" if packed_experts else
                    "routed experts quantised to FP8 as they load (E4M3, one float32 scale per output channel)")
    return model


class _Placer:
    """Places a checkpoint's tensors into the model one by one: renames them, leaves out what this model, stage
    or rank does not hold (counted), reads each TP / EP shard alone, pairs MXFP4 halves (kept packed or
    dequantized) and block-FP8 weights with their scales, puts routed experts where their storage lives (host
    memory when offloaded), and refuses a tensor named twice."""

    def __init__(self, model: KimiForCausalLM, config: ModelConfig, device: torch.device, packed_experts: bool,
                 shards: dict, block_fp8):
        self.model, self.config, self.device = model, config, device
        self.packed_experts, self.shards, self.block_fp8 = packed_experts, shards, block_fp8
        self.loaded: set[str] = set()
        self.pending: dict[str, dict[str, torch.Tensor]] = {}   # MXFP4 halves waiting for their partner
        self.skipped = self.other_ranks = self.mtp = 0

    def _left_out(self, name: str | None) -> bool:
        """Count and skip a tensor this model does not hold: vision without a tower, the MTP layers (a draft's,
        loader/drafts.py, as vLLM's main model skips them), another pipeline stage's layer."""
        if name is None:
            self.skipped += 1
        elif _is_mtp_layer(name, self.config.text):
            self.mtp += 1
        elif not self.model.holds_weight(name):        # another pipeline stage's layer, embedding, head, tower
            self.other_ranks += 1
        else:
            return False
        return True

    def take(self, raw_name: str, read, file: Path) -> None:
        name = _text_name(raw_name, self.config.architecture, self.config.vision is not None)
        if self._left_out(name):
            return
        m = _PACKED.match(name)
        e = EXPERT_WEIGHT.match(m[1] + ".weight" if m else name)
        narrow_after, dest = None, self.device
        if e:
            experts = _experts_of(self.model, e[1], name)
            if not experts.holds(int(e[2])):
                self.other_ranks += 1          # another EP rank's expert: never read
                return
            rule, narrow_after = _expert_rule(experts, e[3], m[2] if m else None, self.packed_experts, raw_name)
            tensor, dest = read(rule), experts.w13.device          # host memory when offloaded
        else:
            tensor = read(self.shards.get(name))
        if self.block_fp8 is not None and self.block_fp8.holds(name, tensor):
            done = self.block_fp8.take(name, tensor, f"{raw_name} in {file.name}")   # a pair dequantised, or None
            if done is None:
                return
            name, tensor = done
        if m:
            halves = self._pair(m[1], m[2], tensor)
            if halves is None:
                return
            name = m[1] + ".weight"
            if self.packed_experts and e:
                self._claim(name, raw_name, file)
                experts.load_expert_mxfp4(int(e[2]), e[3], halves["packed"].to(dest), halves["scale"].to(dest),
                                          f"{raw_name} in {file.name}")
                return
            tensor = mxfp4.dequantize(halves["packed"], halves["scale"], torch.float32, name=f"{raw_name} in {file.name}")
        if narrow_after is not None:
            dim, rank, size = narrow_after
            n = tensor.shape[dim] // size
            tensor = tensor.narrow(dim, rank * n, n)
        self._claim(name, raw_name, file)
        self.model.load_weight(name, tensor.to(dest), source=str(file))

    def _pair(self, base: str, half: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Both MXFP4 halves of ``base`` once the second arrives, else None (kept waiting)."""
        halves = self.pending.setdefault(base, {})
        halves[half] = tensor
        if len(halves) < 2:
            return None
        del self.pending[base]
        return halves

    def _claim(self, name: str, raw_name: str, file: Path) -> None:
        if name in self.loaded:
            raise CheckpointError(f"tensor '{raw_name}' appears twice (second time in {file})")
        self.loaded.add(name)

    def check_complete(self, path: Path, expected: set[str]) -> None:
        """Every MXFP4 half found its partner and every tensor the model expects was placed."""
        if self.pending:
            base = next(iter(self.pending))
            have = next(iter(self.pending[base]))
            raise CheckpointError(f"MXFP4 tensor '{base}.weight_{have}' has no matching "
                                  f"'{base}.weight_{'scale' if have == 'packed' else 'packed'}' in {path}")
        missing = sorted(expected - self.loaded)
        if missing:
            more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointError(f"checkpoint {path} is missing {len(missing)} tensor(s): "
                                  f"{', '.join(missing[:5])}{more}")


def _block_fp8(config, parallel: ParallelContext) -> BlockFp8Checkpoint | None:
    """The pairing of a block-FP8 checkpoint's weights and scales (None for other checkpoints)."""
    if config.text.weight_quantization != "fp8-block":
        return None
    if parallel.enabled:
        raise ValueError("block-FP8 checkpoints load in one process for now (their 128 x 128 scales are not cut "
                         "into tensor-parallel shards yet); use tensor_parallel_size 1")
    return BlockFp8Checkpoint()


def _log_left_out(skipped: int, mtp: int, other_ranks: int, config, parallel: ParallelContext) -> None:
    """Say which tensors the load left to others (no vision tower, the MTP draft, other EP ranks)."""
    if skipped:
        logger.info("skipped %d vision/projector tensors (no vision tower: language_model_only or no vision_config)", skipped)
    if mtp:
        logger.info("left %d tensors of the %d MTP layer(s) to the MTP draft (--speculative-config method 'mtp')",
                    mtp, config.text.num_nextn_predict_layers)
    if other_ranks:
        logger.info("rank %d of %d: left %d tensors to the other expert-parallel ranks or pipeline stages",
                    parallel.tp_rank, parallel.tp_size, other_ranks)


def _materialize(model: KimiForCausalLM, device, expert_offload) -> bool:
    """Allocate the meta model's tensors on ``device``, the routed experts in host memory when some are
    offloaded (``expert_offload``, whose budget is checked first); True when they are."""
    if expert_offload is None or expert_offload.cpu_offload_bytes == 0:
        model.to_empty(device=device)
        return False
    model.moe_blocks(expert_offload)              # a bad budget fails before anything is read
    _materialize_with_host_experts(model, device)
    return True


def _materialize_with_host_experts(model: KimiForCausalLM, device) -> None:
    """``model.to_empty(device)`` but the routed experts in host memory (pinned when ``device`` is CUDA)."""
    detached = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
                if isinstance(child, Experts)]
    for parent, name, _ in detached:
        parent._modules[name] = None
    model.to_empty(device=device)
    pin = torch.device(device).type == "cuda"
    for parent, name, child in detached:
        child.to_empty(device="cpu")
        if pin:
            for p in child.parameters():
                p.data = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
            for key, b in child._buffers.items():
                child._buffers[key] = torch.empty(b.shape, dtype=b.dtype, pin_memory=True)
        parent._modules[name] = child


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _is_mtp_layer(name: str, text) -> bool:
    """A tensor of the MTP layers L .. L + n - 1 (``num_nextn_predict_layers`` n) stored after the model's L layers."""
    m = _LAYER.match(name)
    return bool(m) and text.num_hidden_layers <= int(m[1]) < text.num_hidden_layers + text.num_nextn_predict_layers


def _experts_of(model: KimiForCausalLM, layer: str, name: str) -> Experts:
    try:
        experts = model.get_submodule(f"model.layers.{layer}.block_sparse_moe.experts")
    except AttributeError:
        raise CheckpointError(f"unexpected tensor '{name}': layer {layer} has no routed experts") from None
    return experts


def _expert_rule(experts: Experts, which: str, half: str | None, packed_storage: bool, name: str
                 ) -> tuple[tuple[int, int, int] | None, tuple[int, int, int] | None]:
    """(slice to read, slice to cut after dequantizing) of one routed-expert tensor whose
    intermediate is split over ``experts.intermediate_shard`` ranks: w1/w3 by rows, w2 by columns
    (MXFP4: packed bytes and E8M0 scale columns, on 32-element group boundaries)."""
    index, count = experts.intermediate_shard
    if count == 1:
        return None, None
    rule = (0 if which != "w2" else 1, index, count)
    if which != "w2" or half is None:
        return rule, None
    local = experts.w1.shape[1]
    if local % mxfp4.GROUP == 0:
        return rule, None
    if packed_storage:
        raise CheckpointError(f"{name}: the expert intermediate slice ({local} per rank) is not a multiple of the "
                              f"MXFP4 group ({mxfp4.GROUP}); enable expert parallelism or lower the TP degree")
    return None, rule          # read the whole expert's w2, split it once dequantized
