"""Riding out Redis outages: retry a round trip with backoff until Redis answers again.

A lost connection, a restart (LOADING while it reads its AOF), a failover or a full
memory all look the same from here: nothing can be written, so the worker waits and
sends the same writes again. Resending is safe: clients drop chunks whose seq they have
seen, and acks, claims and expiries are idempotent.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from typing import Callable, Optional, TypeVar

from redis.exceptions import (AskError, ClusterError, ConnectionError, MasterDownError,
                              OutOfMemoryError, ReadOnlyError, ResponseError,
                              SlotNotCoveredError, TimeoutError, TryAgainError)

from roseinfer.frontends.redis_streams.events import event

T = TypeVar("T")


class GaveUp(Exception):
    """Redis stayed unreachable past the shutdown deadline."""


# A Redis Cluster mid-failover: its slots unserved, moving, or their map being re-read
# (redis-py raises these once its own retries are spent).
CLUSTER_TRANSIENT = (ClusterError, TryAgainError, AskError, SlotNotCoveredError)
# Replies that mean "not now" rather than "never": retried like a lost connection. (A full
# Redis under maxmemory-policy noeviction answers OOM; a replica being promoted answers
# READONLY or MASTERDOWN.) redis-py raises a class of its own for some, the code cut from
# the message; the others stay ResponseErrors that start with their code.
TRANSIENT_ERRORS = (ConnectionError, TimeoutError, OutOfMemoryError, ReadOnlyError,
                    MasterDownError, *CLUSTER_TRANSIENT)  # ConnectionError: LOADING too
TRANSIENT_REPLIES = ("OOM", "MISCONF", "LOADING", "READONLY", "MASTERDOWN", "TRYAGAIN",
                     "CLUSTERDOWN", "NOREPLICAS")


def is_transient(error: BaseException) -> bool:
    if isinstance(error, TRANSIENT_ERRORS) or _node_table_race(error):
        return True
    return isinstance(error, ResponseError) and str(error).startswith(TRANSIENT_REPLIES)


def _node_table_race(error: BaseException) -> bool:
    """redis-py's cluster client, shared by threads, can read its node table while another
    thread rebuilds it after a failover, and raise this instead of sending (seen in a
    client's submit during a primary's kill; valkey-py#181 fixes the same code). The next
    try reads the new table."""
    return isinstance(error, RuntimeError) and str(error).startswith("dictionary") \
        and str(error).endswith("during iteration")


# The longest sleep between tries. A failover's new primary is found only by the next try,
# so this bounds how long after it the worker resumes: with 2 s, streams through a
# Sentinel failover waited 3.6-5.4 s (failover done after ~3.1 s); a try per 0.5 s is
# no load on a Redis that is back.
MAX_BACKOFF_S = 0.5


class Outage:
    """``Outage(give_up).call(fn)`` runs fn until it does not fail transiently, sleeping
    0.05 s, 0.1 s, ... up to max_backoff_s between tries (and calling before_retry()).
    Logs once when Redis goes away and once when it is back, however many threads wait
    it out; raises GaveUp once give_up() says so."""

    def __init__(self, give_up: Callable[[], bool], on_outage: Callable[[], None] = lambda: None,
                 max_backoff_s: float = MAX_BACKOFF_S, before_retry: Callable[[], None] = lambda: None):
        self.give_up = give_up
        self.on_outage = on_outage
        self.before_retry = before_retry
        self.max_backoff_s = max_backoff_s
        self._lock = threading.Lock()
        self._down_since: Optional[float] = None
        self.outages = 0  # times Redis went away: a caller can tell one happened meanwhile

    def call(self, fn: Callable[[], T]) -> T:
        attempt = 0
        while True:
            try:
                result = fn()
            except Exception as e:
                if not is_transient(e):
                    raise
                down_s = self._went_down(e)
                if self.give_up():
                    raise GaveUp(f"Redis unreachable for {down_s:.1f}s") from e
                time.sleep(min(self.max_backoff_s, 0.05 * 2 ** attempt) * random.uniform(0.5, 1.0))
                self.before_retry()
                attempt += 1
                continue
            if self._down_since is not None:
                self._came_back(attempt)
            return result

    def _went_down(self, error: Exception) -> float:
        """Seconds since Redis went away (logged by the first thread to notice)."""
        with self._lock:
            if self._down_since is None:
                self._down_since = time.monotonic()
                self.outages += 1
                event("redis_unavailable", logging.WARNING,
                      error=f"{type(error).__name__}: {error}",
                      action="retrying with backoff; in-flight requests wait")
                self.on_outage()
            return time.monotonic() - self._down_since

    def _came_back(self, attempt: int) -> None:
        with self._lock:
            if self._down_since is not None:
                event("redis_back", down_s=time.monotonic() - self._down_since,
                      attempts=attempt + 1)
                self._down_since = None
