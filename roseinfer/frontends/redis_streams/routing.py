"""Prefix-aware routing: an entry goes to the worker whose prefix cache holds its prompt.

Each worker tells the fleet what it holds and how busy it is (CacheReport, riding the step
loop's own round trips; docs/protocol.md, "Routing"):
- ``cached:C``, a set of the block hashes in its prefix cache (core/blocks.py), changed each
  round by what the block manager's journal says was cached or evicted: never more members
  than the worker has KV blocks;
- ``roots:C``, the first-block hashes of the prompts it cached or reused most recently (a
  list, the newest ROOTS_KEPT);
- ``load:C``, its unfinished sequences and how many roots it has listed, rewritten when
  they change and expiring with its heartbeat, so a dead worker's is gone within three
  heartbeats;
- ``fleet``, the set of worker names.

Each worker mirrors its peers' loads and roots in its own round trips (Router.watch: the
loads, and the roots listed since it last looked). A worker that reads an entry from the
shared stream places it (Router.place, on the reader thread, once the entry is tokenized).
When no peer lists the prompt's first block, it stays here at once: nothing to share costs
no round trip. Else one pipelined round trip asks those peers' sets how many of the
prompt's leading blocks they hold (SMISMEMBER). Then, by predicted time to first token (policy ``ttft``, the default): for this
worker and each holder, the work ahead of the entry there (its prompt tokens still to
compute, and when every seat is taken, the decode steps until one frees), plus the
entry's own uncached tokens, at that worker's measured prefill rate; a peer also costs
the hand-over, a step of each worker. The entry goes where the sum is least. Entries
this router placed since a peer's last report count as that peer's work. Each worker
reports what this reads (``Forecast``) in its load. Where a holder's report is stale
(older than two of its heartbeats) or lacks it, or this worker has not measured its own
rates yet, the prefix rule decides (policy ``prefix``): the peer holding the most, when
that is at least ``min_gain_tokens`` more than this worker holds, unless it is loaded
past a bound: it runs ``max_load`` x its max_num_seqs sequences or more, or more than
``max_excess`` (default: an eighth of its max_num_seqs, at least 2) beyond this worker's
own (SGLang's router balances the same way). Else it stays here.

Handing it over is inbox.py's.
"""
from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

import msgpack
from redis.exceptions import RedisError

from roseinfer.core.blocks import prompt_hashes, root_hash
from roseinfer.core.errors import ConfigError
from roseinfer.frontends.redis_streams.protocol import Keys

log = logging.getLogger("roseinfer.worker")

FLEET_EVERY_S = 1.0        # how often a router rereads the fleet's names
WATCH_EVERY_S = 0.01       # at most this often a round trip carries the mirror's reads
ROOTS_KEPT = 4096          # first blocks a worker lists, and a mirror keeps per peer
MAX_LOOKUP_BLOCKS = 512    # prompt blocks looked up per entry (8,192 tokens of 16)

RATE_WEIGHT = 0.2          # of each new measurement in a worker's running step and rate
MIN_RATE_TOKENS = 32       # prompt tokens a step computes for its time to count as a rate


@dataclass(frozen=True)
class RouteConfig:
    min_gain_tokens: int = 128  # a peer must hold this many more prompt tokens than we do
    max_load: float = 1.0       # x max_num_seqs: a peer at or past it gets nothing
    max_excess: Optional[int] = None  # sequences a peer may run beyond ours; None: auto
    policy: str = "ttft"        # or "prefix": the prefix rule alone

    def __post_init__(self):
        if self.policy not in ("ttft", "prefix"):
            raise ConfigError(f"route_policy must be ttft or prefix, not {self.policy!r}")


@dataclass(frozen=True)
class Forecast:
    """What predicting a request's time to first token at a worker reads."""
    running: int          # sequences holding a seat
    max_num_seqs: int
    backlog_tokens: int   # prompt tokens still to compute, of every unfinished sequence
    free_in_steps: int    # all seats taken: decode steps until one frees; else 0
    step_s: float         # a decode step, as measured lately
    prefill_tps: float    # prompt tokens a second, as measured lately

    def ttft(self, tokens: int, more_seqs: int = 0, more_tokens: int = 0) -> float:
        """Seconds until a request of ``tokens`` uncached prompt tokens, arriving behind
        ``more_seqs`` sequences of ``more_tokens`` not in this forecast yet, has its
        first token here."""
        wait = (self.backlog_tokens + more_tokens + tokens) / self.prefill_tps
        if self.running + more_seqs >= self.max_num_seqs:
            wait += max(1, self.free_in_steps) * self.step_s
        return wait

    def body(self) -> list:
        """As reported: rounded to what moves a prediction (two significant figures, whole
        blocks of 16 tokens), so that a busy worker rewrites its load only when it moves
        by that much, not every round."""
        return [self.running, _rounded(self.backlog_tokens, 16), self.free_in_steps,
                float(f"{self.step_s:.2g}"), float(f"{self.prefill_tps:.2g}")]

    @staticmethod
    def read(body: Optional[list], max_num_seqs: int) -> Optional["Forecast"]:
        if not body:
            return None
        running, backlog, free_in, step_s, tps = body
        return Forecast(running, max_num_seqs, backlog, free_in, step_s, tps) if tps > 0 \
            else None


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
        self._roots = 0  # first blocks listed since start
        self.heartbeat_s = ttl_s / 3
        self._step_s: Optional[float] = None
        self._prefill_tps: Optional[float] = None
        # what a forecast reads: an engine with a prefix cache (the one routing serves)
        self.scheduler = engine.scheduler if self.blocks is not None else None
        self.forecast: Optional[Forecast] = None  # read by this worker's router too

    def observe(self) -> None:
        """After each engine step (on the step loop): the times of the steps collected
        since (core/step_times.py), with their prompt tokens, into the running step time
        and prefill rate."""
        if self.scheduler is None:
            return
        for tokens, seconds in self.engine.step_times.take():
            if tokens >= MIN_RATE_TOKENS:
                self._prefill_tps = _running(self._prefill_tps, tokens / max(seconds, 1e-6))
            elif seconds > 0:
                self._step_s = _running(self._step_s, seconds)

    def join(self, pipe) -> None:
        """At start: a set of what the cache holds now (after a restart under the same
        name, the old one goes), and the name into the fleet."""
        pipe.delete(self.keys.cached(self.consumer))
        pipe.delete(self.keys.roots(self.consumer))
        if self.blocks is not None:
            held = list(self.blocks.cached)
            if held:
                pipe.sadd(self.keys.cached(self.consumer), *held)
            self.blocks.journal.clear()
        self.refresh(pipe, self.load(False))

    def load(self, draining: bool) -> tuple:
        s = self.scheduler
        forecast = None
        if s is not None and self._step_s is not None and self._prefill_tps is not None:
            backlog, free_in = s.backlog()
            forecast = Forecast(len(s.running), self.max_num_seqs, backlog, free_in,
                                self._step_s, self._prefill_tps)
        self.forecast = forecast
        self._load = (self.engine.num_unfinished(), draining, self._roots,
                      forecast.body() if forecast is not None else None)
        return self._load

    def take(self, draining: bool) -> Optional[tuple]:
        """This round's changes: (block hashes cached, evicted, first blocks cached, the
        load if it changed)."""
        added = evicted = roots = ()
        journal = self.blocks.journal if self.blocks is not None else None
        if journal:
            last = {h: cached for h, cached, _ in journal}  # cached then evicted: its last word
            roots = list(dict.fromkeys(h for h, cached, root in journal if cached and root))
            journal.clear()
            added = [h for h, cached in last.items() if cached]
            evicted = [h for h, cached in last.items() if not cached]
            self._roots += len(roots)
        old = self._load
        load = self.load(draining)
        if not added and not evicted and load == old:
            return None
        return added, evicted, roots, load if load != old else None

    def write(self, pipe, changes: tuple) -> None:
        added, evicted, roots, load = changes
        if added:
            pipe.sadd(self.keys.cached(self.consumer), *added)
        if evicted:
            pipe.srem(self.keys.cached(self.consumer), *evicted)
        if roots:
            pipe.lpush(self.keys.roots(self.consumer), *roots)
            pipe.ltrim(self.keys.roots(self.consumer), 0, ROOTS_KEPT - 1)
        if load is not None:
            self._write_load(pipe, load)

    def refresh(self, pipe, load: tuple) -> None:
        """With each heartbeat: the keys kept alive, the name in the fleet."""
        self._write_load(pipe, load)
        pipe.sadd(self.keys.fleet, self.consumer)
        for key in (self.keys.cached, self.keys.roots, self.keys.inbox):
            pipe.expire(key(self.consumer), self.ttl_s)

    def leave(self, pipe) -> None:
        pipe.srem(self.keys.fleet, self.consumer)
        for key in (self.keys.cached, self.keys.roots, self.keys.load, self.keys.inbox):
            pipe.delete(key(self.consumer))  # one by one: a cluster pipeline wants that

    def _write_load(self, pipe, load: tuple) -> None:
        body = {"unfinished": load[0], "draining": load[1], "roots": load[2],
                "max_num_seqs": self.max_num_seqs, "forecast": load[3], "at": time.time(),
                "heartbeat_s": self.heartbeat_s}
        pipe.set(self.keys.load(self.consumer), msgpack.packb(body), ex=self.ttl_s)


@dataclass
class _Peer:
    name: str
    load: int      # unfinished sequences, plus entries routed to it since it said so
    capacity: float
    excess: int    # beyond the router's own load
    forecast: Optional[Forecast] = None  # None: stale, or not reported
    routed: int = 0          # entries routed to it since its report
    routed_tokens: int = 0   # their uncached prompt tokens


class Router:
    """Places entries read from the shared stream (module docstring); runs on the reader
    thread. ``holds(h)``: whether this worker's own prefix cache holds block hash h."""

    def __init__(self, redis, keys: Keys, consumer: str, block_size: int,
                 holds: Callable[[int], bool], own_load: Callable[[], int],
                 config: RouteConfig = RouteConfig(),
                 own_forecast: Callable[[], Optional[Forecast]] = lambda: None):
        self.redis, self.keys, self.consumer = redis, keys, consumer
        self.block_size, self.holds, self.own_load = block_size, holds, own_load
        self.own_forecast = own_forecast if config.policy == "ttft" else lambda: None
        self.min_gain_blocks = max(1, math.ceil(config.min_gain_tokens / block_size))
        self.max_load, self.max_excess = config.max_load, config.max_excess
        self._names: list[str] = []
        self._names_at = self._watch_at = -math.inf
        self._loads: dict[str, dict] = {}        # peer: its load, as last read
        self._routed: dict[str, int] = {}        # peer: entries routed to it since then
        self._routed_tokens: dict[str, int] = {}  # peer: their uncached prompt tokens
        self._roots: dict[str, tuple[int, OrderedDict]] = {}  # peer: (roots read, newest)
        self._gone: list[str] = []
        self._asked: list[tuple] = []

    # --- the mirror, in the worker's round trips -----------------------------------------

    def watch(self, pipe) -> int:
        """Queue the reads that keep the mirror fresh: the fleet's names (each second), the
        peers' loads, and the roots each listed since the last look. Returns how many
        replies watched() takes; none when it looked less than WATCH_EVERY_S ago."""
        now = time.monotonic()
        self._asked = []
        if now - self._watch_at < WATCH_EVERY_S:
            return 0
        self._watch_at = now
        if self._gone:
            pipe.srem(self.keys.fleet, *self._gone)  # a live one puts its name back
            self._asked.append(("gone", None, 0))
            self._gone = []
        if now - self._names_at >= FLEET_EVERY_S:
            self._names_at = now
            pipe.smembers(self.keys.fleet)
            self._asked.append(("fleet", None, 0))
        for name in self._names:
            pipe.get(self.keys.load(name))
            self._asked.append(("load", name, 0))
            listed = self._loads.get(name, {}).get("roots", 0)
            read = self._roots.get(name, (0, None))[0]
            if listed > read:
                pipe.lrange(self.keys.roots(name), 0, min(listed - read, ROOTS_KEPT) - 1)
                self._asked.append(("roots", name, listed))
        return len(self._asked)

    def watched(self, replies: list) -> None:
        for (kind, name, listed), reply in zip(self._asked, replies):
            if isinstance(reply, Exception):
                continue
            if kind == "fleet":
                self._names = sorted(n.decode() for n in reply if n.decode() != self.consumer)
                for gone in set(self._loads) - set(self._names):  # left the fleet
                    self._loads.pop(gone)
                    self._roots.pop(gone, None)
            elif kind == "load":
                self._load_read(name, reply)
            elif kind == "roots":
                self._roots_read(name, listed, reply)

    def _load_read(self, name: str, raw: Optional[bytes]) -> None:
        if raw is None:  # its load expired: dead, or paused past its heartbeats
            self._loads.pop(name, None)
            self._roots.pop(name, None)
            self._gone.append(name)
            return
        load = msgpack.unpackb(raw)
        if {**load, "at": 0} != {**self._loads.get(name, {}), "at": 0}:
            # a fresh report counts what was routed to it before
            self._routed[name] = self._routed_tokens[name] = 0
        if load["roots"] < self._roots.get(name, (0, None))[0]:
            self._roots.pop(name, None)  # restarted under the same name
        self._loads[name] = load

    def _roots_read(self, name: str, listed: int, newest_first: list) -> None:
        read, roots = self._roots.get(name, (0, OrderedDict()))
        for h in reversed(newest_first):
            roots[int(h)] = None
            roots.move_to_end(int(h))
        while len(roots) > ROOTS_KEPT:
            roots.popitem(last=False)
        self._roots[name] = (listed, roots)

    # --- placing entries -----------------------------------------------------------------

    def place(self, requests: list) -> dict[str, str]:
        """{entry ID: peer} for the (entry ID, Request) pairs that should go elsewhere."""
        peers = self._peers()
        wanted = []
        for entry_id, req in requests:
            hashes = self._hashes(req)
            holders = [p for p in peers if hashes and hashes[0] in self._roots[p.name][1]]
            if len(hashes) >= self.min_gain_blocks and holders:
                wanted.append((entry_id, hashes, holders, len(req.prompt)))
        if not wanted:
            return {}
        try:
            pipe = self.redis.pipeline(transaction=False)
            for _, hashes, holders, _ in wanted:
                for p in holders:
                    pipe.smismember(self.keys.cached(p.name), hashes)
            held = iter(pipe.execute())
        except RedisError as e:  # routing only saves work: the entries stay here
            log.debug("event=route_lookup_failed error=%s", e)
            return {}
        own = _Peer(self.consumer, self.own_load(), math.inf, 0, self.own_forecast())
        places = {}
        for entry_id, hashes, holders, tokens in wanted:
            # (holder, the prompt tokens it holds), and this worker's
            held_here = [(p, _leading(next(held)) * self.block_size) for p in holders]
            mine = _leading(self.holds(h) for h in hashes) * self.block_size
            if own.forecast is not None and all(p.forecast for p, _ in held_here):
                peer, cached = self._fastest(own, held_here, tokens, mine)
            else:
                peer, cached = self._best(held_here, mine, own.load)
            uncached = tokens - cached
            taker = own if peer is None else peer
            taker.load += 1
            taker.routed += 1
            taker.routed_tokens += uncached
            if peer is not None:
                places[entry_id] = peer.name
                self._routed[peer.name] += 1
                self._routed_tokens[peer.name] += uncached
        return places

    def _hashes(self, req) -> list[int]:
        prompt = req.prompt
        if not isinstance(prompt, list) or req.params.prompt_logprobs is not None:
            return []  # untokenized (no tokenizer here), or computed whole anyway
        # an adapter's blocks are its own (core/blocks.py): a holder of them holds it too
        return prompt_hashes(prompt[:MAX_LOOKUP_BLOCKS * self.block_size + 1], self.block_size,
                             root_hash(req.lora))

    def _fastest(self, own: _Peer, held: list, tokens: int,
                 mine: int) -> tuple[Optional[_Peer], int]:
        """(the holder with the least predicted TTFT, or None for here; the prompt
        tokens it holds). ``held``: (holder, tokens it holds); ``mine``: held here."""
        def at(worker: _Peer, cached: int) -> float:
            return worker.forecast.ttft(tokens - cached, worker.routed, worker.routed_tokens)
        best, best_s, best_cached = None, at(own, mine), mine
        for peer, cached in held:
            seconds = at(peer, cached) + own.forecast.step_s + peer.forecast.step_s
            if seconds < best_s:
                best, best_s, best_cached = peer, seconds, cached
        return best, best_cached

    def _best(self, held: list, mine: int, own_load: int) -> tuple[Optional[_Peer], int]:
        """The prefix rule (module doc), as ``_fastest`` answers."""
        best, best_cached = None, mine + (self.min_gain_blocks - 1) * self.block_size
        for peer, cached in held:
            if peer.load >= peer.capacity or peer.load > own_load + peer.excess:
                continue
            if cached > best_cached or (best is not None and cached == best_cached
                                        and peer.load < best.load):
                best, best_cached = peer, cached
        return best, best_cached if best is not None else mine

    def _peers(self) -> list[_Peer]:
        """The live peers that are not draining, as last read, with what was routed since."""
        peers = []
        for name, load in self._loads.items():
            if load["draining"] or name not in self._roots:
                continue
            excess = self.max_excess
            if excess is None:
                excess = max(2, load["max_num_seqs"] // 8)
            forecast = None
            if time.time() - load.get("at", 0) <= 2 * load.get("heartbeat_s", 0):
                forecast = Forecast.read(load.get("forecast"), load["max_num_seqs"])
            routed = self._routed.get(name, 0)
            peers.append(_Peer(name, load["unfinished"] + routed,
                               load["max_num_seqs"] * self.max_load, excess, forecast,
                               routed, self._routed_tokens.get(name, 0)))
        return peers


def _leading(flags) -> int:
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


def _running(mean: Optional[float], sample: float) -> float:
    return sample if mean is None else (1 - RATE_WEIGHT) * mean + RATE_WEIGHT * sample


def _rounded(n: int, step: int) -> int:
    return (n + step // 2) // step * step
