"""Who serves which request entry: the consumer-group commands behind crash resume.

An entry belongs to the consumer whose pending list (PEL) holds it. A live worker keeps
its entries by resetting their idle time well inside the claim threshold; a dead worker's
entries go idle, and any worker with free slots claims them with XAUTOCLAIM. Each claim
counts as a delivery: the count is how poison entries are recognised.

Every method adds commands to a pipeline, so they ride the worker's one round trip per step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from roseinfer.frontends.redis_streams.protocol import Keys

# Idle time given to an entry handed back: past any worker's --claim-idle-ms, so the next
# XAUTOCLAIM anywhere takes it at once.
HANDED_BACK_IDLE_MS = 86_400_000


@dataclass(frozen=True)
class Owner:
    consumer: str
    deliveries: int


class Ownership:
    def __init__(self, keys: Keys, group: str, consumer: str, claim_idle_ms: int):
        self.stream = keys.requests
        self.group = group
        self.consumer = consumer
        self.claim_idle_ms = claim_idle_ms

    # --- reads ---------------------------------------------------------------------------

    def check(self, pipe, entry_ids: list[str]) -> None:
        """Queue one owner lookup per entry; parse the replies with owners()."""
        for entry_id in entry_ids:
            pipe.xpending_range(self.stream, self.group, min=entry_id, max=entry_id, count=1)

    @staticmethod
    def owners(entry_ids: list[str], replies: list) -> dict[str, Optional[Owner]]:
        """Each entry's owner, None for one no longer pending (acknowledged, or Redis lost it)."""
        return {entry_id: (Owner(r[0]["consumer"].decode(), r[0]["times_delivered"]) if r else None)
                for entry_id, r in zip(entry_ids, replies)}

    def claim(self, pipe, cursor: str, count: int) -> None:
        """Queue an XAUTOCLAIM of up to ``count`` entries idle past the threshold."""
        pipe.xautoclaim(self.stream, self.group, self.consumer, self.claim_idle_ms,
                        start_id=cursor, count=count)

    @staticmethod
    def claimed(reply) -> tuple[str, list]:
        """The next cursor and the claimed (entry ID, fields) pairs of an XAUTOCLAIM reply.

        Redis 6.2 answers a pending entry that was deleted from the stream with a nil
        entry (without its ID): nothing to serve, so it is dropped here."""
        cursor, entries = reply[0], reply[1]
        return cursor.decode(), [(i.decode(), f) for i, f in entries if i is not None and f]

    # --- writes ---------------------------------------------------------------------------

    def refresh(self, pipe, entry_ids: list[str]) -> None:
        """Reset the idle time of entries this worker still owns (JUSTID: not a delivery)."""
        pipe.xclaim(self.stream, self.group, self.consumer, 0, entry_ids, justid=True)

    def hand_back(self, pipe, entry_id: str, deliveries: int, count_it: bool) -> None:
        """Make an unfinished entry claimable at once by any worker (this one included).

        The next claim counts a delivery; unless this one ended in a failure (count_it),
        the count is set one lower first, so that a shutdown never makes an entry poison."""
        retries = deliveries if count_it else max(0, deliveries - 1)
        pipe.xclaim(self.stream, self.group, self.consumer, 0, [entry_id],
                    idle=HANDED_BACK_IDLE_MS, retrycount=retries, justid=True)

    def ack(self, pipe, entry_id: str) -> None:
        # Deleted too, since nothing reads an acknowledged request again: the stream then
        # holds exactly the entries waiting or being served.
        pipe.xack(self.stream, self.group, entry_id)
        pipe.xdel(self.stream, entry_id)
