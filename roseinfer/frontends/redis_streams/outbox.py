"""The worker's writes, sent in batches that survive Redis outages.

Writes queue up during a loop iteration and go out together at its end, in order. By
default a sender thread sends them, so the next engine step runs while Redis takes this
one's chunks; the step loop reads (cancels, new entries) on its own. Anything that must
see every earlier write land first (claims, shutdown) waits for the sender. Through an
outage the same writes go again until Redis takes them: resending is safe, since clients
drop chunks whose seq they have seen and acks, claims and expiries are idempotent.

A round trip's reply chunks travel as one script call, not as an XADD and an EXPIRE per
chunk: at a few hundred running requests, redis-py's per-command packing and parsing was
most of the worker's time per step (docs/benchmarks.md, "The worker's own cost").
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Optional

from redis import Redis

from roseinfer.frontends.redis_streams.events import event
from roseinfer.frontends.redis_streams.outage import Outage, is_transient

# KEYS: reply streams; ARGV: expiry (s), approximate MAXLEN, one chunk body per key.
# pcall: a key a client filled with a non-stream value costs its own chunk, not the batch.
PUBLISH_SCRIPT = """
local failed = {}
for i, key in ipairs(KEYS) do
  local reply = redis.pcall('XADD', key, 'MAXLEN', '~', ARGV[2], '*', 'v', '1', 'body', ARGV[i + 2])
  if type(reply) == 'table' and reply.err then
    failed[#failed + 1] = key
  else
    redis.pcall('EXPIRE', key, ARGV[1])
  end
end
return failed
"""


class ReplyBatch:
    """The chunks of one round trip, in order, and the entries acknowledged with them."""

    def __init__(self, ttl_s: int, maxlen: int, ack: Callable):
        self.ttl_s, self.maxlen, self.ack = ttl_s, maxlen, ack
        self.keys: list[str] = []
        self.bodies: list[bytes] = []
        self.acked: list[str] = []

    def add(self, key: str, body: bytes, ack_entry_id: Optional[str]) -> None:
        self.keys.append(key)
        self.bodies.append(body)
        if ack_entry_id is not None:
            self.acked.append(ack_entry_id)

    def write(self, pipe) -> None:
        # EVAL rather than EVALSHA: Redis caches the compiled script by its hash, and a
        # restarted or failed-over Redis needs no SCRIPT LOAD first.
        pipe.eval(PUBLISH_SCRIPT, len(self.keys), *self.keys, self.ttl_s, self.maxlen, *self.bodies)
        if self.acked:  # after the chunks: acknowledged only together with the final one
            self.ack(pipe, self.acked)


class Outbox:
    def __init__(self, redis: Redis, outage: Outage, reply_ttl_s: int = 3600,
                 reply_maxlen: int = 100_000, ack: Optional[Callable] = None,
                 send_thread: bool = True):
        self.redis = redis
        self.outage = outage
        self.reply_ttl_s, self.reply_maxlen, self.ack = reply_ttl_s, reply_maxlen, ack
        self._writes: list[tuple] = []
        self._batch: Optional[ReplyBatch] = None
        self._sender = _Sender(self._send) if send_thread else None

    def write(self, fn, *args, **kwargs) -> None:
        """Queue fn(pipe, *args, **kwargs) for the next round trip."""
        self._writes.append((fn, args, kwargs))

    def publish(self, key: str, body: bytes, ack_entry_id: Optional[str] = None) -> None:
        """Queue a reply chunk (and the ack of its request entry, for a final chunk). The
        round trip's chunks go out together, where the first of them was queued."""
        if self._batch is None:
            self._batch = ReplyBatch(self.reply_ttl_s, self.reply_maxlen, self.ack)
            self.write(self._batch.write)
        self._batch.add(key, body, ack_entry_id)

    def post(self) -> None:
        """Hand the queued writes to the sender thread (without one, read() takes them)."""
        if self._sender is not None and self._writes:
            self._sender.put(self._take())

    def send(self, add_reads: Optional[Callable] = None) -> list:
        """Send every write queued so far, in order, then add_reads(pipe)'s reads; returns
        the reads' replies. Waits until the sender thread has sent what it was given."""
        if self._sender is not None:
            self._sender.drain()
        return self._send(self._take(), add_reads)

    def read(self, add_reads: Callable) -> list:
        """add_reads(pipe)'s reads, now, after the queued writes if there is no sender
        thread (one round trip for both). Returns the reads' replies."""
        return self._send([] if self._sender is not None else self._take(), add_reads)

    def stop(self) -> None:
        """Stop the sender thread (after what it was given); writes still queued stay unsent."""
        if self._sender is not None:
            self._sender.stop()

    def _take(self) -> list[tuple]:
        writes, self._writes, self._batch = self._writes, [], None
        return writes

    def _send(self, writes: list[tuple], add_reads: Optional[Callable] = None) -> list:
        def once():
            pipe = self.redis.pipeline(transaction=False)
            scripts = []
            for fn, args, kwargs in writes:
                if isinstance(getattr(fn, "__self__", None), ReplyBatch):
                    scripts.append(len(pipe))
                fn(pipe, *args, **kwargs)
            num_writes = len(pipe)
            if add_reads is not None:
                add_reads(pipe)
            results = pipe.execute(raise_on_error=False)
            for i, r in enumerate(results):
                if isinstance(r, Exception) and is_transient(r):
                    raise r
                if isinstance(r, Exception) and i < num_writes:
                    event("write_failed", logging.WARNING, error=r)
            for i in scripts:
                if results[i] and not isinstance(results[i], Exception):
                    # a client wrote a non-stream value under a reply key: its loss only
                    event("write_failed", logging.WARNING, error="not a stream",
                          keys=b",".join(results[i]).decode(errors="replace"))
            return results[num_writes:]

        return self.outage.call(once)


class _Sender:
    """Sends batches of writes in order from a thread of its own, at most ``depth`` batches
    behind: a Redis slower than the engine slows the loop instead of piling writes up.
    What stops it (an error, or Redis gone past the shutdown deadline) is raised in the
    loop at its next put() or drain(), and nothing after it is sent."""

    def __init__(self, send: Callable[[list], list], depth: int = 2):
        self._send = send
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None

    def put(self, writes: list) -> None:
        self._raise()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="roseinfer-sender", daemon=True)
            self._thread.start()
        self._queue.put(writes)

    def drain(self) -> None:
        self._queue.join()
        self._raise()

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            writes = self._queue.get()
            try:
                if writes is None:
                    return
                if self._error is None:
                    self._send(writes)
            except BaseException as e:  # the loop raises it: this thread only reports
                self._error = e
            finally:
                self._queue.task_done()

