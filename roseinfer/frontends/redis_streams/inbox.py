"""Entries handed from one worker to another: the move of ownership, and the receiving end.

Routing (routing.py) decides which worker should serve an entry another one read. Handing
it over is one script (FORWARD_SCRIPT): if the entry is still this worker's, its ownership
moves to the peer (XCLAIM with JUSTID: not a delivery) and a copy of its fields goes to the
peer's inbox stream, which the peer reads in the same blocking XREADGROUP as the shared
stream. From then on the entry is the peer's as if it had read it itself: refreshed by it,
acknowledged with its final chunk, claimed by others if it dies (ownership.py).
"""
from __future__ import annotations

from typing import Optional

from redis.exceptions import RedisError, ResponseError

from roseinfer.frontends.redis_streams.ownership import OWNER_LUA
from roseinfer.frontends.redis_streams.protocol import Keys

# The entry ID in an inbox entry; the other fields are the request entry's own.
ENTRY_FIELD = b"_entry"
MAXLEN = 10_000        # an inbox is drained every round; this only guards Redis
READ_COUNT = 16        # entries read per round while the worker has no slot free
LEAVE_COUNT = 10_000   # at most left unread when the worker stops (handed back)

# KEYS: the request stream, the peer's inbox. ARGV: group, this consumer, entry ID, the
# peer, the inbox's expiry (s), then the entry's fields. Returns 1 if handed over.
FORWARD_SCRIPT = OWNER_LUA + """
if owner(KEYS[1], ARGV[1], ARGV[3]) ~= ARGV[2] then
  return 0
end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[4], 0, ARGV[3], 'JUSTID')
redis.call('XADD', KEYS[2], 'MAXLEN', '~', %d, '*', '%s', ARGV[3], unpack(ARGV, 6))
redis.call('EXPIRE', KEYS[2], ARGV[5])
return 1
""" % (MAXLEN, ENTRY_FIELD.decode())


class Inbox:
    def __init__(self, redis, keys: Keys, group: str, consumer: str, ttl_s: int):
        self.redis, self.keys, self.group, self.consumer = redis, keys, group, consumer
        self.ttl_s = ttl_s
        self.key = keys.inbox(consumer)

    def hand_over(self, places: dict[str, str], fields: dict[str, dict]) -> dict[str, str]:
        """Hand each entry of ``places`` ({entry ID: peer}) to its peer now, in one round
        trip; returns those handed over. One that could not be sent stays this worker's to
        serve: if it was sent after all, the fence drops this worker's writes for it."""
        pipe = self.redis.pipeline(transaction=False)
        for entry_id, peer in places.items():
            flat = [x for kv in fields[entry_id].items() for x in kv]
            pipe.execute_command("EVAL", FORWARD_SCRIPT, 2, self.keys.requests,
                                 self.keys.inbox(peer), self.group, self.consumer, entry_id,
                                 peer, self.ttl_s, *flat)
        try:
            replies = pipe.execute(raise_on_error=False)
        except RedisError:
            return {}
        return {e: p for (e, p), r in zip(places.items(), replies) if r == 1}

    def done(self, pipe, inbox_ids: list) -> None:
        """Queue the removal of inbox entries read (their request entries are owned)."""
        pipe.xack(self.key, self.group, *inbox_ids)
        pipe.xdel(self.key, *inbox_ids)

    def leftovers(self, outage) -> list[tuple[bytes, Optional[str]]]:
        """At exit: (inbox ID, request entry ID) of the entries handed here not read yet."""
        try:
            read = outage.call(lambda: self.redis.xreadgroup(
                self.group, self.consumer, {self.key: ">"}, count=LEAVE_COUNT))
        except ResponseError:  # the inbox expired (NOGROUP): nothing was handed here since
            return []
        return [(i, entry(f)[0]) for i, f in (read[0][1] if read else [])]


def entry(fields: dict) -> tuple[Optional[str], dict]:
    """(the request entry's ID, its own fields) of an inbox entry."""
    entry_id = fields.get(ENTRY_FIELD)
    rest = {k: v for k, v in fields.items() if k != ENTRY_FIELD}
    return (entry_id.decode() if entry_id is not None else None), rest
