"""Error measures shared by the tests (and ``tests/gpu``): relative errors in float64, whole
tensors or the worst of their pieces (a bad short sequence cannot hide in a global norm)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when ``out`` holds a non-finite value (unwritten or NaN)."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def rel_errs(out: torch.Tensor, ref: torch.Tensor, lens: Sequence[int] | None = None, dim: int = 0) -> list[float]:
    """``rel_err`` of each piece of ``dim``: consecutive runs of ``lens`` (the sequences of a packed
    varlen batch), or each index of ``dim`` (tokens, slots) when ``lens`` is None."""
    if out.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(out.shape)} vs {tuple(ref.shape)}")
    sizes = list(lens) if lens is not None else [1] * out.shape[dim]
    if sum(sizes) != out.shape[dim]:
        raise ValueError(f"lens {sizes} sum to {sum(sizes)}, but dim {dim} has {out.shape[dim]} entries")
    return [rel_err(o, r) for o, r in zip(out.split(sizes, dim), ref.split(sizes, dim))]


def worst_rel_err(out: torch.Tensor, ref: torch.Tensor, lens: Sequence[int] | None = None, dim: int = 0) -> float:
    """The largest of ``rel_errs``: a bound on it holds for every sequence / token / slot alone."""
    return max(rel_errs(out, ref, lens, dim))


class LaunchRecorder:
    """Stands in for a Triton kernel (``kernel[grid](...)``): records each launch's grid, then runs it."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]
