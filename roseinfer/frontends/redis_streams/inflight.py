"""A request a worker serves: what its client has been sent, what is held back for the
next chunk, and the times its metrics need."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from roseinfer.frontends.redis_streams.metrics import Metrics
from roseinfer.core.tools import ToolStream
from roseinfer.frontends.redis_streams.protocol import Chunk, pooled_fields

# From this delivery on, an entry runs alone: when a batch keeps failing, running its
# requests one by one tells the poison entry from the ones that only shared its batches.
RUN_ALONE_FROM_DELIVERY = 3


@dataclass
class Held:
    """What one sample has produced since its last chunk."""
    ids: list[int] = field(default_factory=list)
    text: str = ""
    reasoning: str = ""                     # split from the text (core/reasoning.py)
    logprobs: Optional[list[dict]] = None   # for requests that asked
    sent: bool = False                      # its first chunk is out


@dataclass
class InFlight:
    rid: str
    entry_id: str                   # acknowledged together with the last final chunk
    stream_interval: int
    deliveries: int
    arrival: float                  # when Redis added the entry (epoch seconds)
    resumed: bool                   # taken over: its first chunks came from elsewhere
    seq: int = 0                    # of the next chunk
    n: int = 1                      # samples: chunks carry their index when n > 1
    running: int = 1                # samples not finished yet (the step loop's count)
    priority: int = 0               # the request's (lanes.py, core/scheduler.py)
    held: dict[int, Held] = field(default_factory=dict)   # by sample index
    last_token_at: Optional[float] = None
    # When this worker last knew the entry its own: admitted after Redis delivered it.
    refreshed_at: float = field(default_factory=time.monotonic)
    # A request with tools: makes each sample's stream of content and calls
    tools: Optional[Callable[[], ToolStream]] = None
    streams: dict[int, ToolStream] = field(default_factory=dict)
    # A chat request whose output is split: makes each sample's reasoning stream, by index
    reasoning: Optional[Callable[[int], object]] = None  # a reasoning.stream_for stream
    thoughts: dict[int, object] = field(default_factory=dict)

    @property
    def alone(self) -> bool:
        return self.deliveries >= RUN_ALONE_FROM_DELIVERY

    def take(self, out) -> Optional[Chunk]:
        """Add one engine output; returns the chunk due now, if any: each sample's
        first and final one always, else one per stream_interval tokens."""
        h = self.held.get(out.index)
        if h is None:
            h = self.held[out.index] = Held(sent=self.resumed)
        stream = None
        if self.tools is not None:
            stream = self.streams.get(out.index) or self.streams.setdefault(out.index,
                                                                             self.tools())
        h.ids += out.new_token_ids
        text = self._answer(out, h)
        h.text += text if stream is None else stream.feed(text)
        if out.new_logprobs is not None:
            h.logprobs = (h.logprobs or []) + [_logprob_map(lp) for lp in out.new_logprobs]
        due = h.ids and (not h.sent or len(h.ids) >= self.stream_interval)
        if not (due or out.finished):
            return None
        chunk = Chunk(self.rid, self.seq, h.ids, h.text, logprobs=h.logprobs,
                      index=out.index if self.n > 1 else None, reasoning=h.reasoning or None)
        if not h.sent and out.prompt_logprobs is not None:
            chunk.prompt_logprobs = [None] + [{"token_id": lp.token_id, **_logprob_map(lp)}
                                              for lp in out.prompt_logprobs[1:]]
        self.seq += 1
        h.ids, h.text, h.reasoning, h.logprobs, h.sent = [], "", "", None, True
        if out.finished:
            chunk.finish_reason = out.finish_reason
            calls, ended = [], out.finish_reason in ("stop", "length")
            if stream is not None and ended:
                rest, calls = stream.finish()
                chunk.text += rest
            thoughts = self.thoughts.get(out.index)
            if thoughts is not None and stream is not None and ended:
                calls = calls + thoughts.calls  # harmony's, in its commentary channel
            if calls:
                chunk.tool_calls = [c.as_dict(i) for i, c in enumerate(calls)]
                chunk.finish_reason = "tool_calls"
            if out.error is not None:  # a step failed on this request alone (core/faults.py)
                chunk.error = {"code": "internal", "message": out.error}
            chunk.usage = {"prompt_tokens": len(out.prompt_token_ids),
                           "completion_tokens": len(out.token_ids),
                           "cached_tokens": out.num_cached_tokens}
            if getattr(out, "result", None) is not None:  # a pooling request's (core/pooling.py)
                chunk.pooled = pooled_fields(out.task, out.result, out.labels)
        return chunk

    def _answer(self, out, h: Held) -> str:
        """The output's new text less its reasoning, which goes to ``h.reasoning``."""
        if self.reasoning is None:
            return out.new_text
        stream = self.thoughts.get(out.index) or self.thoughts.setdefault(
            out.index, self.reasoning(out.index))
        thought, text = stream.feed(out.new_text, out.new_token_ids)
        if out.finished:
            more_thought, more_text = stream.finish()
            thought, text = thought + more_thought, text + more_text
        h.reasoning += thought
        return text

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
