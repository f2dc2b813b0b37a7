"""The worker's takeover decisions: when to claim idle entries, and what to do with each
one claimed (takeover.py reads what its reply stream holds).

An entry claimed is acknowledged if its stream already ends (its worker died between the
final chunk and the ack), dead-lettered if delivered too often, run alone if it may be
the one that broke its worker's steps (a suspect: delivered RUN_ALONE_FROM_DELIVERY times
or more), else resumed. An entry claimed back from this worker itself (it stalled past
the claim threshold) stays served where it is.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

from roseinfer.frontends.redis_streams.events import event
from roseinfer.frontends.redis_streams.inflight import RUN_ALONE_FROM_DELIVERY, InFlight
from roseinfer.frontends.redis_streams.ownership import Ownership
from roseinfer.frontends.redis_streams.protocol import chunk_body, error_chunk
from roseinfer.frontends.redis_streams.takeover import Takeover, dead_letter, read_takeovers


class Claims:
    """``worker``: the Worker whose ``_inflight``, ``outbox``, ``publisher``, ``metrics``,
    ``_admit`` and ``_readable`` these decisions act through."""

    def __init__(self, worker, max_deliveries: int, tick_s: float):
        self.worker = worker
        self.max_deliveries = max_deliveries
        self.tick_s = tick_s
        self.suspects: deque[Takeover] = deque()
        self.now = False       # claim at the next chance, not at the next tick
        self._next = 0.0
        self._cursor = "0-0"

    def due(self, free_slots: int) -> bool:
        now = time.monotonic()
        if not (self.now or now >= self._next) or not free_slots:
            return False
        self._next = now + self.tick_s
        return True

    def claim(self, slots: int) -> None:
        """Claim entries idle past the threshold: a dead worker's, or ones handed back."""
        w, cursor = self.worker, self._cursor
        (reply,) = w.outbox.send(lambda pipe: w.ownership.claim(pipe, cursor, slots))
        if not w._readable(reply):
            return
        self._cursor, claimed = Ownership.claimed(reply)
        self.now = self._cursor != "0-0"  # more of the PEL to scan: next step
        if claimed:
            self._take_over(claimed)

    def _take_over(self, claimed: list) -> None:
        w = self.worker
        takeovers = w.outage.call(lambda: read_takeovers(
            w.redis.pipeline(transaction=False), w.keys, w.group, claimed))
        for t in takeovers:
            if self._still_mine(t):
                continue
            w.outbox.vouch(w.keys.out(t.rid), t.entry_id,
                           [(chunk_body(c), c.seq) for c in t.chunks])
            if t.finished:  # its worker died between the final chunk and the ack
                w.outbox.write(w.ownership.ack, [t.entry_id])
                event("acked", rid=t.rid, entry=t.entry_id, reason="already finished")
            elif t.deliveries > self.max_deliveries:
                self._dead_letter(t)
            elif t.deliveries >= RUN_ALONE_FROM_DELIVERY:
                self.suspects.append(t)
            else:
                w._admit(t.entry_id, t.fields, t)

    def _still_mine(self, t: Takeover) -> bool:
        """An entry this worker serves, claimed back by itself: the loop stalled past the
        claim threshold (a long admission or prefill) and no other worker took it first.
        The claim reset its idle time; it stays served where it is, as it was."""
        mine: InFlight = self.worker._inflight.get(t.rid)
        if mine is not None and mine.entry_id == t.entry_id:
            mine.refreshed_at = t.refreshed_at
        elif not any(s.entry_id == t.entry_id for s in self.suspects):
            return False
        event("kept_own_entry", logging.WARNING, rid=t.rid, entry=t.entry_id,
              reason="claimed back from itself after a stall past --claim-idle-ms")
        return True

    def start_suspect(self, idle: bool) -> None:
        """Run the next suspect once the engine is empty (``idle``: nothing else is read
        meanwhile)."""
        if self.suspects and idle:
            t = self.suspects.popleft()
            event("running_alone", rid=t.rid, entry=t.entry_id, deliveries=t.deliveries)
            self.worker._admit(t.entry_id, t.fields, t)

    def drop(self, t: Takeover) -> bool:
        """Forget a suspect another worker claimed; False if it started meanwhile."""
        if t not in self.suspects:
            return False
        self.suspects.remove(t)
        return True

    def hand_back(self, write: Callable) -> None:
        """Every suspect back to the group (``write(fn, *args)`` queues it)."""
        for t in self.suspects:
            write(self.worker.ownership.hand_back, t.entry_id, t.deliveries, False)
        self.suspects.clear()

    def _dead_letter(self, t: Takeover) -> None:
        w = self.worker
        reason = (f"delivered {t.deliveries} times without finishing (--max-deliveries "
                  f"{self.max_deliveries}); it may be crashing workers")
        w.outbox.write(dead_letter, w.keys, t, reason, w.consumer)
        message = f"{reason}; moved to {w.keys.dead} for an operator to look at"
        chunk = error_chunk(t.rid, "dead_letter", message, t.next_seq, len(t.emitted_ids()))
        w.publisher.publish(w.outbox.round, chunk, t.entry_id, final=True)
        w.metrics.dead_lettered.inc()
        w.metrics.finished("error")
        event("dead_lettered", logging.WARNING, rid=t.rid, entry=t.entry_id,
              deliveries=t.deliveries, dead_stream=w.keys.dead)
