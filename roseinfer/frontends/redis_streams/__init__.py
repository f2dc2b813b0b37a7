"""Redis Streams frontend, protocol v1 (docs/protocol.md): worker, clients, embedded Redis."""
import importlib

__all__ = ["AsyncClient", "Chunk", "Client", "Keys", "RequestFailed", "Result", "Worker"]

# Resolved on first use: clients and the gateway import no torch (the worker does).
_HOMES = {"AsyncClient": "client", "Client": "client", "RequestFailed": "client",
          "Result": "client", "Chunk": "protocol", "Keys": "protocol", "Worker": "worker"}


def __getattr__(name):
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
