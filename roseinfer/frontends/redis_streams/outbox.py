"""The worker's writes, sent in batches that survive Redis outages.

Writes queue up between round trips and go out in the next one, in one pipeline with that
round trip's reads. Through an outage the same writes go again until Redis takes them:
resending is safe, since clients drop chunks whose seq they have seen and acks, claims
and expiries are idempotent.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

from redis import Redis

from roseinfer.frontends.redis_streams.events import event
from roseinfer.frontends.redis_streams.outage import Outage, is_transient


class Outbox:
    def __init__(self, redis: Redis, outage: Outage):
        self.redis = redis
        self.outage = outage
        self._writes: list[tuple] = []

    def write(self, fn, *args, **kwargs) -> None:
        """Queue fn(pipe, *args, **kwargs) for the next round trip."""
        self._writes.append((fn, args, kwargs))

    def send(self, add_reads: Optional[Callable] = None) -> list:
        """Send the queued writes and add_reads(pipe)'s reads; returns the reads' replies."""
        def once():
            pipe = self.redis.pipeline(transaction=False)
            for fn, args, kwargs in self._writes:
                fn(pipe, *args, **kwargs)
            writes = len(pipe)
            if add_reads is not None:
                add_reads(pipe)
            results = pipe.execute(raise_on_error=False)
            for i, r in enumerate(results):
                if isinstance(r, Exception) and is_transient(r):
                    raise r
                if isinstance(r, Exception) and i < writes:
                    # e.g. a client wrote a non-stream value under a reply key: its loss only
                    event("write_failed", logging.WARNING, error=r)
            return results[writes:]

        reads = self.outage.call(once)
        self._writes.clear()
        return reads
