"""Continuous batching under a token budget, with chunked prefill and preemption.

Every step, running sequences are served first (one decode token, or the
next chunk of an unfinished prefill), then waiting ones are admitted while
budget, sequence slots and KV blocks last. When blocks run out, the newest
running sequence is preempted: its blocks are freed and it goes back to the
front of the queue to be recomputed (prompt + generated tokens) later.

Requests with a ``priority`` (lower first, vLLM's meaning) are ordered by their rank:
arrival + priority x ``priority_aging_s``, as if a request of priority p had arrived p
aging periods later. The waiting queue is in rank order, running sequences are served in
it, and the one preempted under KV pressure is the highest-ranked not yet served this
step. When every sequence slot is taken and the head of the queue outranks a running
sequence, that one gives its slot up (vLLM's priority preemption). A preempted sequence
goes back ahead of every waiting one of its rank or a later one. The mixed-prefill cap,
which keeps a prefill from slowing the sequences that decode beside it, does not hold a
prefill more urgent (a lower priority value) than every one of them. With every priority
equal, all of this is the order above (arrival). A step that prefills a request leaves
out the decodes less urgent than it, so that background work does not lengthen an
interactive request's first steps. Starvation is bounded: a request waits
behind later arrivals of a lower priority value q for at most (p - q) x priority_aging_s.
A request whose LoRA adapter finds no free slot (core/lora.py) waits where it is, and
the requests behind it are admitted.
"""
from __future__ import annotations

import math
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

from roseinfer.core.blocks import BlockManager
from roseinfer.core.request import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]   # tokens computed for each sequence in this step
    steps: int = 1          # decode steps run back to back (a decode window)
    drafted: bool = False   # some sequence checks a draft (core/speculation.py)
    prefill_tokens: int = 0  # of num_tokens, prompt tokens (the fleet's prefill rate)

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass
class StepBudget:
    """What a step may still carry: tokens, and prefill tokens under the mixed cap, which
    holds only prefills of a priority value at or above ``capped_from`` (the most urgent
    decoding sequence's: the cap protects decoders from work no more urgent than theirs)."""
    tokens: int
    prefill: int
    capped_from: float = -math.inf

    def prefill_room(self, seq: Sequence) -> int:
        if seq.params.priority < self.capped_from:
            return self.tokens
        return min(self.tokens, self.prefill)

    def spend_prefill(self, seq: Sequence, n: int) -> None:
        self.tokens -= n
        if seq.params.priority >= self.capped_from:
            self.prefill -= n


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 decode_steps: int = 1, decode_steps_min_seqs: int = 1,
                 max_mixed_prefill_tokens: int | None = None, priority_aging_s: float = 10.0):
        self.blocks = blocks
        self.aging_s = priority_aging_s
        self.mixed_prefill = max_mixed_prefill_tokens
        self.decode_steps = decode_steps
        self.window_min_seqs = decode_steps_min_seqs
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.aside: tuple = ()  # the queues only() set aside
        self.num_preemptions = 0
        self._uncached: dict = {}  # waiting sequence: its prompt tokens not cached (backlog)
        self.prioritized = False  # some request had a priority: running is kept in its order
        # Whether a waiting sequence may start now (core/lora.py: a slot for its adapter);
        # one that may not waits, and the ones behind it go ahead.
        self.admits: Callable[[Sequence], bool] = lambda seq: True

    def rank(self, seq: Sequence) -> float:
        """Lower runs first: the arrival, later by priority_aging_s per priority unit."""
        return seq.arrival_time + seq.params.priority * self.aging_s

    def add(self, seq: Sequence) -> None:
        """Waiting, behind every sequence of a lower or equal rank."""
        self.prioritized = self.prioritized or seq.params.priority != 0
        waiting, rank = self.waiting, self.rank(seq)
        at = len(waiting)
        while at and self.rank(waiting[at - 1]) > rank:
            at -= 1
        waiting.insert(at, seq)

    def _to_front(self, seq: Sequence) -> None:
        """Waiting, ahead of every sequence of its rank or a later one."""
        waiting, rank = self.waiting, self.rank(seq)
        at = 0
        while at < len(waiting) and self.rank(waiting[at]) < rank:
            at += 1
        waiting.insert(at, seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [])
        preemptions = self.num_preemptions
        if self.prioritized:
            self.running.sort(key=self.rank)
            # The head is admitted next step, as after any preemption: admitting it in this
            # one measured worse at p99 (docs/benchmarks.md, "Priorities").
            self._give_slots_up()
        budget = self._step_budget()
        self._schedule_running(batch, budget)
        if self.num_preemptions == preemptions:  # admit nothing while preempting
            self._admit_waiting(batch, budget)
        if self.prioritized:
            self._sit_out(batch)
        if self.decode_steps > 1 and len(batch.seqs) >= self.window_min_seqs:
            self._widen(batch)
        return batch

    def _give_slots_up(self) -> None:
        """Every slot taken: a running sequence that the head of the queue outranks goes
        back to wait, so that the head is admitted (running is in rank order)."""
        running, waiting = self.running, self.waiting
        while (waiting and len(running) >= self.max_num_seqs
               and self.rank(running[-1]) > self.rank(waiting[0])
               and not waiting[0].pending):
            self._preempt(running.pop())

    @staticmethod
    def _sit_out(batch: ScheduledBatch) -> None:
        """Decodes less urgent than a prefill in the step sit it out: a new interactive
        request's first steps run without the background rows, whose decodes would make
        them longer (docs/benchmarks.md, "Background responses beside interactive
        chat"). They lose a step each time; their blocks stay reserved for the next."""
        rows = list(zip(batch.seqs, batch.num_tokens))
        prefills = [s.params.priority for s, n in rows if n > 1 or s.num_computed + n <
                    len(s.token_ids) + s.pending]
        if not prefills:
            return
        urgent = min(prefills)
        kept = [(s, n) for s, n in rows if n > 1 or s.params.priority <= urgent
                or s.draft is not None or s.num_computed + n < len(s.token_ids) + s.pending]
        if len(kept) < len(rows):
            batch.seqs, batch.num_tokens = [s for s, _ in kept], [n for _, n in kept]

    def _widen(self, batch: ScheduledBatch) -> None:
        """Make a decode-only batch a window of several steps, as many as every
        sequence still has room for (so none passes its length limit) and as
        the free blocks allow. A stop token mid-window wastes the rest of it."""
        if any(n != 1 for n in batch.num_tokens):
            return  # a prefill chunk: new sequences join between windows
        if any(s.constraints for s in batch.seqs):
            return  # each step's mask needs the previous step's token (core/processors.py)
        steps = min(self.decode_steps,
                    min(s.max_len - len(s.token_ids) - s.pending for s in batch.seqs))
        reserve = self.blocks.reserve
        if steps > 1 and all(reserve(s, steps) for s in batch.seqs):
            batch.steps = steps

    def _step_budget(self) -> StepBudget:
        """The whole token budget; prefills capped to the mixed cap when a running
        sequence decodes (it waits for the whole step)."""
        if self.mixed_prefill is None:  # no cap (CUDA): no pass over the running ones
            return StepBudget(self.budget, self.budget)
        decoding = [s.params.priority for s in self.running
                    if len(s.token_ids) + s.pending - s.num_computed == 1]
        if not decoding:
            return StepBudget(self.budget, self.budget)
        return StepBudget(self.budget, self.mixed_prefill, min(decoding))

    def _schedule_running(self, batch: ScheduledBatch, budget: StepBudget) -> None:
        """Serve running sequences, spending ``budget``."""
        running, reserve = self.running, self.blocks.reserve
        i = 0
        while i < len(running) and budget.tokens > 0:
            seq = running[i]
            total = len(seq.token_ids) + seq.pending
            left = total - seq.num_computed
            if total >= seq.max_len:
                i += 1  # its last token is in flight
                continue
            if left == 1:  # decoding: the common case, kept to plain arithmetic
                n = 1 if seq.draft is None else self._fit_draft(batch, seq, budget.tokens)
            else:
                n = self._chunk(seq, min(left, budget.prefill_room(seq)), min(left, budget.tokens))
                if n == 0:
                    i += 1  # no prefill budget is left for it
                    continue
            while not reserve(seq, n):
                victim = running.pop()  # the latest-ranked (running is in rank order)
                self._preempt(victim)
                if victim is seq:
                    return
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            if left == 1:
                budget.tokens -= n
            else:
                budget.spend_prefill(seq, n)
                batch.prefill_tokens += n
            i += 1

    def _fit_draft(self, batch: ScheduledBatch, seq: Sequence, budget: int) -> int:
        """Tokens ``seq`` computes: its last, then as much of its draft as the token
        budget and the free blocks hold (none of it if they hold no more)."""
        seq.draft = seq.draft.first(budget - 1)
        if seq.draft is not None and self.blocks.reserve(seq, 1 + len(seq.draft.tokens)):
            batch.drafted = True
            return 1 + len(seq.draft.tokens)
        seq.draft = None
        return 1

    def _admit_waiting(self, batch: ScheduledBatch, budget: StepBudget) -> None:
        passed: list[Sequence] = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            room = budget.prefill_room(seq)
            if seq.pending or room <= 0:  # its last token in flight (preempted), or no budget
                break
            if not self.admits(seq):
                passed.append(self.waiting.popleft())
                continue
            if not seq.block_table:  # else it holds blocks shared with it (Engine._queue)
                seq.num_computed = self.blocks.match_prefix(seq)
                if seq.num_cached_tokens is None:  # what the cache saved it, first time in
                    seq.num_cached_tokens = seq.num_computed
            left = seq.num_scheduled_tokens - seq.num_computed
            n = self._chunk(seq, min(left, room), min(left, budget.tokens))
            if n == 0 or not self.blocks.reserve(seq, n):
                self.blocks.free_seq(seq)
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget.spend_prefill(seq, n)
            batch.prefill_tokens += n
        self.waiting.extendleft(reversed(passed))

    def _chunk(self, seq: Sequence, n: int, most: int) -> int:
        """A prompt chunk of at most ``n`` tokens; where its images' tokens attend both
        ways, none cut (up to ``most`` tokens to take one whole: core/multimodal.py)."""
        if seq.images is not None and seq.images.spans:
            n = seq.images.chunk(seq.num_computed, n, most)
        return self.blocks.chunk(seq, n) if n else 0

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free_seq(seq)
        seq.status = Status.WAITING
        self._to_front(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Free a sequence's blocks and drop it from whichever queue holds it."""
        self.blocks.free_seq(seq)
        self._drop(seq)
        seq.status = Status.FINISHED

    def _drop(self, seq: Sequence) -> None:
        for queue in (self.running, self.waiting, *self.aside):
            if seq in queue:
                queue.remove(seq)
                return

    def requeue(self, seqs: list[Sequence]) -> None:
        """Back to the front of the queue in their order, holding no blocks: they are
        computed again from their first token (core/faults.py)."""
        for seq in reversed(seqs):
            self._drop(seq)
            self.blocks.free_seq(seq)
            seq.status = Status.WAITING
            self._to_front(seq)

    @contextmanager
    def only(self, seqs: list[Sequence]):
        """Schedule ``seqs`` alone while inside (they wait first, in order); the other
        sequences wait aside, running ones keeping their blocks, and come back after."""
        group = set(seqs)
        running, waiting = self.running, deque(s for s in self.waiting if s not in group)
        self.running, self.aside = [], (running, waiting)
        self.waiting = deque(s for s in seqs if s.status is Status.WAITING)
        try:
            yield
        finally:
            self.running, self.aside = running + self.running, ()
            self.waiting.extend(waiting)

    def num_unfinished(self) -> int:
        return len(self.running) + len(self.waiting)

    def backlog(self) -> tuple[int, int]:
        """What a request arriving now waits behind: (prompt tokens still to compute, and
        when every seat is taken, the decode steps until the first running sequence
        reaches its length limit, else 0)."""
        # a waiting sequence's cached prefix, looked up once: a burst's queue is mostly
        # histories its prefix cache holds
        self._uncached = {s: self._uncached.get(s) or len(s.token_ids) - (
            s.num_computed or self.blocks.cached_tokens(s.token_ids, s.hash_root))
            for s in self.waiting}
        tokens = sum(self._uncached.values()) + sum(
            max(0, len(s.token_ids) + s.pending - s.num_computed - 1) for s in self.running)
        if len(self.running) < self.max_num_seqs:
            return tokens, 0
        return tokens, min(s.max_len - len(s.token_ids) - s.pending for s in self.running)
