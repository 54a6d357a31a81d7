"""kvserve: an LLM inference server with a paged, shareable KV cache."""

from kvserve.config import EngineConfig
from kvserve.engine.llm import LLM
from kvserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams"]
