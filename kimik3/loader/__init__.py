"""Checkpoint reading (safetensors, sharded or single, MXFP4 experts) and writing."""

from pathlib import Path

from kimik3.loader.load import load_model
from kimik3.loader.writer import save_checkpoint

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "default_model"
"""A tiny Kimi-K3 checkpoint in the release layout, with random weights, shipped in the package."""

__all__ = ["DEFAULT_MODEL", "load_model", "save_checkpoint"]
