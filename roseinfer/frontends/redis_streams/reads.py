"""What a worker's round reads, and how its replies are parsed off the step loop.

A round reads new cancels, refreshes the worker's claim on the entries it owns when due,
moves backlog entries into the stream, reads the routing mirror, and reads new entries
from the request stream and the worker's inbox. The replies are parsed on the outbox's
reader thread (outbox.py): entries decoded, and those a peer should serve handed to it
(routing.py, inbox.py), so that the loop only acts on them (worker.py, ``_on_reads``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from roseinfer.frontends.redis_streams import inbox


@dataclass
class ReadPlan:
    """What a round reads besides cancels."""
    owned: list         # InFlight and Takeover entries to refresh (often none)
    slots: int          # new requests to read
    block: Optional[int]
    open: bool          # taking entries: not stopping, no suspect running alone
    free: int           # slots free now: backlog entries to move into the stream (lanes.py)
    promote: bool       # move them this round
    watch: int = 0      # replies of the routing mirror's reads (routing.py), set when sent


@dataclass
class RoundReads:
    """A round's replies, parsed."""
    cancels: list                   # [(ID, fields)] of new cancel entries
    refreshed: list                 # the claim refreshes' replies, one per owned entry
    request_read: list              # the XREADGROUP's reply ([] when none was sent)
    decoded: list = field(default_factory=list)     # [(entry ID, fields, Request or error)]
    inbox_ids: list = field(default_factory=list)   # entries read from this worker's inbox
    places: dict = field(default_factory=dict)      # {entry ID: peer} handed over
    adapters: list = field(default_factory=list)    # [(ID, fields)] of new adapter entries


class Reads:
    def __init__(self, keys, group: str, consumer: str, ownership, backlog, admission,
                 router=None, inbox_=None):
        self.keys, self.group, self.consumer = keys, group, consumer
        self.ownership, self.backlog, self.admission = ownership, backlog, admission
        self.router, self.inbox = router, inbox_
        self.cancel_cursor = "0-0"  # the last cancel entry read
        self.adapter_cursor: Optional[str] = None  # the last adapter entry; None: not read

    def add(self, pipe, plan: ReadPlan) -> None:
        """Queue the round's reads on ``pipe`` (when the round is sent)."""
        pipe.xread({self.keys.cancel: self.cancel_cursor}, count=1000)
        if self.adapter_cursor is not None:  # its own command: another Cluster slot
            pipe.xread({self.keys.adapters: self.adapter_cursor}, count=100)
        now = time.monotonic()  # when the round is sent: ages as Redis will see them
        self.ownership.refresh(pipe, [(o.entry_id, now - o.refreshed_at) for o in plan.owned])
        if not plan.open:
            return
        if plan.promote:
            self.backlog.promote(pipe, plan.free)
        if self.router is not None:
            plan.watch = self.router.watch(pipe)
        handed = {self.inbox.key: ">"} if self.inbox is not None else {}
        if plan.slots:
            pipe.xreadgroup(self.group, self.consumer, {self.keys.requests: ">", **handed},
                            count=plan.slots, block=plan.block)
        elif handed:  # no slot free, but entries handed here were placed for their prefix
            pipe.xreadgroup(self.group, self.consumer, handed, count=inbox.READ_COUNT)

    def parse(self, plan: ReadPlan, replies: list) -> RoundReads:
        """Decode the entries read, and hand those a peer should serve to it; on the
        reader thread."""
        cancel_read, *reads = replies
        adapter_read = reads.pop(0) if self.adapter_cursor is not None else None
        at = len(plan.owned)
        if plan.promote:
            self.backlog.moved(reads[at])
        if plan.watch:
            self.router.watched(reads[at + plan.promote:at + plan.promote + plan.watch])
        parsed = RoundReads(cancel_read[0][1] if cancel_read else [], reads[:at],
                            reads[at + plan.promote + plan.watch:],
                            adapters=adapter_read[0][1] if adapter_read else [])
        read = parsed.request_read
        if not (read and read[0] and not isinstance(read[0], Exception)):
            return parsed
        shared = []
        for stream, entries in read[0]:
            if stream.decode() == self.keys.requests:
                shared = [self._decoded(i.decode(), f) for i, f in entries]
                continue
            parsed.inbox_ids = [i for i, _ in entries]
            parsed.decoded += [self._decoded(*inbox.entry(f)) for _, f in entries]
        parsed.decoded += shared
        if self.router is not None and shared:
            parsed.places = self._hand_over(shared)
        return parsed

    def advance(self, cancels: list, adapters: list = ()) -> None:
        if cancels:
            self.cancel_cursor = cancels[-1][0]
        if adapters:
            self.adapter_cursor = adapters[-1][0]

    def _hand_over(self, shared: list) -> dict[str, str]:
        """Hand the entries a peer should serve (routing.py) to it, here on the reader
        thread, so that they do not wait for this worker's step; returns {entry ID: peer}
        for those no longer this worker's."""
        places = self.router.place([(e, r) for e, _, r in shared if not isinstance(r, Exception)])
        return self.inbox.hand_over(places, {e: f for e, f, _ in shared}) if places else {}

    def _decoded(self, entry_id: str, fields: dict) -> tuple:
        try:
            return entry_id, fields, self.admission(entry_id, fields)
        except Exception as e:  # _admit reports it, as if it had decoded the entry itself
            return entry_id, fields, e
