"""Taking over claimed entries: what a request's reply stream already holds decides whether
it is acknowledged (already finished), dead-lettered (delivered too often) or resumed.

A resumed request continues where its reply stream stops: the tokens it holds are handed
to the engine as already emitted (recomputed as context, not sent again) and the next
chunk takes the next seq, so its client sees neither a duplicate nor a gap.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from roseinfer.frontends.redis_streams.protocol import (
    Chunk, Keys, accepted_chunks, reply_rid)

DEAD_MAXLEN = 100_000  # P:dead is for people to read: it should never come near this


@dataclass
class Takeover:
    entry_id: str
    fields: dict
    rid: str
    deliveries: int        # this delivery included
    chunks: list[Chunk]    # what the request's client has received so far
    # When this worker last knew the entry its own: just claimed (see Ownership.refresh).
    refreshed_at: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return bool(self.chunks) and self.chunks[-1].finished

    @property
    def next_seq(self) -> int:
        return self.chunks[-1].seq + 1 if self.chunks else 0

    @property
    def emitted_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]


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
            takeovers.append(Takeover(entry_id, fields, rid, pending[0]["times_delivered"],
                                      accepted_chunks(reply_entries)))
    return takeovers


def dead_letter(pipe, keys: Keys, t: Takeover, reason: str, consumer: str) -> None:
    """Queue the P:dead entry: the request's own fields, replayable as they are (XADD them
    to P:requests again; the dead_* fields are ignored there), and why it died."""
    fields = {**t.fields, "dead_entry_id": t.entry_id, "dead_rid": t.rid,
              "dead_deliveries": t.deliveries, "dead_reason": reason, "dead_consumer": consumer,
              "dead_at": f"{time.time():.3f}"}
    pipe.xadd(keys.dead, fields, maxlen=DEAD_MAXLEN, approximate=True)
