"""A request a worker serves: what its client has been sent, what is held back for the
next chunk, and the times its metrics need."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from roseinfer.frontends.redis_streams.metrics import Metrics
from roseinfer.frontends.redis_streams.protocol import Chunk

# From this delivery on, an entry runs alone: when a batch keeps failing, running its
# requests one by one tells the poison entry from the ones that only shared its batches.
RUN_ALONE_FROM_DELIVERY = 3


@dataclass
class InFlight:
    rid: str
    entry_id: str                   # acknowledged together with the final chunk
    stream_interval: int
    deliveries: int
    arrival: float                  # when Redis added the entry (epoch seconds)
    resumed: bool                   # taken over: its first chunks came from elsewhere
    seq: int = 0                    # of the next chunk
    held_ids: list[int] = field(default_factory=list)
    held_text: str = ""
    held_logprobs: Optional[list[dict]] = None   # for requests that asked
    last_token_at: Optional[float] = None
    # When this worker last knew the entry its own: admitted after Redis delivered it.
    refreshed_at: float = field(default_factory=time.monotonic)

    @property
    def alone(self) -> bool:
        return self.deliveries >= RUN_ALONE_FROM_DELIVERY

    def take(self, out) -> Optional[Chunk]:
        """Add one engine output; returns the chunk due now, if any: the first and the
        final one always, else one per stream_interval tokens."""
        self.held_ids += out.new_token_ids
        self.held_text += out.new_text
        if out.new_logprobs is not None:
            self.held_logprobs = (self.held_logprobs or []) + [
                _logprob_map(lp) for lp in out.new_logprobs]
        due = self.held_ids and (self.seq == 0 or len(self.held_ids) >= self.stream_interval)
        if not (due or out.finished):
            return None
        chunk = Chunk(self.rid, self.seq, self.held_ids, self.held_text,
                      logprobs=self.held_logprobs)
        if self.seq == 0 and out.prompt_logprobs is not None:
            chunk.prompt_logprobs = [None] + [{"token_id": lp.token_id, **_logprob_map(lp)}
                                              for lp in out.prompt_logprobs[1:]]
        self.seq, self.held_ids, self.held_text = self.seq + 1, [], ""
        self.held_logprobs = None
        if out.finished:
            chunk.finish_reason = out.finish_reason
            chunk.usage = {"prompt_tokens": len(out.prompt_token_ids),
                           "completion_tokens": len(out.token_ids)}
        return chunk

    def observe(self, out, metrics: Metrics) -> int:
        """Record the output's timing; returns how many tokens it had (for the caller to
        count once per step: a counter increment per token costs more than it tells)."""
        n = len(out.new_token_ids)
        if not n:
            return 0
        now = time.monotonic()
        if self.last_token_at is None:  # this worker's first token: it prefilled the prompt
            metrics.prompt_tokens.inc(len(out.prompt_token_ids))
            if not self.resumed:
                metrics.ttft.observe(max(0.0, time.time() - self.arrival))
        else:
            metrics.itl.observe(now - self.last_token_at)
        self.last_token_at = now
        return n


def _logprob_map(lp) -> dict:
    """A TokenLogprob as protocol v1 sends it (docs/protocol.md)."""
    entry = {"logprob": lp.logprob, "top_logprobs": [list(t) for t in lp.top]}
    texts = lp.texts
    if texts is not None:
        entry["token"], entry["top_tokens"] = texts[0], texts[1:]
    return entry
