"""Taking over claimed entries: what a request's reply stream already holds decides whether
it is acknowledged (already finished), dead-lettered (delivered too often) or resumed.

A resumed request continues where its reply stream stops: the tokens it holds are handed
to the engine as already emitted (recomputed as context, not sent again) and the next
chunk takes the next seq, so its client sees neither a duplicate nor a gap.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from roseinfer.frontends.redis_streams.protocol import (
    Chunk, Keys, accepted_chunks)
from roseinfer.frontends.redis_streams.request_entry import reply_rid, requested_n

DEAD_MAXLEN = 100_000  # P:dead is for people to read: it should never come near this


@dataclass
class Takeover:
    entry_id: str
    fields: dict
    rid: str
    deliveries: int        # this delivery included
    chunks: list[Chunk]    # what the request's client has received so far
    n: int = 1             # the request's samples
    # When this worker last knew the entry its own: just claimed (see Ownership.refresh).
    refreshed_at: float = field(default_factory=time.monotonic)

    @property
    def finished_indexes(self) -> set[int]:
        return {c.index or 0 for c in self.chunks if c.finished}

    @property
    def finished(self) -> bool:
        last = self.chunks[-1] if self.chunks else None
        return last is not None and (last.finish_reason == "error"
                                     or len(self.finished_indexes) == self.n)

    @property
    def next_seq(self) -> int:
        return self.chunks[-1].seq + 1 if self.chunks else 0

    def emitted_ids(self, index: Optional[int] = None) -> list[int]:
        """The ids sent so far: of sample ``index``, or of all of them."""
        return [t for c in self._of(index) for t in c.token_ids]

    def text(self, index: Optional[int] = None) -> str:
        return "".join(c.text for c in self._of(index))

    def _of(self, index: Optional[int]) -> list[Chunk]:
        return self.chunks if index is None else [c for c in self.chunks
                                                  if (c.index or 0) == index]


def read_takeovers(pipe, keys: Keys, group: str, claimed: list) -> list[Takeover]:
    """One round trip: the delivery count and reply stream of every claimed entry."""
    rids = [reply_rid(entry_id, fields) for entry_id, fields in claimed]
    for (entry_id, _), rid in zip(claimed, rids):
        pipe.xpending_range(keys.requests, group, min=entry_id, max=entry_id, count=1)
        # From the entry's own ID on: older chunks belong to an earlier request that used
        # the same rid (both IDs come from the same Redis clock).
        pipe.xrange(keys.out(rid), min=entry_id)
    replies = pipe.execute()
    takeovers = []
    for i, ((entry_id, fields), rid) in enumerate(zip(claimed, rids)):
        pending, reply_entries = replies[2 * i], replies[2 * i + 1]
        if pending:  # else acknowledged since the claim: someone finished it
            n = requested_n(fields)
            takeovers.append(Takeover(entry_id, fields, rid, pending[0]["times_delivered"],
                                      accepted_chunks(reply_entries, n), n))
    return takeovers


def dead_letter(pipe, keys: Keys, t: Takeover, reason: str, consumer: str) -> None:
    """Queue the P:dead entry: the request's own fields, replayable as they are (XADD them
    to P:requests again; the dead_* fields are ignored there), and why it died."""
    fields = {**t.fields, "dead_entry_id": t.entry_id, "dead_rid": t.rid,
              "dead_deliveries": t.deliveries, "dead_reason": reason, "dead_consumer": consumer,
              "dead_at": f"{time.time():.3f}"}
    pipe.xadd(keys.dead, fields, maxlen=DEAD_MAXLEN, approximate=True)
