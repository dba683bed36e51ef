"""Model blocks: one file per block, assembled in ``kimi_k3.py``."""

from kimik3.model.batch import ForwardBatch, HybridCache, StateCheckpoint
from kimik3.model.kimi_k3 import KimiForCausalLM

__all__ = ["ForwardBatch", "HybridCache", "KimiForCausalLM", "StateCheckpoint"]
