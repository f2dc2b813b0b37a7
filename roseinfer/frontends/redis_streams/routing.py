"""Prefix-aware routing: an entry goes to the worker whose prefix cache holds its prompt.

Each worker tells the fleet what it holds and how busy it is (CacheReport, riding the step
loop's own round trips; docs/protocol.md, "Routing"):
- ``cached:C``, a set of the block hashes in its prefix cache (core/blocks.py), changed each
  round by what the block manager's journal says was cached or evicted: never more members
  than the worker has KV blocks;
- ``load:C``, its unfinished sequences, rewritten when they change and expiring with its
  heartbeat, so a dead worker's is gone within three heartbeats;
- ``fleet``, the set of worker names.

A worker that reads an entry from the shared stream places it (Router, on the reader
thread, once the entry is tokenized): one pipelined round trip asks each live peer's set
how many of the prompt's leading blocks it holds (SMISMEMBER). The entry goes to the peer
holding the most when that is at least ``min_gain_tokens`` more than this worker holds,
unless that peer is loaded past a bound: it runs ``max_load`` x its max_num_seqs sequences
or more, or more than ``max_excess`` (default: an eighth of its max_num_seqs, at least 2)
beyond this worker's own (SGLang's router balances the same way). Else it stays here.
With nothing to share (no peer holds the first blocks) it stays, at the cost of that
lookup, off the step loop.

Handing it over is one script (FORWARD_SCRIPT): if the entry is still this worker's, its
ownership moves to the peer (XCLAIM with JUSTID: not a delivery) and a copy of its fields
goes to the peer's inbox stream, which the peer reads in the same blocking XREADGROUP as the
shared stream. From then on the entry is the peer's as if it had read it itself: refreshed
by it, acknowledged with its final chunk, claimed by others if it dies (ownership.py).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import msgpack
from redis.exceptions import RedisError

from roseinfer.core.blocks import prompt_hashes
from roseinfer.frontends.redis_streams.ownership import OWNER_LUA
from roseinfer.frontends.redis_streams.protocol import Keys

log = logging.getLogger("roseinfer.worker")

# The entry ID in an inbox entry; the other fields are the request entry's own.
INBOX_ENTRY_FIELD = b"_entry"
INBOX_MAXLEN = 10_000      # an inbox is drained every round; this only guards Redis
FLEET_EVERY_S = 1.0        # how often a router rereads the fleet's names
MAX_LOOKUP_BLOCKS = 512    # prompt blocks looked up per entry (8,192 tokens of 16)

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
""" % (INBOX_MAXLEN, INBOX_ENTRY_FIELD.decode())


@dataclass(frozen=True)
class RouteConfig:
    min_gain_tokens: int = 128  # a peer must hold this many more prompt tokens than we do
    max_load: float = 1.0       # x max_num_seqs: a peer at or past it gets nothing
    max_excess: Optional[int] = None  # sequences a peer may run beyond ours; None: auto


class CacheReport:
    """This worker's part: its cached blocks and its load. take() runs on the step loop,
    which owns the block manager; the writes it returns ride the next round trip."""

    def __init__(self, keys: Keys, consumer: str, engine, ttl_s: int):
        self.keys, self.consumer, self.ttl_s = keys, consumer, ttl_s
        self.engine = engine
        self.max_num_seqs = engine.config.max_num_seqs
        blocks = getattr(engine, "blocks", None)
        self.blocks = blocks if blocks is not None and blocks.prefix_cache else None
        if self.blocks is not None:
            self.blocks.journal = []
        self._load: Optional[tuple] = None

    def join(self, pipe) -> None:
        """At start: a set of what the cache holds now (after a restart under the same
        name, the old one goes), and the name into the fleet."""
        pipe.delete(self.keys.cached(self.consumer))
        if self.blocks is not None:
            held = list(self.blocks.cached)
            if held:
                pipe.sadd(self.keys.cached(self.consumer), *held)
            self.blocks.journal.clear()
        self.refresh(pipe, self.load(False))

    def load(self, draining: bool) -> tuple:
        self._load = (self.engine.num_unfinished(), draining)
        return self._load

    def take(self, draining: bool) -> Optional[tuple]:
        """This round's changes: (block hashes cached, evicted, the load if it changed)."""
        added = evicted = ()
        if self.blocks is not None and self.blocks.journal:
            last = dict(self.blocks.journal)  # a hash cached then evicted: its last word
            self.blocks.journal.clear()
            added = [h for h, cached in last.items() if cached]
            evicted = [h for h, cached in last.items() if not cached]
        old = self._load
        load = self.load(draining)
        if not added and not evicted and load == old:
            return None
        return added, evicted, load if load != old else None

    def write(self, pipe, changes: tuple) -> None:
        added, evicted, load = changes
        if added:
            pipe.sadd(self.keys.cached(self.consumer), *added)
        if evicted:
            pipe.srem(self.keys.cached(self.consumer), *evicted)
        if load is not None:
            self._write_load(pipe, load)

    def refresh(self, pipe, load: tuple) -> None:
        """With each heartbeat: the keys kept alive, the name in the fleet."""
        self._write_load(pipe, load)
        pipe.sadd(self.keys.fleet, self.consumer)
        pipe.expire(self.keys.cached(self.consumer), self.ttl_s)
        pipe.expire(self.keys.inbox(self.consumer), self.ttl_s)

    def leave(self, pipe) -> None:
        pipe.srem(self.keys.fleet, self.consumer)
        for key in (self.keys.cached, self.keys.load, self.keys.inbox):
            pipe.delete(key(self.consumer))  # one by one: a cluster pipeline wants that

    def _write_load(self, pipe, load: tuple) -> None:
        body = {"unfinished": load[0], "draining": load[1], "max_num_seqs": self.max_num_seqs}
        pipe.set(self.keys.load(self.consumer), msgpack.packb(body), ex=self.ttl_s)


@dataclass
class _Peer:
    name: str
    load: int      # unfinished sequences, plus entries routed to it since it said so
    capacity: float
    excess: int    # beyond the router's own load


class Router:
    """Places entries read from the shared stream (module docstring); runs on the reader
    thread. ``holds(h)``: whether this worker's own prefix cache holds block hash h."""

    def __init__(self, redis, keys: Keys, consumer: str, block_size: int,
                 holds: Callable[[int], bool], own_load: Callable[[], int],
                 config: RouteConfig = RouteConfig()):
        self.redis, self.keys, self.consumer = redis, keys, consumer
        self.block_size, self.holds, self.own_load = block_size, holds, own_load
        self.min_gain_blocks = max(1, math.ceil(config.min_gain_tokens / block_size))
        self.max_load, self.max_excess = config.max_load, config.max_excess
        self._names: list[str] = []
        self._names_at = -math.inf
        self._routed: dict[str, tuple[bytes, int]] = {}  # peer: (its load report, routed since)

    def place(self, requests: list) -> dict[str, str]:
        """{entry ID: peer} for the (entry ID, Request) pairs that should go elsewhere."""
        wanted = [(entry_id, hashes) for entry_id, req in requests
                  if len(hashes := self._hashes(req)) >= self.min_gain_blocks]
        if not wanted:
            return {}
        try:
            names = self._fleet()
            if not names:
                return {}
            pipe = self.redis.pipeline(transaction=False)
            for n in names:
                pipe.get(self.keys.load(n))
            for _, hashes in wanted:
                for n in names:
                    pipe.smismember(self.keys.cached(n), hashes)
            replies = pipe.execute()
            loads, held = replies[:len(names)], replies[len(names):]
        except RedisError as e:  # routing only saves work: the entries stay here
            log.debug("event=route_lookup_failed error=%s", e)
            return {}
        peers = self._peers(names, loads)
        own_load = self.own_load()
        places = {}
        for i, (entry_id, hashes) in enumerate(wanted):
            peer = self._best(peers, names, held[i * len(names):(i + 1) * len(names)], hashes,
                              own_load)
            if peer is None:
                own_load += 1
            else:
                places[entry_id] = peer.name
                peer.load += 1
                report, routed = self._routed[peer.name]
                self._routed[peer.name] = (report, routed + 1)
        return places

    def _hashes(self, req) -> list[int]:
        prompt = req.prompt
        if not isinstance(prompt, list) or req.params.prompt_logprobs is not None:
            return []  # untokenized (no tokenizer here), or computed whole anyway
        return prompt_hashes(prompt[:MAX_LOOKUP_BLOCKS * self.block_size + 1], self.block_size)

    def _best(self, peers: dict, names: list[str], held: list, hashes: list[int],
              own_load: int):
        own = _leading(self.holds(h) for h in hashes)
        best, best_blocks = None, own + self.min_gain_blocks - 1
        for name, members in zip(names, held):
            peer = peers.get(name)
            if peer is None or peer.load >= peer.capacity or peer.load > own_load + peer.excess:
                continue
            blocks = _leading(members)
            if blocks > best_blocks or (best is not None and blocks == best_blocks
                                        and peer.load < best.load):
                best, best_blocks = peer, blocks
        return best

    def _fleet(self) -> list[str]:
        now = time.monotonic()
        if now - self._names_at >= FLEET_EVERY_S:
            names = self.redis.smembers(self.keys.fleet)
            self._names = sorted(n.decode() for n in names if n.decode() != self.consumer)
            self._names_at = now
        return self._names

    def _peers(self, names: list[str], loads: list) -> dict[str, _Peer]:
        """The live peers (a load key that expired is a dead or paused worker), not draining."""
        peers, gone = {}, []
        for name, raw in zip(names, loads):
            if raw is None:
                gone.append(name)
                continue
            load = msgpack.unpackb(raw)
            if load["draining"]:
                continue
            report, routed = self._routed.get(name, (b"", 0))
            if report != raw:  # a fresh report counts what was routed to it before
                routed = 0
            self._routed[name] = (raw, routed)
            excess = self.max_excess
            if excess is None:
                excess = max(2, load["max_num_seqs"] // 8)
            peers[name] = _Peer(name, load["unfinished"] + routed,
                                load["max_num_seqs"] * self.max_load, excess)
        if gone:  # a live worker puts its name back with its next heartbeat
            self.redis.srem(self.keys.fleet, *gone)
        return peers


def forward(pipe, keys: Keys, group: str, consumer: str, entry_id: str, fields: dict,
            peer: str, ttl_s: int) -> None:
    """Queue the hand-over of an entry this worker owns to ``peer`` (FORWARD_SCRIPT)."""
    flat = [x for kv in fields.items() for x in kv]
    pipe.execute_command("EVAL", FORWARD_SCRIPT, 2, keys.requests, keys.inbox(peer), group,
                         consumer, entry_id, peer, ttl_s, *flat)


def from_inbox(fields: dict) -> tuple[Optional[str], dict]:
    """(the request entry's ID, its own fields) of an inbox entry."""
    entry_id = fields.get(INBOX_ENTRY_FIELD)
    rest = {k: v for k, v in fields.items() if k != INBOX_ENTRY_FIELD}
    return (entry_id.decode() if entry_id is not None else None), rest


def _leading(flags) -> int:
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n
