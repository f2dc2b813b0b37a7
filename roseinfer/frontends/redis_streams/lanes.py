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

from roseinfer.frontends.redis_streams.protocol import Keys

# KEYS: the request stream, the backlog. ARGV: group, free slots, max wait (ms) per unit of
# priority (read from the entry: its body's, or a shell-form field; 1 if neither).
# Acknowledged entries are deleted (ownership.py), so the stream's length less its
# pending entries is what waits unread. An entry without a rid keeps its backlog ID as
# its rid: that is the ID its client was given. Every moved entry carries its backlog ID
# as backlog_id, so that its queue time, TTFT and latency count from when its client
# queued it. Returns the entries moved and left.
PROMOTE_SCRIPT = """
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
  local has_rid = false
  for i = 1, #fields, 2 do
    if fields[i] == 'rid' then has_rid = true end
  end
  if not has_rid then
    table.insert(fields, 'rid')
    table.insert(fields, id)
  end
  table.insert(fields, 'backlog_id')
  table.insert(fields, id)
  redis.call('XADD', KEYS[1], '*', unpack(fields))
  redis.call('XDEL', KEYS[2], id)
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

    def due(self) -> bool:
        return time.monotonic() >= self._next

    def promote(self, pipe, slots: int) -> None:
        """Queue the move of backlog entries into the request stream (PROMOTE_SCRIPT)."""
        pipe.execute_command("EVAL", PROMOTE_SCRIPT, 2, self.keys.requests, self.keys.backlog,
                             self.group, slots, int(self.max_wait_s * 1000))

    def moved(self, reply) -> None:
        left = reply[1] if isinstance(reply, list) else 1  # an error: look again next round
        self._next = 0.0 if left else time.monotonic() + EMPTY_BACKLOG_POLL_S
