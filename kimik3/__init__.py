"""kimik3: an inference engine for Moonshot AI's Kimi-K3 and Kimi-Linear."""

from kimik3.config import ConfigError, ModelConfig, load_config
from kimik3.engine import LLM, EngineArgs, SamplingParams
from kimik3.loader import DEFAULT_MODEL, load_model
from kimik3.tokenizer import load_tokenizer

__all__ = ["DEFAULT_MODEL", "EngineArgs", "LLM", "ConfigError", "ModelConfig", "SamplingParams", "load_config", "load_model",
           "load_tokenizer"]
