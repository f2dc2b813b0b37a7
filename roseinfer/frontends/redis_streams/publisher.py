"""From engine outputs to reply chunks, on the outbox's sender thread.

Each request's chunking state (next seq, tokens held back for the stream interval, its
token times) lives in its InFlight and is touched only here, so this work needs no lock
and runs while the step loop drives the next step.
"""
from __future__ import annotations

import time

from roseinfer.frontends.redis_streams.events import event
from roseinfer.frontends.redis_streams.inflight import InFlight
from roseinfer.frontends.redis_streams.metrics import Metrics
from roseinfer.frontends.redis_streams.protocol import Chunk, Keys, chunk_body


class Publisher:
    def __init__(self, keys: Keys, metrics: Metrics):
        self.keys, self.metrics = keys, metrics
        # Added to here only; the loop reads them (heartbeat, progress log).
        self.totals = {"tokens": 0, "finished": 0}

    def publish(self, rnd, chunk: Chunk, entry_id: str, final: bool = False) -> None:
        """Queue a chunk of the request entry ``entry_id`` in the round; ``final`` (its
        request's last final chunk) with the ack of the entry: a request is acknowledged
        only together with its final chunk, so a crash never loses it."""
        rnd.publish(self.keys.out(chunk.rid), chunk_body(chunk), entry_id, chunk.seq, final)

    def outputs(self, rnd, ours: list[tuple[InFlight, object, bool]]) -> None:
        """A step's outputs as the chunks they make due; ``last``: the output that
        finishes the request's last running sample."""
        tokens = 0
        for f, out, last in ours:
            tokens += f.observe(out, self.metrics)
            chunk = f.take(out)
            if chunk is not None and last:
                self._finish(rnd, f, chunk)
            elif chunk is not None:
                self.publish(rnd, chunk, f.entry_id)
        self.metrics.generation_tokens.inc(tokens)
        self.totals["tokens"] += tokens

    def _finish(self, rnd, f: InFlight, chunk: Chunk) -> None:
        self.publish(rnd, chunk, f.entry_id, final=True)
        e2e_s = max(0.0, time.time() - f.arrival)
        self.metrics.finished(chunk.finish_reason)
        self.metrics.e2e.observe(e2e_s)
        self.totals["finished"] += 1
        event("finished", rid=f.rid, reason=chunk.finish_reason,
              prompt_tokens=chunk.usage["prompt_tokens"],
              completion_tokens=chunk.usage["completion_tokens"], chunks=chunk.seq + 1,
              e2e_s=e2e_s)
