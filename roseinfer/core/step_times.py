"""Each step's time and the prompt tokens it computed: what a fleet's router predicts a
worker's time to first token from (frontends/redis_streams/routing.py).

The engine overlaps steps: step() launches step k, then waits for step k - 1. So a call's
wall time is mostly the previous step's, and a prefill rate taken from it divides one
step's prompt tokens by another's time (on an H200, a prefill's 800 tokens by the 6 ms
of the decode step before it). Each step is charged instead from when it could start
(launched, and the step before it ready) to when its results were ready."""
from __future__ import annotations

import time
from collections import deque


class StepTimes:
    def __init__(self, kept: int = 256):
        # (prompt tokens, seconds a step)
        self.samples: deque[tuple[int, float]] = deque(maxlen=kept)
        self._ready = 0.0

    @staticmethod
    def launching(launch, batch, previous):
        """``launch(batch, previous)``, with when it started, and when it ended where the
        step was computed in the launch (no device event to wait for: a CPU step)."""
        started = time.monotonic()
        step = launch(batch, previous)
        step.started = started
        if step.done is None:
            step.ready = time.monotonic()
        return step

    def collected(self, step) -> None:
        """After ``step.result()``: its time, with its prompt tokens; a window of decode
        steps (core/scheduler.py) counts as that many steps of its mean time."""
        ready = step.ready if step.ready is not None else time.monotonic()
        seconds = max(0.0, ready - max(step.started, self._ready))
        self.samples.append((step.batch.prefill_tokens, seconds / step.batch.steps))
        self._ready = ready

    def take(self) -> list[tuple[int, float]]:
        """The samples since the last take, oldest first."""
        taken = list(self.samples)
        self.samples.clear()
        return taken
