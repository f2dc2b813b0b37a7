"""What a pooling request asks, without torch: the Redis protocol's reader and clients
import it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingTask:
    """What a pooling request asks: ``task`` embed, score or classify over ``inputs``
    (texts or token-id lists; for score the documents, beside ``query``)."""
    task: str
    inputs: list
    query: object = None
    dimensions: int | None = None
    truncate: str | None = None
    prompt_name: str | None = None
    normalize: bool | None = None
    encoding_format: str = "binary"  # the protocol's: float32 bytes, or "float" lists
