"""The worker's Redis round trips, sent from a thread of their own, in order, surviving
outages.

Each loop iteration fills one Round: plain writes, reply chunks, and work that turns the
step's engine outputs into chunks. The sender thread runs the round's work and sends it
as one pipeline while the loop goes on to the next engine step. Reads (cancels, new
entries, ownership refreshes) go on a reader thread of their own, so that an idle engine
waits for new entries one round trip, not behind the chunks still being sent; the loop
picks their replies up when they are back. So the step loop never waits on Redis, nor
spends its time on chunks, while the engine is busy. Anything that must see every earlier
round land first (claims, shutdown) waits for both threads. Without them (step-by-step
tests) a round and its reads are sent together when posted, in one round trip.

Reads may pass writes: nothing read depends on a write still queued (an entry that is
acknowledged or handed back in a queued round is no longer refreshed, and new entries
and cancels do not depend on this worker's writes).

A round's chunks travel as script calls, not as an XADD and an EXPIRE per chunk: at a
few hundred running requests, redis-py's per-command packing and parsing was most of the
worker's time per step (docs/benchmarks.md, "Through Redis").

Through an outage the same round goes again until Redis takes it: resending is safe,
since clients drop chunks whose seq they have seen and acks, claims and expiries are
idempotent. After an outage the chunks (and acks) of the last REPLAY_S seconds before it
go again first: a failed-over Redis may have lost what its old primary took but had not
yet replicated, and a client that missed those chunks would see a gap in seq. Rounds sent
after an outage skip, in the script, each chunk whose seq its stream already holds, so
the chunks that survived are not written twice. A request taken over in those seconds counts the chunks
its stream held as this worker's (``vouch``): they were read from the same primary.

With ``ack_replicas`` N > 0 a round that finishes requests puts ``WAIT N timeout``
between its chunks and its acks, in the same pipeline (WAIT counts the writes of its
own connection; the acks run once it returns): a finished request is whole on N
replicas before its entry leaves the queue, however far replication lags. If fewer
confirm within the timeout (no replica up, say: then no failover can lose it either)
the acks go anyway and ``ack_unreplicated`` is logged, and the rounds of the next
UNREPLICATED_REST_S seconds ack without waiting: a missing replica (as after a failover,
until the old primary comes back as one) slows one finishing round in that many seconds
by the timeout instead of stopping the worker or slowing every round.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Callable, Optional

from redis import Redis

from roseinfer.frontends.redis_streams.connection import by_slot, is_cluster
from roseinfer.frontends.redis_streams.events import event
from roseinfer.frontends.redis_streams.outage import Outage, is_transient
from roseinfer.frontends.redis_streams.ownership import OWNER_LUA, Fence

# KEYS: reply streams, then the request stream when fenced. ARGV: expiry (s), approximate
# MAXLEN, group ('' = no fence: on a Redis Cluster the request stream is in another slot),
# consumer, '1' to skip chunks whose seq the stream already holds (after an outage), then
# per chunk its body, its request entry's ID and its seq.
# pcall: a key a client filled with a non-stream value costs its own chunk, not the batch.
# Any other error (OOM, READONLY: Redis full, or a replica) fails the call, which then goes
# again like any transient error; the chunks it added before are dropped by clients as seen.
# Returns the keys that were not streams and the keys whose chunks were fenced off.
PUBLISH_SCRIPT = OWNER_LUA + """
local fenced = ARGV[3] ~= ''
local n = fenced and #KEYS - 1 or #KEYS
local owners, failed, dropped = {}, {}, {}
local function last_seq(key)
  local last = redis.pcall('XREVRANGE', key, '+', '-', 'COUNT', 1)
  if type(last) ~= 'table' or last.err or #last == 0 then return -1 end
  local fields = last[1][2]
  for j = 1, #fields, 2 do
    if fields[j] == 'seq' then return tonumber(fields[j + 1]) end
  end
  return -1
end
for i = 1, n do
  local key, body, entry, seq = KEYS[i], ARGV[3 * i + 3], ARGV[3 * i + 4], ARGV[3 * i + 5]
  if fenced and owners[entry] == nil then
    owners[entry] = owner(KEYS[n + 1], ARGV[3], entry)
  end
  if fenced and owners[entry] ~= ARGV[4] then
    dropped[#dropped + 1] = key
  elseif ARGV[5] ~= '1' or last_seq(key) < tonumber(seq) then
    local reply = redis.pcall('XADD', key, 'MAXLEN', '~', ARGV[2], '*', 'v', '1', 'seq', seq,
                              'body', body)
    if type(reply) == 'table' and reply.err then
      -- The error's own code and text: Redis 6 puts a script position before them.
      local message = string.match(reply.err, '(%u%u+ .-)%s*$') or reply.err
      if string.sub(message, 1, 9) ~= 'WRONGTYPE' then
        return redis.error_reply(message)
      end
      failed[#failed + 1] = key
    else
      redis.pcall('EXPIRE', key, ARGV[1])
    end
  end
end
return {failed, dropped}
"""


# Asynchronous replication lags the primary by milliseconds when healthy; chunks older
# than this are taken to have reached a replica.
REPLAY_S = 2.0
UNREPLICATED_REST_S = 5.0


class Acks:
    """How a round acknowledges finished entries: ``ack(pipe, entry_ids)``, after
    ``replicas`` replicas confirmed the writes before it (within ``timeout_ms``)."""

    def __init__(self, ack: Optional[Callable], replicas: int = 0, timeout_ms: int = 1000):
        self.ack, self.replicas, self.timeout_ms = ack, replicas, timeout_ms
        self.rest_until = 0.0  # after a WAIT that ran out, rounds until then do not wait

    def due(self) -> bool:
        """Whether a finishing round waits for replicas now."""
        return self.replicas > 0 and time.monotonic() >= self.rest_until


class ReplyBatch:
    """Consecutive chunks of a round, and the entries acknowledged with them.
    ``slot_of``: on a Redis Cluster, a key's slot (a script's keys must share one)."""

    def __init__(self, ttl_s: int, maxlen: int, acks: Acks, fence: Fence,
                 slot_of: Optional[Callable] = None):
        self.ttl_s, self.maxlen, self.acks, self.fence = ttl_s, maxlen, acks, fence
        self.slot_of = slot_of
        self.keys: list[str] = []
        self.chunks: list[tuple] = []  # (body, entry ID, seq) per key
        self.acked: list[str] = []
        self.scripts = 0  # the script calls write() made
        self.waited = False  # and whether it put WAIT after them

    def add(self, key: str, body: bytes, entry_id: str, seq: int, ack: bool = False) -> None:
        """A chunk of the request entry ``entry_id``; ``ack``: the entry is acknowledged
        after it (its request's last final chunk)."""
        self.keys.append(key)
        self.chunks.append((body, entry_id, seq))
        if ack:
            self.acked.append(entry_id)

    def write(self, pipe, wait: bool = True, resent: bool = False) -> None:
        """``wait``: False for a replay after an outage, whose many batches must not each
        wait out a missing replica. ``resent``: chunks a reply stream already holds (by
        seq) are skipped, as after an outage."""
        groups = self._by_slot()
        for keys, chunks in groups:
            keys, fence = self.fence.args(keys)
            # EVAL rather than EVALSHA: Redis caches the compiled script by its hash, and a
            # restarted or failed-over Redis needs no SCRIPT LOAD first.
            pipe.execute_command("EVAL", PUBLISH_SCRIPT, len(keys), *keys, self.ttl_s,
                                 self.maxlen, *fence, int(resent),
                                 *(arg for chunk in chunks for arg in chunk))
        self.scripts = len(groups)
        self.waited = wait and bool(self.acked) and self.acks.due()
        if self.waited:
            pipe.execute_command("WAIT", self.acks.replicas, self.acks.timeout_ms)
        if self.acked:  # after the chunks: acknowledged only together with the final one
            self.acks.ack(pipe, self.acked)

    def _by_slot(self) -> list[tuple[list[str], list[tuple]]]:
        """(keys, chunks) per script call: all in one, or on a cluster one per slot."""
        if self.slot_of is None:
            return [(self.keys, self.chunks)]
        return [([k for k, _ in group], [c for _, c in group])
                for group in by_slot(self.slot_of, zip(self.keys, self.chunks))]

    def check_replicated(self, confirmed) -> None:
        """Log acks sent before the replicas asked for confirmed (WAIT's reply)."""
        if isinstance(confirmed, int) and confirmed < self.acks.replicas:
            self.acks.rest_until = time.monotonic() + UNREPLICATED_REST_S
            event("ack_unreplicated", logging.WARNING, entries=len(self.acked),
                  replicas=confirmed, wanted=self.acks.replicas,
                  timeout_ms=self.acks.timeout_ms,
                  note=f"finishing rounds ack without waiting for {UNREPLICATED_REST_S:.0f}s")


class Round:
    """One loop iteration's writes in order, then its reads. ``later(fn)`` queues work that
    the sender thread runs when it sends the round: fn(round) may write and publish."""

    def __init__(self, reply_ttl_s: int, reply_maxlen: int, acks: Acks, fence: Fence,
                 slot_of: Optional[Callable] = None):
        self._reply_args = (reply_ttl_s, reply_maxlen, acks, fence, slot_of)
        self.items: list = []        # (fn, args, kwargs) writes, or ("later", fn)
        self.reads: Optional[Callable] = None
        self.parse: Optional[Callable] = None
        self.on_replies: Optional[Callable] = None
        self._batch: Optional[ReplyBatch] = None

    @property
    def empty(self) -> bool:
        return not self.items and self.reads is None

    def write(self, fn, *args, **kwargs) -> None:
        """Queue fn(pipe, *args, **kwargs)."""
        self.items.append((fn, args, kwargs))
        self._batch = None

    def publish(self, key: str, body: bytes, entry_id: str, seq: int, ack: bool = False) -> None:
        """Queue a reply chunk (and the ack of its request entry, for a final chunk)."""
        if self._batch is None:
            self._batch = ReplyBatch(*self._reply_args)
            self.items.append((self._batch.write, (), {}))
        self._batch.add(key, body, entry_id, seq, ack)

    def later(self, fn: Callable[["Round"], None]) -> None:
        self.items.append(("later", fn))
        self._batch = None

    def read(self, add_reads: Callable, on_replies: Callable, parse: Optional[Callable]) -> None:
        """After the writes: add_reads(pipe). parse(replies) runs on the sender thread (the
        work that needs no loop state: decoding), on_replies(parsed, when they came back)
        in the loop (Outbox.deliver)."""
        self.reads, self.on_replies, self.parse = add_reads, on_replies, parse

    def resolve(self) -> None:
        """Run the later() work, once, in its place among the writes."""
        items, self.items, self._batch = self.items, [], None
        for item in items:
            if item[0] == "later":
                item[1](self)
                self._batch = None
            else:
                self.items.append(item)


class Outbox:
    def __init__(self, redis: Redis, outage: Outage, fence: Fence, reply_ttl_s: int = 3600,
                 reply_maxlen: int = 100_000, ack: Optional[Callable] = None,
                 send_thread: bool = True, ack_replicas: int = 0,
                 ack_timeout_ms: int = 1000):
        if ack_replicas:
            _check_wait(redis, ack_timeout_ms)
        self.redis = redis
        self.outage = outage
        self._reply_args = (reply_ttl_s, reply_maxlen, Acks(ack, ack_replicas, ack_timeout_ms),
                            fence, redis.keyslot if is_cluster(redis) else None)
        self.round = Round(*self._reply_args)
        self._sender = _Sender(self._send) if send_thread else None
        self._reader = _Sender(self._send, depth=1) if send_thread else None
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self.reads_out = 0  # rounds whose reads have not been delivered yet
        self._recent: deque = deque()  # (sent at, ReplyBatch) of the last REPLAY_S seconds
        self._recent_lock = threading.Lock()  # both threads and the loop remember batches
        self._outages_seen = 0
        self._replay_owed = False  # resend the last REPLAY_S seconds without an outage

    # the current round ---------------------------------------------------------------
    def write(self, fn, *args, **kwargs) -> None:
        self.round.write(fn, *args, **kwargs)

    def publish(self, key: str, body: bytes, entry_id: str, seq: int, ack: bool = False) -> None:
        self.round.publish(key, body, entry_id, seq, ack)

    def later(self, fn: Callable[[Round], None]) -> None:
        self.round.later(fn)

    def vouch(self, key: str, entry_id: str, chunks: list[tuple[bytes, int]]) -> None:
        """Replay after an outage, as if this worker had just sent them, chunks that another
        worker sent and this one builds on (a request taken over resumes after them): read
        from a primary that then failed over, they may be lost with it, and their worker
        may be gone, leaving a gap in seq before this worker's next chunk."""
        batch = ReplyBatch(*self._reply_args)
        for body, seq in chunks:
            batch.add(key, body, entry_id, seq)
        self._remember([batch])

    def replay(self) -> None:
        """Send the chunks of the last REPLAY_S seconds again with the next round (those a
        stream holds are skipped): the fence dropped some for an entry that is this
        worker's again (a failed-over Redis that lost its delivery gave it back)."""
        self._replay_owed = True

    # sending -------------------------------------------------------------------------
    def post(self, add_reads: Optional[Callable] = None, on_replies: Optional[Callable] = None,
             parse: Optional[Callable] = None) -> None:
        """Send the current round, with these reads, on the sender thread (without one:
        now). Their replies reach on_replies through deliver(), parsed by parse if given."""
        rnd = self._take()
        reads = rnd if self._sender is None else Round(*self._reply_args)
        if add_reads is not None:
            reads.read(add_reads, on_replies, parse)
            self.reads_out += 1
        if self._sender is None:
            if not rnd.empty:
                self._send(rnd)
            return
        if not rnd.empty:
            self._sender.put(rnd)
        if not reads.empty:
            self._reader.put(reads)

    def deliver(self, wait: bool = False, within: float = 0.0) -> None:
        """Run on_replies for every round whose reads came back (with wait: at least one,
        if any is out; with within: waiting that many seconds at most for the first)."""
        self._check()
        while self.reads_out:
            try:
                on_replies, replies, at = self._replies.get(block=wait or within > 0,
                                                            timeout=0.1 if wait else within)
            except queue.Empty:
                if not wait:
                    return
                self._check()
                continue
            self.reads_out -= 1
            on_replies(replies, at)
            wait, within = False, 0.0

    def send(self, add_reads: Optional[Callable] = None) -> list:
        """Send every round so far and this one, in order, then add_reads(pipe)'s reads,
        now; returns their replies. Waits until the sender thread is done first."""
        if self._sender is not None:
            self._sender.drain()
            self._reader.drain()
        rnd = self._take()
        rnd.reads = add_reads
        return self._execute(rnd)

    def stop(self) -> None:
        """Stop the threads (after what they were given); the current round stays unsent."""
        if self._sender is not None:
            self._sender.stop()
            self._reader.stop()

    def _check(self) -> None:
        if self._sender is not None:
            self._sender.check()
            self._reader.check()

    def _take(self) -> Round:
        rnd, self.round = self.round, Round(*self._reply_args)
        return rnd

    def _send(self, rnd: Round) -> None:
        replies = self._execute(rnd)
        if rnd.on_replies is not None:
            at = time.monotonic()
            self._replies.put((rnd.on_replies, rnd.parse(replies) if rnd.parse else replies, at))

    def _execute(self, rnd: Round) -> list:
        rnd.resolve()

        def once():
            pipe = self.redis.pipeline(transaction=False)
            # Only rounds with writes replay: the reader thread's, sent beside the sender's,
            # could put old chunks after newer ones. A replay counts as done once its round
            # has landed: a failover fails several tries, and each must carry it.
            outages = self.outage.outages
            # some of it may have landed already
            resent = outages != self._outages_seen or self._replay_owed
            replayed = self._replay(pipe) if rnd.items and resent else 0
            scripts = []
            for fn, args, kwargs in rnd.items:
                at = len(pipe) - replayed
                if isinstance(getattr(fn, "__self__", None), ReplyBatch):
                    scripts.append((at, fn.__self__))
                    kwargs = {**kwargs, "resent": resent}
                fn(pipe, *args, **kwargs)
            num_writes = len(pipe)
            if rnd.reads is not None:
                rnd.reads(pipe)
            if not len(pipe):
                return []
            results = pipe.execute(raise_on_error=False)
            transient = next((r for r in results if isinstance(r, Exception) and is_transient(r)),
                             None)
            if transient is not None:  # the replay's replies included: it goes again
                raise transient
            results = results[replayed:]
            num_writes -= replayed
            for i, r in enumerate(results[:num_writes]):
                if isinstance(r, Exception):
                    event("write_failed", logging.WARNING, error=r)
            for i, batch in scripts:
                for reply in results[i:i + batch.scripts]:
                    if not isinstance(reply, Exception):
                        _report(*reply)
                if batch.waited:
                    batch.check_replicated(results[i + batch.scripts])
            if rnd.items:
                self._outages_seen, self._replay_owed = outages, False
            if replayed:
                event("replayed", logging.WARNING, batches=len(self._recent),
                      reason="chunks of the seconds before an outage may not have been "
                             "replicated")
            return results[num_writes:]

        results = self.outage.call(once)
        batches = [fn.__self__ for fn, _, _ in rnd.items
                   if isinstance(getattr(fn, "__self__", None), ReplyBatch)]
        if batches:
            self._remember(batches)
        return results

    def _replay(self, pipe) -> int:
        """The reply batches sent in the REPLAY_S seconds before an outage, into ``pipe``
        first; returns how many commands they took."""
        with self._recent_lock:
            batches = [batch for _, batch in self._recent]
        for batch in batches:
            batch.write(pipe, wait=False, resent=True)
        return len(pipe)

    def _remember(self, batches: list) -> None:
        now = time.monotonic()
        with self._recent_lock:
            self._recent.extend((now, b) for b in batches)
            if self.outage.outages != self._outages_seen or self._replay_owed:
                # A replay is owed: the batches of the seconds before the outage are what
                # the next round with writes sends again, however long the outage lasted.
                # Aged out here (by a takeover's vouch, or a read landing first), they were
                # lost, and a chunk the old primary never replicated left a hole in seq.
                return
            while self._recent and now - self._recent[0][0] > REPLAY_S:
                self._recent.popleft()


def _report(failed: list, fenced: list) -> None:
    """What a publish script left out, logged: keys a client filled with a non-stream value
    (their chunks lost), and chunks of entries another worker now serves."""
    if failed:
        event("write_failed", logging.WARNING, error="not a stream",
              keys=b",".join(failed).decode(errors="replace"))
    if fenced:
        event("fenced", logging.WARNING, chunks=len(fenced),
              keys=b",".join(sorted(set(fenced))).decode(errors="replace"),
              reason="their entries are another worker's now, or acknowledged")


def _check_wait(redis, ack_timeout_ms: int) -> None:
    """Acks that wait for replicas need one server's connection (WAIT counts its writes)
    and a WAIT that ends before the client's socket timeout."""
    if is_cluster(redis):
        raise ValueError("ack_replicas needs a single primary (redis:// or redis+sentinel://): "
                         "on a Redis Cluster a round's writes go to several primaries, and "
                         "WAIT counts one connection's")
    socket_timeout = redis.connection_pool.connection_kwargs.get("socket_timeout")
    if socket_timeout and ack_timeout_ms >= 1000 * socket_timeout:
        raise ValueError(f"ack_timeout_ms ({ack_timeout_ms}) must be below the Redis "
                         f"client's socket timeout ({socket_timeout} s): a WAIT that "
                         "outlasts it reads as a lost connection")


class _Sender:
    """Sends rounds in order from a thread of its own, at most ``depth`` rounds behind: a
    Redis slower than the engine slows the loop instead of piling rounds up. What stops
    it (an error, or Redis gone past the shutdown deadline) is raised in the loop at its
    next put(), check() or drain(), and nothing after it is sent."""

    def __init__(self, send: Callable[[Round], None], depth: int = 2):
        self._send = send
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None

    def put(self, rnd: Round) -> None:
        self.check()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="roseinfer-sender", daemon=True)
            self._thread.start()
        self._queue.put(rnd)

    def drain(self) -> None:
        self._queue.join()
        self.check()

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            rnd = self._queue.get()
            try:
                if rnd is None:
                    return
                if self._error is None:
                    self._send(rnd)
            except BaseException as e:  # the loop raises it: this thread only reports
                self._error = e
            finally:
                self._queue.task_done()
