"""Who serves which request entry: the consumer-group commands behind crash resume.

An entry belongs to the consumer whose pending list (PEL) holds it. A live worker keeps
its entries by resetting their idle time well inside the claim threshold; a dead worker's
entries go idle, and any worker with free slots claims them with XAUTOCLAIM. Each claim
counts as a delivery: the count is how poison entries are recognised.

Every method adds commands to a pipeline, so they ride the worker's one round trip per step.
"""
from __future__ import annotations

from typing import Optional

from roseinfer.frontends.redis_streams.protocol import Keys

# Who may write for a request entry: the consumer whose pending list holds it. A worker
# stalled past the claim threshold (paused, swapped out) wakes with rounds still queued
# for entries another worker took over; their chunks and acks are dropped here, in the
# same script as the writes, so nothing lands between the check and the write.
OWNER_LUA = """
local function owner(requests, group, entry)
  local p = redis.call('XPENDING', requests, group, entry, entry, 1)
  return p[1] and p[1][2] or false
end
"""

# KEYS: the request stream; ARGV: group, consumer, entry IDs. Acknowledges (and deletes)
# the entries still this consumer's; returns how many.
ACK_SCRIPT = OWNER_LUA + """
local acked = 0
for i = 3, #ARGV do
  if owner(KEYS[1], ARGV[1], ARGV[i]) == ARGV[2] then
    redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
    redis.call('XDEL', KEYS[1], ARGV[i])
    acked = acked + 1
  end
end
return acked
"""

# KEYS: the request stream; ARGV: group, consumer, entry ID, idle ms, delivery count. Makes
# the entry claimable at once, if it is still this consumer's: a plain XCLAIM would take
# it from a worker that took it over meanwhile, which would then serve it beside another.
HAND_BACK_SCRIPT = OWNER_LUA + """
if owner(KEYS[1], ARGV[1], ARGV[3]) ~= ARGV[2] then
  return 0
end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'IDLE', ARGV[4],
           'RETRYCOUNT', ARGV[5], 'JUSTID')
return 1
"""

# Idle time given to an entry handed back: past any worker's --claim-idle-ms, so the next
# XAUTOCLAIM anywhere takes it at once.
HANDED_BACK_IDLE_MS = 86_400_000


class Ownership:
    def __init__(self, keys: Keys, group: str, consumer: str, claim_idle_ms: int):
        self.stream = keys.requests
        self.group = group
        self.consumer = consumer
        self.claim_idle_ms = claim_idle_ms

    def refresh(self, pipe, entries: list[tuple[str, float]]) -> None:
        """Queue a refresh of entries this worker believes it owns, each given with its age:
        seconds since this worker last knew it untouched (read, claimed or refreshed it).

        Another worker can claim an entry only after it sat idle for claim_idle_ms, so once
        claimed, its idle time is at least claim_idle_ms shorter than that age. Claiming it
        with a minimum idle time of age - claim_idle_ms/2 therefore succeeds, resetting the
        idle time, exactly for the entries still untouched, in one atomic command (JUSTID:
        not a delivery). Read the replies with kept()."""
        for entry_id, age_s in entries:
            min_idle_ms = max(0, int(age_s * 1000) - self.claim_idle_ms // 2)
            pipe.xclaim(self.stream, self.group, self.consumer, min_idle_ms, [entry_id], justid=True)

    @staticmethod
    def kept(replies: list) -> list[bool]:
        """Per refreshed entry: still this worker's? (No: claimed elsewhere, or acknowledged.
        An error reply, as when the stream was deleted, says nothing about it: kept.)"""
        return [bool(r) or isinstance(r, Exception) for r in replies]

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

    def hand_back(self, pipe, entry_id: str, deliveries: int, count_it: bool) -> None:
        """Make an unfinished entry claimable at once by any worker (this one included), if
        it is still this worker's (HAND_BACK_SCRIPT).

        The next claim counts a delivery; unless this one ended in a failure (count_it),
        the count is set one lower first, so that a shutdown never makes an entry poison."""
        retries = deliveries if count_it else max(0, deliveries - 1)
        pipe.execute_command("EVAL", HAND_BACK_SCRIPT, 1, self.stream, self.group,
                             self.consumer, entry_id, HANDED_BACK_IDLE_MS, retries)

    def ack(self, pipe, entry_ids: list[str]) -> None:
        """Queue the acknowledgement of entries, those still this worker's only (OWNER_LUA).
        Deleted too, since nothing reads an acknowledged request again: the stream then
        holds exactly the entries waiting or being served."""
        pipe.execute_command("EVAL", ACK_SCRIPT, 1, self.stream, self.group, self.consumer,
                             *entry_ids)

    def fence(self, cluster: bool) -> "Fence":
        """What the reply script checks before writing for an entry: that it is still this
        worker's. Not on a Redis Cluster, whose request stream is in another slot than
        the reply streams (docs/operations.md)."""
        return Fence(self.stream, None if cluster else self.group, self.consumer)


class Fence:
    """Whose writes a script lets through: ``consumer``'s in ``group`` on ``requests``
    (OWNER_LUA); ``group`` None: no fence (on a Redis Cluster)."""

    def __init__(self, requests: str, group: Optional[str], consumer: str):
        self.requests, self.group, self.consumer = requests, group, consumer

    def args(self, keys: list[str]) -> tuple[list[str], list[str]]:
        """The script's keys (with the request stream when fenced) and its fence ARGVs."""
        if self.group is None:
            return keys, ["", self.consumer]
        return [*keys, self.requests], [self.group, self.consumer]

