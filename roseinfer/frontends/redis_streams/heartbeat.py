"""Worker heartbeats: one key per worker, ``P:workers:CONSUMER``, holding its status as JSON.

Rewritten every ``interval_s`` and expiring after three missed beats, so the keys that
exist are the workers that live; `roseinfer status` lists them.
"""
from __future__ import annotations

import json
import math
import os
import socket
import time

from redis import Redis

from roseinfer.frontends.redis_streams.protocol import Keys


class Heartbeat:
    def __init__(self, keys: Keys, consumer: str, interval_s: float = 5.0, **static):
        self.key = keys.worker(consumer)
        self.interval_s = interval_s
        self.ttl_s = max(1, math.ceil(3 * interval_s))
        self.static = {"consumer": consumer, "host": socket.gethostname(), "pid": os.getpid(),
                       "started_at": time.time(), "ttl_s": self.ttl_s, **static}
        self._next = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.interval_s
        return True

    def soon(self) -> None:
        """Write at the next chance, not at the next interval."""
        self._next = 0.0

    def write(self, pipe, status: str, **live) -> None:
        value = {**self.static, "status": status, "at": time.time(), **live}
        pipe.set(self.key, json.dumps(value), ex=self.ttl_s)

    def remove(self, pipe) -> None:
        pipe.delete(self.key)


def read_heartbeats(redis: Redis, keys: Keys) -> list[dict]:
    """The live workers' heartbeats, by consumer name, each with ``age_s``: how long ago it
    was written, from the key's remaining TTL (Redis's clock, so hosts' clocks don't matter)."""
    names = sorted(redis.scan_iter(match=keys.workers_pattern, count=1000))
    pipe = redis.pipeline(transaction=False)
    for name in names:
        pipe.get(name)
        pipe.pttl(name)
    replies = pipe.execute() if names else []
    beats = []
    for value, pttl in zip(replies[::2], replies[1::2]):
        if value is not None:  # else it expired since the scan
            beat = json.loads(value)
            beat["age_s"] = max(0.0, beat["ttl_s"] - pttl / 1000)
            beats.append(beat)
    return beats
