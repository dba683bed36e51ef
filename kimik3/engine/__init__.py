"""Offline and streaming generation: scheduler, hybrid cache manager, runner, sampler."""

from kimik3.engine.args import EngineArgs
from kimik3.engine.build import build_engine
from kimik3.engine.config import EngineConfig
from kimik3.engine.core.llm_engine import LLMEngine
from kimik3.engine.core.memory import MemoryPlan, plan_memory
from kimik3.engine.core.output import CompletionOutput, EngineStats, RequestOutput
from kimik3.engine.llm import LLM
from kimik3.engine.sample.sampling_params import SamplingParams

__all__ = ["CompletionOutput", "EngineArgs", "EngineConfig", "EngineStats", "LLM", "LLMEngine", "MemoryPlan",
           "RequestOutput", "SamplingParams", "build_engine", "plan_memory"]
