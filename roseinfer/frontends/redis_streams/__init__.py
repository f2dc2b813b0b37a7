"""Redis Streams frontend, protocol v1 (docs/protocol.md): worker, clients, embedded Redis."""
from roseinfer.frontends.redis_streams.client import AsyncClient, Client, RequestFailed, Result
from roseinfer.frontends.redis_streams.protocol import Chunk, Keys
from roseinfer.frontends.redis_streams.worker import Worker

__all__ = ["AsyncClient", "Chunk", "Client", "Keys", "RequestFailed", "Result", "Worker"]
