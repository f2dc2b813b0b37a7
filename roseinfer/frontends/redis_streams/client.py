"""Python clients of protocol v1: submit, stream, generate and cancel, blocking or asyncio.

Both clients share everything but the I/O: entry encoding (protocol.py), the reply
streams read together by one XREAD (ordered and de-duplicated per request), and the
assembly of the final result. A client holds a bounded number of connections however
many requests it streams (docs/protocol.md, "Connections").
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Iterable, Iterator, Optional, Union

import redis
import redis.asyncio

from roseinfer.core.pooling_task import PoolingTask
from roseinfer.frontends.redis_streams.connection import (by_slot, connect, connect_async,
                                                         disconnect, disconnect_async,
                                                         is_cluster)
from roseinfer.frontends.redis_streams.outage import is_transient
from roseinfer.frontends.redis_streams.protocol import (  # noqa: F401 - DEFAULT_URL: the API's
    DEFAULT_PREFIX, DEFAULT_URL, Chunk, ChunkOrder, Keys, Prompt, decode_chunk, embedding_rows,
    encode_request, rid_for)

CANCEL_MAXLEN = 10_000  # cancels matter for seconds; the cap keeps the stream small
RETRY_S = 0.2  # between reads while Redis is away (a restart, a failover)
# On a Redis Cluster the reply streams lie in many slots, and one XREAD reads one slot:
# the streams are polled, one XREAD per slot in one pipeline, this long apart when idle.
CLUSTER_POLL_S = 0.005
# A submit or cancel that Redis fails transiently (a restart, a failover's window) is
# tried again for this long. One whose reply alone was lost may be queued twice.
COMMAND_RETRY_S = 30.0


class _Retry:
    """When to try a submit or cancel again: after a transient error, 0.05 s doubling to
    1 s, for COMMAND_RETRY_S in all."""

    def __init__(self):
        self.deadline, self.delay = time.monotonic() + COMMAND_RETRY_S, 0.05

    def wait_after(self, error: Exception) -> float:
        """Seconds to wait before the next try; raises ``error`` when there is none."""
        if not is_transient(error) or time.monotonic() + self.delay > self.deadline:
            raise error
        delay, self.delay = self.delay, min(2 * self.delay, 1.0)
        return delay


def _retried(command):
    retry = _Retry()
    while True:
        try:
            return command()
        except Exception as e:
            time.sleep(retry.wait_after(e))


async def _retried_async(command):
    retry = _Retry()
    while True:
        try:
            return await command()
        except Exception as e:
            await asyncio.sleep(retry.wait_after(e))


@dataclass
class Result:
    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict
    logprobs: Optional[list[dict]] = None   # one per id, if asked for (protocol Chunk)
    prompt_logprobs: Optional[list[Optional[dict]]] = None  # one per prompt token, if asked
    index: int = 0                          # the sample's, of a request with n > 1
    tool_calls: Optional[list[dict]] = None  # the calls of a request with tools (protocol Chunk)
    reasoning: str = ""                     # a reasoning model's thinking, apart from text


@dataclass
class Pooled:
    """A pooling request's result: ``embeddings`` (lists of floats), ``scores`` or
    ``probs``, by input; ``usage``: its tokens."""
    rid: str
    usage: dict
    embeddings: Optional[list[list[float]]] = None
    scores: Optional[list[float]] = None
    probs: Optional[list[list[float]]] = None
    labels: Optional[list[str]] = None  # classify: the classes' names, by index


def _pooled(rid: str, chunks: list[Chunk]) -> Pooled:
    final = chunks[-1]
    if final.error is not None:
        raise RequestFailed(rid, final.error["code"], final.error["message"])
    fields = dict(final.pooled or {})
    rows = embedding_rows(fields) if "embeddings" in fields else None
    fields.pop("embeddings", None), fields.pop("dimensions", None)
    return Pooled(rid, final.usage, embeddings=rows, **fields)


def _task(task: str, inputs, query=None, **options) -> PoolingTask:
    if isinstance(inputs, str):
        inputs = [inputs]
    return PoolingTask(task, list(inputs), query, options.get("dimensions"),
                       options.get("truncate"), options.get("prompt_name"))


class RequestFailed(Exception):
    """The worker refused or failed the request; ``code`` is the protocol's error code."""

    def __init__(self, rid: str, code: str, message: str):
        super().__init__(f"request {rid} failed ({code}): {message}")
        self.rid, self.code, self.message = rid, code, message


class _ReplyReader:
    """One request's reply stream: chunks in seq order, duplicates (at-least-once) dropped,
    and the deadline that ``timeout`` sets for the next chunk. ``inbox`` is where its
    client's read loop puts lists of chunks, or the exception that ends the stream."""

    def __init__(self, keys: Keys, rid: str, timeout: Optional[float], inbox, n: int = 1):
        self.rid = rid
        self.key = keys.out(rid)
        self.prefix = keys.prefix
        self.timeout = timeout
        self.inbox = inbox
        self.last_id = "0-0"
        self.order = ChunkOrder(n)
        self.deadline = self._next_deadline()

    def _next_deadline(self) -> float:
        return float("inf") if self.timeout is None else time.monotonic() + self.timeout

    def take(self, entries) -> list[Chunk]:
        """The chunks of one XREAD's entries of this stream."""
        self.deadline = self._next_deadline()
        chunks = []
        for entry_id, fields in entries:
            self.last_id = entry_id
            chunk = decode_chunk(fields)
            if self.order.accept(chunk):
                chunks.append(chunk)
        return chunks

    def timed_out(self) -> TimeoutError:
        return TimeoutError(f"no reply for request {self.rid} within {self.timeout}s: "
                            f"is a worker running with prefix {self.prefix!r}?")


class _Streams:
    """The reply streams of a client's in-flight requests, all read by one XREAD, so that a
    client holds one reading connection however many requests it streams. No I/O here:
    Client reads from a thread, AsyncClient from a task.

    A new stream must not wait for the blocked XREAD to time out before it is read: the
    read loop also watches the client's own bell stream, which ring() makes it return."""

    # Each blocking read stays well under redis-py's default 5 s socket timeout.
    SLICE_MS = 1000
    # Timeouts are checked this often: a scan of every stream, so not after every read.
    CHECK_S = 0.1
    BELL_TTL_S = 3600

    def __init__(self, keys: Keys):
        self.keys = keys
        self.bell = keys.bell(uuid.uuid4().hex)
        self._bell_id = "0-0"
        self.readers: dict[str, _ReplyReader] = {}
        self.waiting = False  # a read that does not yet cover every stream may be blocked
        self._next_check = 0.0
        self._lock = threading.Lock()  # Client adds streams from many threads

    def add(self, rid: str, timeout: Optional[float], inbox, n: int = 1) -> _ReplyReader:
        reader = _ReplyReader(self.keys, rid, timeout, inbox, n)
        with self._lock:
            if reader.key in self.readers:
                raise ValueError(f"request {rid} is already being streamed by this client")
            self.readers[reader.key] = reader
        return reader

    def remove(self, reader: _ReplyReader) -> None:
        with self._lock:
            if self.readers.get(reader.key) is reader:
                del self.readers[reader.key]

    def ring(self, pipe) -> None:
        pipe.xadd(self.bell, {"ring": "1"}, maxlen=1)
        pipe.expire(self.bell, self.BELL_TTL_S)

    @staticmethod
    def ring_failed(error: BaseException) -> None:
        """A ring that Redis did not take (it is failing over, say) is skipped: the blocked
        read fails or returns within CHECK_S too, and the next one covers the new stream."""
        if not is_transient(error):
            raise error

    def next_read(self) -> Optional[tuple[dict, int]]:
        """(XREAD streams, block ms), or None when there is nothing to read."""
        with self._lock:
            if not self.readers:
                return None
            self.waiting = True
            streams = {self.bell: self._bell_id}
            streams.update((r.key, r.last_id) for r in self.readers.values())
        left_ms = (self._next_check - time.monotonic()) * 1000
        return streams, int(max(1, min(self.SLICE_MS, left_ms)))

    def deliver(self, response) -> list[tuple[_ReplyReader, object]]:
        """(reader, chunks or TimeoutError) for each stream that the XREAD response moved
        or whose timeout passed."""
        self.waiting = False
        out = []
        with self._lock:
            for key, entries in _stream_entries(response):
                if key == self.bell:
                    self._bell_id = entries[-1][0]
                elif (reader := self.readers.get(key)) is not None:
                    chunks = reader.take(entries)
                    if chunks:
                        out.append((reader, chunks))
            return out + self._overdue()

    def _overdue(self) -> list[tuple[_ReplyReader, object]]:
        now = time.monotonic()
        if now < self._next_check:
            return []
        self._next_check = now + self.CHECK_S
        return [(r, r.timed_out()) for r in self.readers.values() if now >= r.deadline]

    def failed(self, error: BaseException) -> list[tuple[_ReplyReader, object]]:
        """After a failed read: a transient error (Redis restarting, a failover) is waited
        out, each stream failing only at its own timeout; any other fails every stream."""
        self.waiting = False
        with self._lock:
            if is_transient(error):
                return self._overdue()
            return [(r, error) for r in self.readers.values()]



def _stream_entries(response):
    """(key, entries) pairs of an XREAD reply, RESP2 or RESP3."""
    if not response:
        return []
    pairs = response.items() if isinstance(response, dict) else response
    return [(k.decode() if isinstance(k, bytes) else k, v[0] if isinstance(response, dict) else v)
            for k, v in pairs]


def _slot_reads(redis, streams: dict) -> list[dict]:
    """``streams`` split into one XREAD's worth per cluster slot."""
    return [dict(group) for group in by_slot(redis.keyslot, streams.items())]


def _merged(replies: list):
    """The replies of several XREADs as one XREAD's (RESP2 lists or RESP3 maps)."""
    if any(isinstance(r, dict) for r in replies):
        return {k: v for r in replies if r for k, v in r.items()}
    return [pair for r in replies if r for pair in r]


def _unwrap(item) -> list[Chunk]:
    """One inbox item as a stream yields it: the chunks, or the exception raised."""
    if isinstance(item, BaseException):
        raise item
    return item


def _results(rid: str, chunks: Iterable[Chunk], n: int = 1) -> Union[Result, list[Result]]:
    """The Result of a request's chunks; with n > 1 the list of its samples' Results."""
    chunks = list(chunks)
    if chunks[-1].error is not None:
        raise RequestFailed(rid, chunks[-1].error["code"], chunks[-1].error["message"])
    samples = [_result(rid, [c for c in chunks if (c.index or 0) == i], i) for i in range(n)]
    return samples[0] if n == 1 else samples


def _result(rid: str, chunks: list[Chunk], index: int) -> Result:
    text, ids, logprobs, prompt_logprobs = [], [], None, None
    for c in chunks:
        text.append(c.text)
        ids += c.token_ids
        if c.logprobs is not None:
            logprobs = (logprobs or []) + c.logprobs
        prompt_logprobs = prompt_logprobs or c.prompt_logprobs
    return Result(rid, "".join(text), ids, c.finish_reason, c.usage, logprobs, prompt_logprobs,
                  index, c.tool_calls, "".join(c.reasoning or "" for c in chunks))


class Client:
    """Blocking client: ``Client(url).generate("Hello", max_tokens=8).text``. Thread-safe:
    one reading thread serves the streams of every thread, and commands share a pool of at
    most ``max_connections`` (threads wait for a free one), the reading one included."""

    def __init__(self, url: str = DEFAULT_URL, prefix: str = DEFAULT_PREFIX, *,
                 redis_client: Optional[redis.Redis] = None, max_connections: int = 8):
        self.redis = redis_client or connect(url, max_connections)
        self._owns_redis = redis_client is None  # a caller's client stays open on close()
        self.keys = Keys(prefix)
        self._streams = _Streams(self.keys)
        self._cluster = is_cluster(self.redis)
        self._reading: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def submit(self, prompt: Prompt, *, rid: Optional[str] = None, **params) -> str:
        """Queue a request; returns its rid (the entry ID unless ``rid`` is given, or the
        request waits in the backlog)."""
        rid = rid_for(rid, params)
        fields = encode_request(prompt, rid, **params)
        entry_id = _retried(lambda: self.redis.xadd(self.keys.lane(params), fields))
        return rid or entry_id.decode()

    def stream(self, rid: str, timeout: Optional[float] = None, n: int = 1) -> Iterator[Chunk]:
        """Yield the chunks of ``rid`` up to its final one (the last of its ``n`` samples'
        final ones); ``timeout`` bounds each wait."""
        reader = self._streams.add(rid, timeout, queue.SimpleQueue(), n)
        seen = ChunkOrder(n)  # the reader's own runs ahead, on the reading thread
        try:
            self._wake()
            while True:
                for chunk in _unwrap(reader.inbox.get()):
                    seen.accept(chunk)
                    yield chunk
                if seen.done:
                    return
        finally:
            self._streams.remove(reader)

    def _wake(self) -> None:
        with self._lock:
            if self._reading is None:
                self._reading = threading.Thread(target=self._read_loop, daemon=True,
                                                 name="roseinfer-client-reader")
                self._reading.start()
                return
        if self._streams.waiting and not self._cluster:  # a cluster's reads do not block
            pipe = self.redis.pipeline(transaction=False)
            self._streams.ring(pipe)
            try:
                pipe.execute()
            except Exception as e:
                self._streams.ring_failed(e)

    def _read_loop(self) -> None:
        while True:
            with self._lock:  # the decision to stop and _wake()'s to start are one at a time
                read = self._streams.next_read()
                if read is None:
                    self._reading = None
                    return
            try:
                delivered = self._streams.deliver(self._read(*read))
            except Exception as e:
                delivered = self._streams.failed(e)
                if not delivered:
                    time.sleep(RETRY_S)
            for reader, item in delivered:
                reader.inbox.put(item)

    def _read(self, streams: dict, block_ms: int):
        if not self._cluster:
            return self.redis.xread(streams, block=block_ms)
        pipe = self.redis.pipeline(transaction=False)
        for group in _slot_reads(self.redis, streams):
            pipe.xread(group)
        found = _merged(pipe.execute())
        if not found:
            time.sleep(CLUSTER_POLL_S)
        return found

    def generate(self, prompt: Prompt, *, timeout: Optional[float] = None,
                 **params) -> Union[Result, list[Result]]:
        """The request's Result; with ``n`` > 1 the list of its samples' Results, by index."""
        rid = self.submit(prompt, **params)
        n = params.get("n") or 1
        return _results(rid, self.stream(rid, timeout, n), n)

    def embed(self, inputs, *, dimensions: Optional[int] = None, truncate: Optional[str] = None,
              prompt_name: Optional[str] = None, timeout: Optional[float] = None,
              **params) -> Pooled:
        """Embeddings of ``inputs`` (a text, or a list of texts or token-id lists) from a
        worker whose model pools; ``params``: ``priority`` (above 0: the backlog)."""
        return self._pool(_task("embed", inputs, dimensions=dimensions, truncate=truncate,
                                prompt_name=prompt_name), timeout, params)

    def score(self, query, documents, *, truncate: Optional[str] = None,
              timeout: Optional[float] = None, **params) -> Pooled:
        """Each document's relevance to ``query`` (``scores``)."""
        return self._pool(_task("score", documents, query, truncate=truncate), timeout, params)

    def classify(self, inputs, *, truncate: Optional[str] = None,
                 timeout: Optional[float] = None, **params) -> Pooled:
        """Each input's class probabilities (``probs``)."""
        return self._pool(_task("classify", inputs, truncate=truncate), timeout, params)

    def _pool(self, task: PoolingTask, timeout: Optional[float], params: dict) -> Pooled:
        rid = self.submit(task, **params)
        return _pooled(rid, list(self.stream(rid, timeout)))

    def cancel(self, rid: str) -> None:
        _retried(lambda: self.redis.xadd(self.keys.cancel, {"rid": rid}, maxlen=CANCEL_MAXLEN,
                                          approximate=True))

    def close(self) -> None:
        """Disconnect the pool this client made; a client passed in is left as it was."""
        if self._owns_redis:
            disconnect(self.redis)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client with the same methods as Client, as coroutines. One task reads the
    streams of every request in flight; commands share a pool of at most
    ``max_connections`` (the reading one included)."""

    def __init__(self, url: str = DEFAULT_URL, prefix: str = DEFAULT_PREFIX, *,
                 redis_client: Optional[redis.asyncio.Redis] = None, max_connections: int = 8):
        self.redis = redis_client or connect_async(url, max_connections)
        self._owns_redis = redis_client is None  # a caller's client stays open on close()
        self.keys = Keys(prefix)
        self._streams = _Streams(self.keys)
        self._cluster = is_cluster(self.redis)
        self._reading: Optional[asyncio.Task] = None

    async def submit(self, prompt: Prompt, *, rid: Optional[str] = None, **params) -> str:
        rid = rid_for(rid, params)
        fields = encode_request(prompt, rid, **params)
        entry_id = await _retried_async(lambda: self.redis.xadd(self.keys.lane(params), fields))
        return rid or entry_id.decode()

    async def stream(self, rid: str, timeout: Optional[float] = None,
                     n: int = 1) -> AsyncIterator[Chunk]:
        reader = self._streams.add(rid, timeout, asyncio.Queue(), n)
        seen = ChunkOrder(n)  # the reader's own runs ahead, in the reading task
        try:
            await self._wake()
            while True:
                for chunk in _unwrap(await reader.inbox.get()):
                    seen.accept(chunk)
                    yield chunk
                if seen.done:
                    return
        finally:
            self._streams.remove(reader)

    async def _wake(self) -> None:
        if self._reading is None:
            self._reading = asyncio.create_task(self._read_loop())
        elif self._streams.waiting and not self._cluster:  # a cluster's reads do not block
            pipe = self.redis.pipeline(transaction=False)
            self._streams.ring(pipe)
            try:
                await pipe.execute()
            except Exception as e:
                self._streams.ring_failed(e)

    async def _read_loop(self) -> None:
        try:
            while (read := self._streams.next_read()) is not None:
                try:
                    delivered = self._streams.deliver(await self._read(*read))
                except Exception as e:
                    delivered = self._streams.failed(e)
                    if not delivered:
                        await asyncio.sleep(RETRY_S)
                for reader, item in delivered:
                    reader.inbox.put_nowait(item)
        finally:
            self._reading = None

    async def _read(self, streams: dict, block_ms: int):
        if not self._cluster:
            return await self.redis.xread(streams, block=block_ms)
        pipe = self.redis.pipeline()
        for group in _slot_reads(self.redis, streams):
            pipe.xread(group)
        found = _merged(await pipe.execute())
        if not found:
            await asyncio.sleep(CLUSTER_POLL_S)
        return found

    async def generate(self, prompt: Prompt, *, timeout: Optional[float] = None,
                       **params) -> Union[Result, list[Result]]:
        rid = await self.submit(prompt, **params)
        n = params.get("n") or 1
        return _results(rid, [c async for c in self.stream(rid, timeout, n)], n)

    async def embed(self, inputs, *, dimensions: Optional[int] = None,
                    truncate: Optional[str] = None, prompt_name: Optional[str] = None,
                    timeout: Optional[float] = None, **params) -> Pooled:
        return await self._pool(_task("embed", inputs, dimensions=dimensions,
                                      truncate=truncate, prompt_name=prompt_name),
                                timeout, params)

    async def score(self, query, documents, *, truncate: Optional[str] = None,
                    timeout: Optional[float] = None, **params) -> Pooled:
        return await self._pool(_task("score", documents, query, truncate=truncate), timeout,
                                params)

    async def classify(self, inputs, *, truncate: Optional[str] = None,
                       timeout: Optional[float] = None, **params) -> Pooled:
        return await self._pool(_task("classify", inputs, truncate=truncate), timeout, params)

    async def _pool(self, task: PoolingTask, timeout: Optional[float], params: dict) -> Pooled:
        rid = await self.submit(task, **params)
        return _pooled(rid, [c async for c in self.stream(rid, timeout)])

    async def cancel(self, rid: str) -> None:
        await _retried_async(lambda: self.redis.xadd(self.keys.cancel, {"rid": rid},
                                                     maxlen=CANCEL_MAXLEN, approximate=True))

    async def close(self) -> None:
        """Stop reading and disconnect the pool this client made; a client passed in is
        left as it was."""
        if self._reading is not None:
            self._reading.cancel()
        if self._owns_redis:
            await disconnect_async(self.redis)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
