"""Checkpoint reading (safetensors, sharded or single, MXFP4 experts) and writing."""

from kimik3.loader.load import load_model
from kimik3.loader.writer import save_checkpoint

__all__ = ["load_model", "save_checkpoint"]
