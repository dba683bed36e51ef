"""Iterate the tensors of a checkpoint directory, with errors that name the file."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, or holds tensors the model cannot use."""


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those named by the index, else every file."""
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that do not exist in {path}: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors files (and no {INDEX}) in {path}")
    return files


def iter_slices(file: Path) -> Iterator[tuple[str, Callable[[tuple[int, int, int] | None], torch.Tensor]]]:
    """Yield (name, read) of one file; ``read(rule)`` reads the whole tensor (rule None) or only
    the contiguous share (dim, rank, size) of it (safetensors ``get_slice``: the rest of the
    tensor is never read). A caller may skip ``read`` altogether (another rank's expert)."""
    try:
        handle = safe_open(str(file), framework="pt")
        names = list(handle.keys())
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{file}: cannot read safetensors header ({e})") from None

    def read(name: str, rule: tuple[int, int, int] | None) -> torch.Tensor:
        try:
            if rule is None:
                return handle.get_tensor(name)
            piece = handle.get_slice(name)
            shape = piece.get_shape()
            dim, rank, size = rule
            if dim >= len(shape) or shape[dim] % size:
                raise CheckpointError(f"{file}: tensor '{name}' of shape {tuple(shape)} cannot be split into {size} "
                                      f"parts along dim {dim}")
            n = shape[dim] // size
            index = [slice(None)] * len(shape)
            index[dim] = slice(rank * n, (rank + 1) * n)
            return piece[tuple(index)]
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{file}: cannot read tensor '{name}' (truncated or corrupt file?): {e}") from None

    for name in names:
        yield name, functools.partial(read, name)


def file_size_ok(file: Path) -> None:
    """Cheap truncation check: the header's largest data offset must fit in the file."""
    with file.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{file}: truncated (shorter than a safetensors header)")
        n = int.from_bytes(raw, "little")
        header_bytes = fh.read(min(n, 100_000_000))
    if len(header_bytes) < n:
        raise CheckpointError(f"{file}: truncated inside the safetensors header")
    try:
        header = json.loads(header_bytes)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: corrupt safetensors header ({e})") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > file.stat().st_size:
        raise CheckpointError(f"{file}: truncated: header needs {8 + n + end} bytes, file has {file.stat().st_size}")
