"""roseinfer: an LLM inference engine with a plugin core and a Redis Streams frontend."""
from roseinfer.core.config import EngineConfig
from roseinfer.core.llm import LLM
from roseinfer.core.outputs import RequestOutput
from roseinfer.core.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput"]
