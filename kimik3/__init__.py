"""kimik3: an inference engine for Moonshot AI's Kimi-K3 and Kimi-Linear."""

from kimik3.config import ConfigError, ModelConfig, load_config
from kimik3.loader import load_model

__all__ = ["ConfigError", "ModelConfig", "load_config", "load_model"]
