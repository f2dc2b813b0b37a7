"""The Redis worker: pulls requests through a consumer group, steps the engine, publishes chunks.

One loop iteration is one engine step and one Redis round trip: a single pipeline carries
the step's writes (chunks, acks, the heartbeat), reads new cancels, refreshes its claim
on its in-flight entries when due, and reads as many new requests as there are free
slots, blocking only while the engine is idle. The round trip, and turning the step's
outputs into chunks, happen on the outbox's sender thread while the loop runs the next
step; the loop admits what the reads brought once they are back (outbox.py; reads.py says
what a round reads). A few times per claim period, a worker with free slots also claims
abandoned entries.

The guarantees (docs/operations.md): a request entry is acknowledged only together with
its final chunk; a live worker keeps its entries, a dead one's are claimed and resumed
from their reply streams; an entry delivered too often goes to P:dead; Redis outages
are waited out; SIGTERM drains.
"""
from __future__ import annotations

import logging
import math
import os
import socket
import sys
import time
from collections import OrderedDict
from typing import Optional

from redis import Redis
from redis.exceptions import ResponseError

from roseinfer.core.errors import InvalidRequestError
from roseinfer.frontends.redis_streams import engine_health
from roseinfer.frontends.redis_streams.admission import Admission
from roseinfer.frontends.redis_streams.claims import Claims
from roseinfer.frontends.redis_streams.connection import follow_slots, is_cluster
from roseinfer.frontends.redis_streams.events import event, log
from roseinfer.frontends.redis_streams.adapters import Adapters
from roseinfer.frontends.redis_streams.heartbeat import Heartbeat
from roseinfer.frontends.redis_streams import inbox
from roseinfer.frontends.redis_streams.inflight import InFlight
from roseinfer.frontends.redis_streams.lanes import Backlog
from roseinfer.frontends.redis_streams.metrics import Metrics
from roseinfer.frontends.redis_streams.outage import GaveUp, Outage
from roseinfer.frontends.redis_streams.outbox import Outbox
from roseinfer.frontends.redis_streams.ownership import Ownership
from roseinfer.frontends.redis_streams.pace import Pace
from roseinfer.frontends.redis_streams.publisher import Publisher
from roseinfer.frontends.redis_streams.reads import ReadPlan, Reads, RoundReads
from roseinfer.frontends.redis_streams.request_entry import queued_at, reply_rid
from roseinfer.frontends.redis_streams.protocol import (
    DEFAULT_GROUP, DEFAULT_PREFIX, Keys, Limits, error_chunk)
from roseinfer.frontends.redis_streams.routing import CacheReport, RouteConfig, Router
from roseinfer.frontends.redis_streams.takeover import Takeover

# Cancels of requests this worker has not read yet: remembered so that a request cancelled
# while still queued is aborted as soon as it arrives. Bounded: old ones fall out first.
MAX_REMEMBERED_CANCELS = 10_000
# GIL hand-over while the worker runs: see run(). (docs/benchmarks.md, "Through Redis")
STEP_LOOP_SWITCH_INTERVAL_S = 0.0005
# How long a busy worker with free slots waits for the read it just sent, so that the
# entries it brings are launched in the next step rather than the one after: the device
# runs the step just launched meanwhile (docs/benchmarks.md, "Reading every step").
READ_WAIT_S = 0.002
# A full worker still reads new entries until this many wait in its engine's queue: a
# malformed or oversized one is refused at once, not after the requests ahead of it finish
# (9.7 s for the last of 12 behind 8 running requests of 64 tokens on the CPU, with none).
# A valid one starts here when a slot frees; in a fleet, a peer with room might have
# started it sooner: few, so that a full worker holds back little from its peers.
QUEUED_PAST_SLOTS = 8


def default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class EngineFailed(RuntimeError):
    """engine.step() failed and the engine could not serve even a one-token probe after."""


class Worker:
    """Serves one engine from Redis: ``Worker(llm.engine, Redis.from_url(url)).run()``.

    run() owns the engine until stop(); keep block_ms under the Redis client's
    socket_timeout, if it has one.
    """

    def __init__(self, engine, redis: Redis, *, prefix: str = DEFAULT_PREFIX,
                 group: str = DEFAULT_GROUP, consumer: Optional[str] = None,
                 block_ms: int = 1000, grace_s: float = 30.0, claim_idle_ms: int = 30_000,
                 max_deliveries: int = 5, heartbeat_s: float = 5.0,
                 metrics: Optional[Metrics] = None, reply_ttl_s: int = 3600,
                 reply_maxlen: int = 100_000, progress_every_s: float = 10.0,
                 chat_template: bool = True, model_name: str = "", send_thread: bool = True,
                 max_entry_bytes: int = Limits.max_entry_bytes, ack_replicas: int = 0,
                 ack_timeout_ms: int = 1000, route: Optional[RouteConfig] = RouteConfig()):
        if claim_idle_ms < 100:
            raise ValueError(f"claim_idle_ms must be at least 100, got {claim_idle_ms}")
        if max_deliveries < 1:
            raise ValueError(f"max_deliveries must be at least 1, got {max_deliveries}")
        self.engine = engine
        self.redis = redis
        self.keys = Keys(prefix)
        self.group = group
        self.consumer = consumer or default_consumer_name()
        self.block_ms = block_ms            # also bounds how long stop() takes when idle
        self.grace_s = grace_s
        # Chat models answer sensibly only inside their template; raw text is for base models.
        self.admission = Admission(engine, chat_template, max_entry_bytes)
        self.metrics = metrics or Metrics(model_name)
        self.ownership = Ownership(self.keys, group, self.consumer, claim_idle_ms)
        self.heartbeat = Heartbeat(self.keys, self.consumer, heartbeat_s, model=model_name,
                                   max_num_seqs=engine.config.max_num_seqs,
                                   tasks=list(getattr(engine, "tasks", ("generate",))))
        self.outage = Outage(self._past_deadline, self.metrics.redis_outages.inc,
                             before_retry=lambda: follow_slots(self.redis))
        # Far above any request's chunk count, reply_maxlen only guards Redis against a runaway.
        # send_thread: chunks go out while the next step runs (off only for step-by-step tests).
        # ack_replicas: a finished request leaves the queue only once that many replicas
        # hold its chunks (outbox.py; docs/operations.md says what it costs).
        # The fence: a chunk or ack lands only while its entry is this worker's (ownership.py).
        self.outbox = Outbox(redis, self.outage, self.ownership.fence(is_cluster(redis)),
                             reply_ttl_s, reply_maxlen, self.ownership.ack, send_thread,
                             ack_replicas, ack_timeout_ms)
        # Refreshing four times per claim period keeps a live worker's entries far from it.
        self._tick_s = claim_idle_ms / 4000
        self._next_refresh = 0.0
        self._inflight: dict[str, InFlight] = {}
        self.claims = Claims(self, max_deliveries, self._tick_s)
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        self._stop_at: Optional[float] = None
        self._engine_failure: Optional[BaseException] = None
        self.publisher = Publisher(self.keys, self.metrics)
        self._totals = self.publisher.totals
        self.pace = Pace(progress_every_s, claim_idle_ms, self._totals)
        self.backlog = Backlog(self.keys, group, getattr(engine.config, "priority_aging_s", 10.0))
        self.report = self.router = self.inbox = None
        if route is not None:  # None: every entry read here is served here (routing.py)
            self._route(route)
        self.reads = Reads(self.keys, group, self.consumer, self.ownership, self.backlog,
                           self.admission, self.router, self.inbox)
        # LoRA adapters loaded and unloaded while it runs (adapters.py)
        self.adapters = Adapters(engine) if getattr(engine, "loras", None) is not None else None

    def _route(self, route: RouteConfig) -> None:
        """The cache report, the inbox and (with a prefix cache) the router."""
        engine, redis = self.engine, self.redis
        # Its keys outlive a heartbeat missed while the worker blocks on an idle read.
        ttl_s = self.heartbeat.ttl_s + math.ceil(self.block_ms / 1000)
        self.report = CacheReport(self.keys, self.consumer, engine, ttl_s)
        self.inbox = inbox.Inbox(redis, self.keys, self.group, self.consumer, ttl_s)
        if self.report.blocks:
            report = self.report
            self.router = Router(redis, self.keys, self.consumer, engine.config.block_size,
                                 report.blocks.cached.__contains__, engine.num_unfinished,
                                 route, lambda: report.forecast)

    # --- lifecycle ----------------------------------------------------------------------

    def setup(self) -> None:
        self.outage.call(self._ensure_group)
        # Cancels sent before this worker started concern requests it cannot own yet.
        last = self.outage.call(lambda: self.redis.xrevrange(self.keys.cancel, count=1))
        self.reads.cancel_cursor = last[0][0] if last else "0-0"
        if carried := self.outage.call(lambda: self.backlog.carry_over(self.redis)):
            event("carried_over", consumer=self.consumer, entries=carried,
                  note="from the backlog's old key: clients should add to " + self.keys.backlog)
        if self.report is not None:
            self.outage.call(lambda: self.outbox.send(self.report.join))
        if self.adapters is not None:  # what was loaded before this worker came
            loaded = self.outage.call(lambda: self.redis.xrange(self.keys.adapters))
            self.adapters.apply(loaded)
            self.reads.adapter_cursor = loaded[-1][0] if loaded else "0-0"
        event("started", consumer=self.consumer, stream=self.keys.requests, group=self.group,
              max_num_seqs=self.engine.config.max_num_seqs,
              claim_idle_ms=self.ownership.claim_idle_ms,
              max_deliveries=self.claims.max_deliveries)

    def run(self) -> None:
        """Serve until stop() was called and the in-flight requests finished (or grace ran
        out); what did not finish is handed back to the other workers. Raises EngineFailed
        when the engine broke (after handing its requests back)."""
        # The step loop shares the GIL with the outbox's threads. When a GPU step ends,
        # the loop must get it back at once to launch the next one: with Python's default
        # 5 ms switch interval it could wait that long behind the chunk work.
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(switch_interval, STEP_LOOP_SWITCH_INTERVAL_S))
        try:
            self.setup()
            while not self._stopped():
                self.run_once()
            self._leave()
        except GaveUp as e:
            event("stopped", logging.WARNING, consumer=self.consumer, reason=str(e),
                  unfinished=len(self._inflight), note="unfinished entries stay pending")
            return
        finally:
            self.outbox.stop()
            sys.setswitchinterval(switch_interval)
        if self._engine_failure is not None:
            raise EngineFailed("the engine failed a step and then a one-token probe; "
                               "restart this worker") from self._engine_failure

    def stop(self, grace_s: Optional[float] = None) -> None:
        """Stop reading new requests; in-flight ones get grace_s seconds to finish. Thread-safe."""
        self._stop_at = time.monotonic() + (self.grace_s if grace_s is None else grace_s)

    @property
    def stopping(self) -> bool:
        return self._stop_at is not None

    def _past_deadline(self) -> bool:
        return self.stopping and time.monotonic() >= self._stop_at

    def _stopped(self) -> bool:
        if self._engine_failure is not None:
            return True
        return self.stopping and (not (self._inflight or self.outbox.reads_out)
                                  or self._past_deadline())

    def _leave(self) -> None:
        self.outbox.send()
        self.outbox.deliver()  # entries read just before the stop are handed back too
        unfinished = len(self._inflight) + len(self.claims.suspects)
        self._hand_back_all()
        self.outbox.write(self.heartbeat.remove)
        if self.inbox is not None:
            self._hand_back_inbox()
            self.outbox.write(self.report.leave)
        self.outbox.send()
        self._forget_consumer_if_idle()
        event("stopped", consumer=self.consumer, handed_back=unfinished)

    def run_once(self) -> None:
        started = time.monotonic()
        if self.engine.has_unfinished():
            self._step()
        stepped = time.monotonic()
        self.claims.start_suspect(not (self._inflight or self.engine.has_unfinished()
                                        or self.stopping))
        if self.claims.due(self._free_slots()):
            self.claims.claim(self._free_slots())
        self._exchange()
        self.pace.log_progress(self.engine, len(self._inflight))
        self.pace.warn_if_slow(started, stepped, len(self._inflight))

    # --- Redis round trips --------------------------------------------------------------

    def _exchange(self) -> None:
        """Act on the reads that are back, then post this iteration's round trip (with reads
        unless earlier ones are still out); waiting for its reads when the engine is idle.
        Reads back before the post are acted on first, so that a busy worker reads every
        step: acted on after the post, they came back a step later, and the next read
        went out only then (every other step)."""
        busy = self.engine.has_unfinished()
        if busy:
            self.outbox.deliver()
        if self.heartbeat.due():
            status = "draining" if self.stopping else "serving"
            self.outbox.write(self.heartbeat.write, status, **self._live_status())
            if self.report is not None:
                self.outbox.write(self.report.refresh, self.report.load(self.stopping))
        changes = self.report.take(self.stopping) if self.report is not None else None
        if changes is not None:
            self.outbox.write(self.report.write, changes)
        if self.outbox.reads_out:
            self.outbox.post()
        else:
            plan = self._plan()
            self.outbox.post(lambda pipe: self.reads.add(pipe, plan),
                             lambda reads, at: self._on_reads(plan, reads, at),
                             lambda replies: self.reads.parse(plan, replies))
            if busy and plan.slots and plan.open:
                self.outbox.deliver(within=READ_WAIT_S)
                return
        self.outbox.deliver(wait=not self.engine.has_unfinished())

    def _on_reads(self, plan: ReadPlan, reads: RoundReads, confirmed_at: float) -> None:
        """Cancels first, then new entries; ownership lost or kept."""
        read_again = {entry_id for entry_id, _, _ in reads.decoded}
        self._keep_or_drop(plan.owned, reads.refreshed, confirmed_at, read_again)
        self.reads.advance(reads.cancels, reads.adapters)
        if reads.adapters:
            self.adapters.apply(reads.adapters)
            self.heartbeat.soon()  # whoever asked waits for it to say so
        for _, f in reads.cancels:
            if b"rid" in f:
                self._cancel(f[b"rid"].decode(errors="replace"))
        if reads.request_read and self._readable(reads.request_read[0]):
            if reads.inbox_ids:
                self.outbox.write(self.inbox.done, reads.inbox_ids)
            for entry_id, fields, request in reads.decoded:
                if entry_id is None:
                    continue  # not an inbox entry of this version: nothing to serve
                if entry_id in reads.places:
                    self._routed(entry_id, reads.places[entry_id])
                elif any(t.entry_id == entry_id for t in self.claims.suspects):
                    continue  # kept above: it runs alone in its turn
                else:
                    self._admit(entry_id, fields, request=request)

    def _plan(self) -> ReadPlan:
        now = time.monotonic()
        owned = []
        suspects = self.claims.suspects
        if now >= self._next_refresh and (self._inflight or suspects):
            self._next_refresh = now + self._tick_s
            owned = [*self._inflight.values(), *suspects]
        idle = not (self.engine.has_unfinished() or suspects)
        is_open = not self._closed()
        return ReadPlan(owned, self._read_slots(), self.block_ms if idle else None,
                     is_open, self._free_slots(), is_open and self.backlog.due())

    def _readable(self, reply) -> bool:
        if isinstance(reply, ResponseError) and str(reply).startswith("NOGROUP"):
            event("group_recreated", logging.WARNING, stream=self.keys.requests,
                  reason="the stream or its group vanished (was Redis flushed?)")
            self.outage.call(self._ensure_group)
            return False
        if isinstance(reply, Exception):
            raise reply
        return True

    def _ensure_group(self) -> None:
        streams = [self.keys.requests]
        if self.inbox is not None:
            streams.append(self.inbox.key)
        for stream in streams:
            try:
                # From id 0: requests queued before the first worker started are served too.
                self.redis.xgroup_create(stream, self.group, id="0", mkstream=True)
            except ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    def _closed(self) -> bool:
        """Taking no new entries: stopping, or a suspect runs alone."""
        return self.stopping or bool(self.claims.suspects) or any(
            f.alone for f in self._inflight.values())

    def _free_slots(self) -> int:
        if self._closed():
            return 0
        return max(0, self.engine.config.max_num_seqs - self.engine.num_unfinished())

    def _read_slots(self) -> int:
        """Free slots, and those of background work (priority > 0), which a request read
        now takes over if it ranks before it (core/scheduler.py); a full worker still
        reads until QUEUED_PAST_SLOTS entries wait in its engine."""
        if self._closed():
            return 0
        background = sum(f.running for f in self._inflight.values() if f.priority > 0)
        slots = self._free_slots() + background
        if slots:
            return slots
        queued = self.engine.num_unfinished() - self.engine.config.max_num_seqs
        return max(0, QUEUED_PAST_SLOTS - queued)

    def _live_status(self) -> dict:
        s = self.engine.stats()
        return {"in_flight": len(self._inflight), "suspects": len(self.claims.suspects),
                "running": s.num_running, "waiting": s.num_waiting,
                "kv_cache_usage": s.kv_cache_usage, "generated_tokens": self._totals["tokens"],
                "finished": self._totals["finished"], "step": self.engine.step_kind,
                **(self.adapters.status() if self.adapters is not None else {})}

    def _forget_consumer_if_idle(self) -> None:
        # Keeps XINFO CONSUMERS to the workers that matter; never while entries are ours.
        mine = self.outage.call(lambda: self.redis.xpending_range(
            self.keys.requests, self.group, "-", "+", 1, consumername=self.consumer))
        if not mine:
            self.outage.call(lambda: self.redis.xgroup_delconsumer(
                self.keys.requests, self.group, self.consumer))

    # --- ownership ----------------------------------------------------------------------

    def _keep_or_drop(self, owned: list, replies: list, confirmed_at: float,
                      read_again: set) -> None:
        """confirmed_at: after Redis ran the refresh, so never too early. ``read_again``:
        the entries this round read as new. A failed-over Redis that lost an entry's
        delivery fails its refresh and delivers it again, here: it is this worker's still
        (dropped, it came back as a new request with the rid still in use, and ended in
        an error chunk of seq 0 that its client dropped as seen). Its chunks written
        before the read were fenced off (not this worker's then): they go again."""
        for o, kept in zip(owned, Ownership.kept(replies)):
            if not kept and o.entry_id in read_again:
                self.outbox.replay()  # its chunks since the failover were fenced off
                kept = True
            if kept:
                o.refreshed_at = confirmed_at
            else:
                self._drop(o)

    def _drop(self, o) -> None:
        """Another worker claimed the entry (this one stalled past the claim threshold), or
        it was acknowledged: stop serving it, silently, since its client is served."""
        if isinstance(o, Takeover):
            if not self.claims.drop(o):
                return  # started meanwhile: its InFlight is refreshed from now on
        else:
            if self._inflight.get(o.rid) is not o:
                return  # finished meanwhile
            del self._inflight[o.rid]
            self.engine.abort(o.rid)  # its "abort" output is ignored: the rid is not ours
        event("ownership_lost", logging.WARNING, rid=o.rid, entry=o.entry_id,
              reason="claimed by another worker, or acknowledged")

    def _routed(self, entry_id: str, peer: str) -> None:
        self.metrics.routed.inc()
        event("routed", entry=entry_id, to=peer)

    def _hand_back_inbox(self) -> None:
        """Entries handed here that were not read yet: back to the group, claimable at once."""
        left = self.inbox.leftovers(self.outage)
        for _, entry_id in left:
            if entry_id is not None:
                self.outbox.write(self.ownership.hand_back, entry_id, 1, False)
        if left:
            self.outbox.write(self.inbox.done, [i for i, _ in left])

    def _hand_back_all(self) -> None:
        """Give every unfinished entry back to the group, not counted as a delivery."""
        if self._engine_failure is None:
            engine_health.abandon(self.engine, list(self._inflight))
        for f in self._inflight.values():
            self.outbox.write(self.ownership.hand_back, f.entry_id, f.deliveries, False)
        self.claims.hand_back(self.outbox.write)
        self._inflight.clear()

    # --- the engine ---------------------------------------------------------------------

    def _step(self) -> None:
        started = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as e:  # the batch fails, not the worker
            self._on_step_failure(e)
            return
        ours = []
        for out in outputs:
            f = self._inflight.get(out.request_id)
            if f is None:
                continue  # a request handed back or owned elsewhere now: not ours to publish
            last = False
            if out.finished:
                # an error ends every sample's stream with its chunk (its samples all fail)
                f.running = 0 if out.finish_reason == "error" else f.running - 1
                last = f.running == 0
                if last:
                    del self._inflight[f.rid]
            ours.append((f, out, last))
        self.outbox.later(lambda rnd: self.publisher.outputs(rnd, ours))
        if self.report is not None:
            self.report.observe()
        stats = self.engine.stats()
        self.metrics.engine_stats(stats)
        event("step", logging.DEBUG, outputs=len(outputs), running=stats.num_running,
              waiting=stats.num_waiting, step_ms=1000 * (time.monotonic() - started))

    def _on_step_failure(self, error: Exception) -> None:
        """Hand the batch back: its entries are claimed again (here or elsewhere), each claim
        a delivery, so a request that keeps failing steps ends in P:dead. Unless the engine
        itself is broken (it fails a one-token probe): then nobody's delivery counts, and
        the worker stops so that its supervisor restarts it."""
        log.error("event=step_failed in_flight=%d rids=%s", len(self._inflight),
                  ",".join(self._inflight), exc_info=error)
        self.metrics.step_failures.inc()
        healthy = engine_health.works_after_failure(self.engine, list(self._inflight))
        for f in self._inflight.values():
            self.outbox.write(self.ownership.hand_back, f.entry_id, f.deliveries, healthy)
        event("handed_back", logging.WARNING, count=len(self._inflight), counted=healthy)
        self._inflight.clear()
        if healthy:
            self.claims.now = True  # take them again at once: the ones that run alone tell
        else:
            self._engine_failure = error

    # --- requests -----------------------------------------------------------------------

    def _admit(self, entry_id: str, fields: dict, resume: Optional[Takeover] = None,
               request=None) -> None:
        """request: the entry already decoded (a Request, or the error decoding it raised)."""
        rid = reply_rid(entry_id, fields)
        seq = resume.next_seq if resume else 0
        emitted_tokens = len(resume.emitted_ids()) if resume else 0
        try:
            req = request or self.admission(entry_id, fields)
            if isinstance(req, Exception):
                raise req
            running_one = self._inflight.get(req.rid)
            if running_one is not None and running_one.entry_id == entry_id:
                # Delivered to this worker again: a failed-over Redis lost the first
                # delivery. It is being served; an error would end its stream.
                event("redelivered", logging.WARNING, rid=req.rid, entry=entry_id,
                      reason="the Redis that delivered it before failed over")
                return
            if running_one is not None:
                rid, seq, emitted_tokens = entry_id, 0, 0  # P:out:{rid} is the running one's
                raise InvalidRequestError("rid", f"{req.rid!r} is already in flight; use a new rid")
            running = self._add(req, resume)
        except InvalidRequestError as e:
            event("rejected", logging.WARNING, rid=rid, entry=entry_id, code=e.code, error=e)
            self._fail(rid, entry_id, e.code, str(e), seq, emitted_tokens)
            return
        except Exception as e:  # an engine bug must cost this request, not the whole worker
            log.exception("event=add_request_failed rid=%s entry=%s", rid, entry_id)
            self._fail(rid, entry_id, "internal", f"{type(e).__name__}: {e}", seq, emitted_tokens)
            return
        deliveries = resume.deliveries if resume else 1
        arrival = queued_at(entry_id, fields)
        self._inflight[req.rid] = InFlight(req.rid, entry_id, req.stream_interval, deliveries,
                                            arrival, resume is not None, seq,
                                            req.params.n, running, req.params.priority,
                                            tools=self.admission.tool_streams(req),
                                            reasoning=self.admission.reasoning_streams(
                                                req, resume and resume.emitted_ids))
        if resume:
            self.metrics.resumed.inc()
            event("resumed", rid=req.rid, entry=entry_id, seq=seq, emitted_tokens=emitted_tokens,
                  deliveries=deliveries)
        else:
            queue_s = max(0.0, time.time() - arrival)
            self.metrics.queue_time.observe(queue_s)
            event("admitted", rid=req.rid, entry=entry_id, queue_s=queue_s)
        if req.rid in self._cancelled:
            del self._cancelled[req.rid]
            self._cancel(req.rid)

    def _add(self, req, resume: Optional[Takeover]) -> int:
        """The request into the engine, a resumed one from where its reply stream stops;
        returns how many of its samples run."""
        # only where asked: an engine without adapters need not know the keyword
        adapter = {} if req.lora is None else {"lora": req.lora}
        if resume is None:
            self.engine.add_request(req.rid, req.prompt, req.params, **adapter)
            return req.params.n
        # A split output's chunks are not its text: all its tokens' text counts as handed
        # out, and the reasoning streams pick up from it (Admission.reasoning_streams).
        split = req.reasoning_inside is not None
        if req.params.n == 1:
            self.engine.add_request(req.rid, req.prompt, req.params, **adapter,
                                    emitted_ids=resume.emitted_ids(),
                                    emitted_text=None if split else resume.text())
            return 1
        left = [i for i in range(req.params.n) if i not in resume.finished_indexes]
        self.engine.add_request(req.rid, req.prompt, req.params, indexes=left, **adapter,
                                emitted_ids={i: resume.emitted_ids(i) for i in left},
                                emitted_text={} if split else {i: resume.text(i) for i in left})
        return len(left)

    def _fail(self, rid: str, entry_id: str, code: str, message: str, seq: int,
              completion_tokens: int) -> None:
        self.publisher.publish(self.outbox.round,
                               error_chunk(rid, code, message, seq, completion_tokens), entry_id,
                               final=True)
        self.metrics.finished("error")

    def _cancel(self, rid: str) -> None:
        if rid in self._inflight:
            self.engine.abort(rid)  # its "abort" output comes out of the next step
            return
        self._cancelled[rid] = None
        if len(self._cancelled) > MAX_REMEMBERED_CANCELS:
            self._cancelled.popitem(last=False)
