"""Background work waits in a backlog, so that the request stream stays short.

Workers read the request stream in arrival order, so a request can start only after every
entry ahead of it was read. A large batch added there would hold every later interactive
request behind it. Requests with a priority above 0 therefore go to ``P:backlog`` instead
(the clients do it; docs/protocol.md), and workers move them into the request stream as
they have room: each round, a worker with free slots runs PROMOTE_SCRIPT, which moves as
many entries from the backlog's head as it has free slots more than the stream holds
unread. The stream then holds little more than the fleet can start at once, and a request
added to it waits behind at most that much.

Starvation is bounded here too: an entry of priority p at the backlog's head that has
waited p x ``max_wait_s`` (the worker's priority_aging_s) is moved by the next worker round
whatever the stream holds; it then ranks with the entries arriving after it, as the
scheduler's aging has it. The backlog is in arrival order: an entry behind the head waits
for the head.
"""
from __future__ import annotations

import time

from redis.exceptions import NoPermissionError

from roseinfer.frontends.redis_streams.protocol import Keys

# Moves every entry of one stream to the end of another, in order. An entry without a rid
# keeps its old entry ID as its rid: that is the ID its client was given. Every moved
# entry carries its first backlog ID as backlog_id, so that its queue time, TTFT and
# latency count from when its client queued it.
MOVE_LUA = """
local function move(from, to, id, fields)
  local has_rid, has_backlog_id = false, false
  for i = 1, #fields, 2 do
    if fields[i] == 'rid' then has_rid = true end
    if fields[i] == 'backlog_id' then has_backlog_id = true end
  end
  if not has_rid then
    table.insert(fields, 'rid')
    table.insert(fields, id)
  end
  if not has_backlog_id then
    table.insert(fields, 'backlog_id')
    table.insert(fields, id)
  end
  redis.call('XADD', to, '*', unpack(fields))
  redis.call('XDEL', from, id)
end
"""

# The backlog's name before every key started with the prefix: clients built for it may
# still add there, and workers allowed to read it carry its entries over to the backlog's
# end (Backlog.carry_over, then each promote).
CARRY_OVER_LUA = MOVE_LUA + """
local function carry_over(from, to)
  local n = 0
  for _, entry in ipairs(redis.call('XRANGE', from, '-', '+', 'COUNT', 1000)) do
    move(from, to, entry[1], entry[2])
    n = n + 1
  end
  return n
end
"""

# KEYS: the old backlog, the backlog. Returns the entries carried over.
CARRY_OVER_SCRIPT = CARRY_OVER_LUA + "return carry_over(KEYS[1], KEYS[2])"

# KEYS: the request stream, the backlog[, the old backlog]. ARGV: group, free slots, max
# wait (ms) per unit of priority (read from the entry: its body's, or a shell-form field;
# 1 if neither). Acknowledged entries are deleted (ownership.py), so the stream's length
# less its pending entries is what waits unread. Returns the entries moved and left.
PROMOTE_SCRIPT = CARRY_OVER_LUA + """
if KEYS[3] then
  carry_over(KEYS[3], KEYS[2])
end
local function priority(fields)
  local p = 1
  for i = 1, #fields, 2 do
    if fields[i] == 'priority' then
      p = tonumber(fields[i + 1]) or p
    elseif fields[i] == 'body' and cmsgpack then
      local ok, body = pcall(cmsgpack.unpack, fields[i + 1])
      if ok and type(body) == 'table' and tonumber(body.priority) then
        p = tonumber(body.priority)
      end
    end
  end
  return math.max(p, 1)
end
local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1])
if pending.err then
  return {0, redis.call('XLEN', KEYS[2])}
end
local room = tonumber(ARGV[2]) - (redis.call('XLEN', KEYS[1]) - pending[1])
local now = redis.call('TIME')
now = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local moved = 0
for _, entry in ipairs(redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', math.max(room, 1))) do
  local id, fields = entry[1], entry[2]
  local waited = now - tonumber(string.match(id, '^(%d+)'))
  if moved >= room and waited < priority(fields) * tonumber(ARGV[3]) then
    break
  end
  move(KEYS[2], KEYS[1], id, fields)
  moved = moved + 1
end
return {moved, redis.call('XLEN', KEYS[2])}
"""

# How often a worker looks at a backlog it last saw empty: a request added to an empty
# backlog waits this long at most before it can move (more while every worker blocks on
# an idle read: up to its block time).
EMPTY_BACKLOG_POLL_S = 0.25


class Backlog:
    """One worker's moves: every round while the backlog holds entries, else every
    EMPTY_BACKLOG_POLL_S (it costs a command in the round trip)."""

    def __init__(self, keys: Keys, group: str, max_wait_s: float):
        self.keys, self.group, self.max_wait_s = keys, group, max_wait_s
        self._next = 0.0
        self.old_backlog = None  # set by carry_over when this worker may read it

    def carry_over(self, redis) -> int:
        """Carry the old backlog's entries over, at start; returns how many. A user whose
        ACL keeps it to the prefix's keys (docs/operations.md, "Tenants") cannot read the
        old name, nor could a client of its tenant have added there: it is left alone."""
        old = f"{{{self.keys.requests}}}:backlog"
        try:
            carried = redis.eval(CARRY_OVER_SCRIPT, 2, old, self.keys.backlog)
        except NoPermissionError:
            return 0
        self.old_backlog = old
        return carried

    def due(self) -> bool:
        return time.monotonic() >= self._next

    def promote(self, pipe, slots: int) -> None:
        """Queue the move of backlog entries into the request stream (PROMOTE_SCRIPT)."""
        keys = [self.keys.requests, self.keys.backlog, *filter(None, [self.old_backlog])]
        pipe.execute_command("EVAL", PROMOTE_SCRIPT, len(keys), *keys,
                             self.group, slots, int(self.max_wait_s * 1000))

    def moved(self, reply) -> None:
        left = reply[1] if isinstance(reply, list) else 1  # an error: look again next round
        self._next = 0.0 if left else time.monotonic() + EMPTY_BACKLOG_POLL_S
