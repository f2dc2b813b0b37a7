"""Python clients of protocol v1: submit, stream, generate and cancel, blocking or asyncio.

Both clients share everything but the I/O: entry encoding (protocol.py), the reply reader
that orders and de-duplicates chunks, and the assembly of the final result.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator, Iterable, Iterator, Optional

import redis
import redis.asyncio

from roseinfer.frontends.redis_streams.protocol import (
    DEFAULT_PREFIX, Chunk, ChunkOrder, Keys, Prompt, decode_chunk, encode_request)

DEFAULT_URL = "redis://127.0.0.1:6379"
CANCEL_MAXLEN = 10_000  # cancels matter for seconds; the cap keeps the stream small


@dataclass
class Result:
    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict


class RequestFailed(Exception):
    """The worker refused or failed the request; ``code`` is the protocol's error code."""

    def __init__(self, rid: str, code: str, message: str):
        super().__init__(f"request {rid} failed ({code}): {message}")
        self.rid, self.code, self.message = rid, code, message


class _ReplyReader:
    """Reads one reply stream: chunks in seq order, duplicates (at-least-once) dropped."""

    # Each blocking read stays well under redis-py's default 5 s socket timeout; a longer
    # wait is several reads.
    SLICE_MS = 1000

    def __init__(self, keys: Keys, rid: str, timeout: Optional[float]):
        self.rid = rid
        self.key = keys.out(rid)
        self.prefix = keys.prefix
        self.timeout = timeout
        self.last_id = "0-0"
        self.order = ChunkOrder()
        self._deadline = self._next_deadline()

    @property
    def done(self) -> bool:
        return self.order.done

    def _next_deadline(self) -> float:
        return float("inf") if self.timeout is None else time.monotonic() + self.timeout

    def block_ms(self) -> int:
        left_ms = (self._deadline - time.monotonic()) * 1000
        return int(max(1, min(self.SLICE_MS, left_ms)))

    def feed(self, response) -> list[Chunk]:
        """Chunks from one XREAD response; raises TimeoutError once ``timeout`` passed without any."""
        if not response:
            if time.monotonic() >= self._deadline:
                raise TimeoutError(f"no reply for request {self.rid} within {self.timeout}s: "
                                   f"is a worker running with prefix {self.prefix!r}?")
            return []
        self._deadline = self._next_deadline()
        chunks = []
        for entry_id, fields in response[0][1]:
            self.last_id = entry_id
            chunk = decode_chunk(fields)
            if self.order.accept(chunk):
                chunks.append(chunk)
        return chunks


def _result(rid: str, chunks: Iterable[Chunk]) -> Result:
    text, ids = [], []
    for c in chunks:
        text.append(c.text)
        ids += c.token_ids
    if c.error is not None:
        raise RequestFailed(rid, c.error["code"], c.error["message"])
    return Result(rid, "".join(text), ids, c.finish_reason, c.usage)


class Client:
    """Blocking client: ``Client(url).generate("Hello", max_tokens=8).text``."""

    def __init__(self, url: str = DEFAULT_URL, prefix: str = DEFAULT_PREFIX, *,
                 redis_client: Optional[redis.Redis] = None):
        self.redis = redis_client or redis.Redis.from_url(url)
        self.keys = Keys(prefix)

    def submit(self, prompt: Prompt, *, rid: Optional[str] = None, **params) -> str:
        """Queue a request; returns its rid (the entry ID unless ``rid`` is given)."""
        entry_id = self.redis.xadd(self.keys.requests, encode_request(prompt, rid, **params))
        return rid or entry_id.decode()

    def stream(self, rid: str, timeout: Optional[float] = None) -> Iterator[Chunk]:
        """Yield the chunks of ``rid`` up to its final one; ``timeout`` bounds each wait."""
        reader = _ReplyReader(self.keys, rid, timeout)
        while not reader.done:
            response = self.redis.xread({reader.key: reader.last_id}, block=reader.block_ms())
            yield from reader.feed(response)

    def generate(self, prompt: Prompt, *, timeout: Optional[float] = None, **params) -> Result:
        rid = self.submit(prompt, **params)
        return _result(rid, self.stream(rid, timeout))

    def cancel(self, rid: str) -> None:
        self.redis.xadd(self.keys.cancel, {"rid": rid}, maxlen=CANCEL_MAXLEN, approximate=True)

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client with the same methods as Client, as coroutines."""

    def __init__(self, url: str = DEFAULT_URL, prefix: str = DEFAULT_PREFIX, *,
                 redis_client: Optional[redis.asyncio.Redis] = None):
        self.redis = redis_client or redis.asyncio.Redis.from_url(url)
        self.keys = Keys(prefix)

    async def submit(self, prompt: Prompt, *, rid: Optional[str] = None, **params) -> str:
        entry_id = await self.redis.xadd(self.keys.requests, encode_request(prompt, rid, **params))
        return rid or entry_id.decode()

    async def stream(self, rid: str, timeout: Optional[float] = None) -> AsyncIterator[Chunk]:
        reader = _ReplyReader(self.keys, rid, timeout)
        while not reader.done:
            response = await self.redis.xread({reader.key: reader.last_id}, block=reader.block_ms())
            for chunk in reader.feed(response):
                yield chunk

    async def generate(self, prompt: Prompt, *, timeout: Optional[float] = None, **params) -> Result:
        rid = await self.submit(prompt, **params)
        return _result(rid, [c async for c in self.stream(rid, timeout)])

    async def cancel(self, rid: str) -> None:
        await self.redis.xadd(self.keys.cancel, {"rid": rid}, maxlen=CANCEL_MAXLEN, approximate=True)

    async def close(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
