"""The Redis worker: pulls requests through a consumer group, steps the engine, publishes chunks.

One loop iteration is one engine step and one Redis round trip: a single pipeline carries
the step's chunks and acks, then reads new cancels and as many new requests as there are
free slots, blocking only while the engine is idle (so an idle worker does not spin).
"""
from __future__ import annotations

import logging
import os
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from redis import Redis
from redis.exceptions import ResponseError

from roseinfer.core.errors import InvalidRequestError
from roseinfer.frontends.redis_streams.protocol import (
    DEFAULT_GROUP, DEFAULT_PREFIX, Chunk, Keys, decode_request, encode_chunk, error_chunk,
    reply_rid)

log = logging.getLogger("roseinfer.worker")

# Cancels of requests this worker has not read yet: remembered so that a request cancelled
# while still queued is aborted as soon as it arrives. Bounded: old ones fall out first.
MAX_REMEMBERED_CANCELS = 10_000


def default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass
class _InFlight:
    """A request this worker owns: its entry (acked with the final chunk) and unsent output."""
    entry_id: str
    stream_interval: int
    started: float
    seq: int = 0
    held_ids: list[int] = field(default_factory=list)
    held_text: str = ""


class Worker:
    """Serves one engine from Redis: ``Worker(llm.engine, Redis.from_url(url)).run()``.

    run() owns the engine until stop(); keep block_ms under the Redis client's
    socket_timeout (redis-py's default is 5 s).
    """

    def __init__(self, engine, redis: Redis, *, prefix: str = DEFAULT_PREFIX,
                 group: str = DEFAULT_GROUP, consumer: Optional[str] = None,
                 block_ms: int = 1000, grace_s: float = 30.0, reply_ttl_s: int = 3600,
                 reply_maxlen: int = 100_000, progress_every_s: float = 10.0,
                 chat_template: bool = True):
        self.engine = engine
        self.redis = redis
        self.keys = Keys(prefix)
        self.group = group
        self.consumer = consumer or default_consumer_name()
        self.block_ms = block_ms            # also bounds how long stop() takes when idle
        self.grace_s = grace_s
        self.reply_ttl_s = reply_ttl_s
        # Far above any request's chunk count: the cap only guards Redis against a runaway.
        self.reply_maxlen = reply_maxlen
        self.progress_every_s = progress_every_s
        # Chat models answer sensibly only inside their template; raw text is for base models.
        self.chat_template = chat_template and bool(getattr(engine.tokenizer, "chat_template", None))
        self._inflight: dict[str, _InFlight] = {}
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        self._pipe = redis.pipeline(transaction=False)
        self._cancel_cursor = "0-0"
        self._stop_at: Optional[float] = None
        self._progress = {"at": time.monotonic(), "tokens": 0, "finished": 0}

    # --- lifecycle ----------------------------------------------------------------------

    def setup(self) -> None:
        self._ensure_group()
        # Cancels sent before this worker started concern requests it cannot own yet.
        last = self.redis.xrevrange(self.keys.cancel, count=1)
        self._cancel_cursor = last[0][0] if last else "0-0"
        log.info("worker %s reading %s as group %s (max_num_seqs=%d)", self.consumer,
                 self.keys.requests, self.group, self.engine.config.max_num_seqs)

    def run(self) -> None:
        """Serve until stop() was called and the in-flight requests finished (or grace ran out)."""
        self.setup()
        while not self._stopped():
            self.run_once()
        if self._inflight:
            log.warning("stopped with %d request(s) unfinished; their entries stay pending",
                        len(self._inflight))
        log.info("worker %s stopped", self.consumer)

    def stop(self, grace_s: Optional[float] = None) -> None:
        """Stop reading new requests; in-flight ones get grace_s seconds to finish. Thread-safe."""
        self._stop_at = time.monotonic() + (self.grace_s if grace_s is None else grace_s)

    @property
    def stopping(self) -> bool:
        return self._stop_at is not None

    def _stopped(self) -> bool:
        return self.stopping and (not self._inflight or time.monotonic() >= self._stop_at)

    def run_once(self) -> None:
        if self.engine.has_unfinished():
            for out in self.engine.step():
                self._on_output(out)
        cancels, entries = self._exchange()
        for rid in cancels:
            self._cancel(rid)
        for entry_id, fields in entries:
            self._admit(entry_id.decode(), fields)
        self._log_progress()

    # --- Redis round trip ---------------------------------------------------------------

    def _exchange(self) -> tuple[list[str], list]:
        """Send the queued writes, then read cancels and new requests, in one round trip."""
        pipe, writes = self._pipe, len(self._pipe)
        pipe.xread({self.keys.cancel: self._cancel_cursor}, count=1000)
        slots = 0 if self.stopping else self._free_slots()
        if slots:
            block = None if self.engine.has_unfinished() else self.block_ms
            pipe.xreadgroup(self.group, self.consumer, {self.keys.requests: ">"},
                            count=slots, block=block)
        results = pipe.execute(raise_on_error=False)
        for failed in (r for r in results[:writes] if isinstance(r, Exception)):
            # e.g. a client wrote a non-stream value under a reply key: that client's loss only
            log.warning("a reply write failed: %s", failed)
        cancel_read, *request_read = results[writes:]
        entries = self._entries(request_read[0]) if request_read else []
        cancels = self._entries(cancel_read)
        if cancels:
            self._cancel_cursor = cancels[-1][0]
        return [f[b"rid"].decode(errors="replace") for _, f in cancels if b"rid" in f], entries

    def _entries(self, result) -> list:
        if isinstance(result, ResponseError) and str(result).startswith("NOGROUP"):
            log.warning("%s or its group vanished (was Redis flushed?); recreating it",
                        self.keys.requests)
            self._ensure_group()
            return []
        if isinstance(result, Exception):
            raise result
        return result[0][1] if result else []

    def _ensure_group(self) -> None:
        try:
            # From id 0: requests queued before the first worker started are served too.
            self.redis.xgroup_create(self.keys.requests, self.group, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def _free_slots(self) -> int:
        return max(0, self.engine.config.max_num_seqs - self.engine.num_unfinished())

    def _publish(self, chunk: Chunk, ack_entry_id: Optional[str] = None) -> None:
        key = self.keys.out(chunk.rid)
        self._pipe.xadd(key, encode_chunk(chunk), maxlen=self.reply_maxlen, approximate=True)
        self._pipe.expire(key, self.reply_ttl_s)
        if ack_entry_id is not None:
            # Acked only together with the final chunk, so a crash never loses a request;
            # deleted too, since nothing reads an acked request again.
            self._pipe.xack(self.keys.requests, self.group, ack_entry_id)
            self._pipe.xdel(self.keys.requests, ack_entry_id)

    # --- requests -----------------------------------------------------------------------

    def _admit(self, entry_id: str, fields: dict) -> None:
        rid = reply_rid(entry_id, fields)
        try:
            req = decode_request(entry_id, fields)
            if req.rid in self._inflight:
                rid = entry_id  # P:out:{rid} belongs to the request already running
                raise InvalidRequestError("rid", f"{req.rid!r} is already in flight; use a new rid")
            self.engine.add_request(req.rid, self._engine_prompt(req.prompt), req.params)
        except InvalidRequestError as e:
            log.warning("rejected %s (entry %s): %s: %s", rid, entry_id, e.code, e)
            self._publish(error_chunk(rid, e.code, str(e)), entry_id)
            return
        except Exception as e:  # an engine bug must cost this request, not the whole worker
            log.exception("add_request failed for %s (entry %s)", rid, entry_id)
            self._publish(error_chunk(rid, "internal", f"{type(e).__name__}: {e}"), entry_id)
            return
        self._inflight[req.rid] = _InFlight(entry_id, req.stream_interval, time.monotonic())
        if req.rid in self._cancelled:
            del self._cancelled[req.rid]
            self._cancel(req.rid)

    def _engine_prompt(self, prompt):
        if self.chat_template and isinstance(prompt, str):
            return self.engine.chat_prompt(prompt)
        return prompt

    def _cancel(self, rid: str) -> None:
        f = self._inflight.get(rid)
        if f is None:
            self._cancelled[rid] = None
            if len(self._cancelled) > MAX_REMEMBERED_CANCELS:
                self._cancelled.popitem(last=False)
        else:
            self.engine.abort(rid)  # its "abort" output comes out of the next step

    def _on_output(self, out) -> None:
        f = self._inflight[out.request_id]
        f.held_ids += out.new_token_ids
        f.held_text += out.new_text
        self._progress["tokens"] += len(out.new_token_ids)
        due = f.held_ids and (f.seq == 0 or len(f.held_ids) >= f.stream_interval)
        if not (due or out.finished):
            return
        chunk = Chunk(out.request_id, f.seq, f.held_ids, f.held_text)
        f.seq, f.held_ids, f.held_text = f.seq + 1, [], ""
        if not out.finished:
            self._publish(chunk)
            return
        chunk.finish_reason = out.finish_reason
        chunk.usage = {"prompt_tokens": len(out.prompt_token_ids),
                       "completion_tokens": len(out.token_ids)}
        self._publish(chunk, f.entry_id)
        del self._inflight[out.request_id]
        self._progress["finished"] += 1
        log.info("finished %s: %s, %d prompt + %d generated tokens in %.2fs", out.request_id,
                 out.finish_reason, chunk.usage["prompt_tokens"],
                 chunk.usage["completion_tokens"], time.monotonic() - f.started)

    def _log_progress(self) -> None:
        p, now = self._progress, time.monotonic()
        if now - p["at"] < self.progress_every_s:
            return
        if p["tokens"] or self._inflight:
            s = self.engine.stats()
            log.info("running=%d waiting=%d kv_cache=%.0f%% generated=%.1f tok/s finished=%d",
                     s.num_running, s.num_waiting, 100 * s.kv_cache_usage,
                     p["tokens"] / (now - p["at"]), p["finished"])
        self._progress = {"at": now, "tokens": 0, "finished": 0}
