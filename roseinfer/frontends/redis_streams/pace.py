"""What the worker says about its own pace: a progress line every few seconds, and a
warning when one loop iteration came near the claim threshold."""
from __future__ import annotations

import logging
import time

from roseinfer.frontends.redis_streams.events import event


class Pace:
    def __init__(self, progress_every_s: float, claim_idle_ms: int, totals: dict):
        self.progress_every_s = progress_every_s
        self.claim_idle_ms = claim_idle_ms
        self.totals = totals  # the sender thread adds to them; only read here
        self._last = {"at": time.monotonic(), "tokens": 0, "finished": 0}

    def log_progress(self, engine, in_flight: int) -> None:
        """Every progress_every_s: the totals' growth since the last time."""
        last, now = self._last, time.monotonic()
        if now - last["at"] < self.progress_every_s:
            return
        tokens, finished = self.totals["tokens"], self.totals["finished"]
        if tokens > last["tokens"] or in_flight:
            s = engine.stats()
            event("progress", running=s.num_running, waiting=s.num_waiting,
                  kv_cache=s.kv_cache_usage,
                  tok_per_s=(tokens - last["tokens"]) / (now - last["at"]),
                  finished=finished - last["finished"])
        self._last = {"at": now, "tokens": tokens, "finished": finished}

    def warn_if_slow(self, started: float, stepped: float, in_flight: int) -> None:
        """An iteration past half the claim threshold puts the worker's entries within
        reach of other workers' claims: say so, and where the time went."""
        took = time.monotonic() - started
        if took * 1000 > self.claim_idle_ms / 2:
            event("slow_iteration", logging.WARNING, took_s=took, step_s=stepped - started,
                  rest_s=took - (stepped - started), in_flight=in_flight,
                  hint="a long prefill or admission; raise --claim-idle-ms if this recurs")
