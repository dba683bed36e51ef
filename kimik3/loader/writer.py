"""Write checkpoints in the release layout: config.json, sharded safetensors + index, and the
compressed-tensors MXFP4 form for routed experts. kimik3 reads what it writes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from kimik3.loader.safetensors_files import INDEX
from kimik3.ops import mxfp4

_EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")


def save_checkpoint(out_dir: str | Path, config: dict, tensors: Iterable[tuple[str, torch.Tensor]],
                    *, mxfp4_experts: bool, max_shard_bytes: int = 2 << 30) -> Path:
    """Write ``config`` and the (checkpoint-named) tensors. Expert weights ``...experts.E.wN.weight``
    are stored as ``weight_packed`` + ``weight_scale`` when ``mxfp4_experts``. Shards are named
    ``model-0000i-of-0000n.safetensors`` and listed in ``model.safetensors.index.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors:
        items = [(name, t)]
        if mxfp4_experts and _EXPERT_WEIGHT.search(name):
            packed, scale = mxfp4.quantize(t)
            base = name[: -len(".weight")]
            items = [(base + ".weight_packed", packed), (base + ".weight_scale", scale)]
        for n, tensor in items:
            nbytes = tensor.numel() * tensor.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][n] = tensor.detach().contiguous().cpu()
            size += nbytes
    total = len(shards)
    weight_map, total_size = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        for n, tensor in shard.items():
            weight_map[n] = fname
            total_size += tensor.numel() * tensor.element_size()
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map},
                                        indent=2) + "\n")
    return out
