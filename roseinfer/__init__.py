"""roseinfer: an LLM inference engine with a plugin core and a Redis Streams frontend."""
import importlib

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput"]

# Resolved on first use, so that clients (which need no torch) start fast.
_HOMES = {"LLM": "roseinfer.core.llm", "SamplingParams": "roseinfer.core.sampling",
          "EngineConfig": "roseinfer.core.config", "RequestOutput": "roseinfer.core.outputs"}


def __getattr__(name):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'roseinfer' has no attribute {name!r}")
