"""EngineProbe: the engine with a stopwatch on step(), for queue wait and step times.

It forwards everything to the engine, so the Redis worker can drive it unchanged. Which
requests a step scheduled is read from the engine's sequence table (read-only); if that
table is not there, queue wait is simply not reported.
"""
from __future__ import annotations

import time

import numpy as np

from roseinfer.core.request import Status


class EngineProbe:
    def __init__(self, engine):
        self._engine = engine
        self.reset()

    def reset(self) -> None:
        self.first_scheduled: dict[str, float] = {}
        self.step_walls: list[float] = []
        self.step_outputs: list[int] = []
        self.num_outputs = 0  # running total, for progress read from another thread
        self._unscheduled: dict[str, None] = {}  # insertion-ordered: submit order

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def has_unfinished(self) -> bool:  # defined, not forwarded: called once per step
        return self._engine.has_unfinished()

    def add_request(self, rid, *args, **kwargs) -> None:
        self._engine.add_request(rid, *args, **kwargs)
        self._unscheduled[rid] = None

    def step(self):
        start = time.monotonic()
        outs = self._engine.step()
        self.step_walls.append(time.monotonic() - start)
        self.step_outputs.append(len(outs))
        self.num_outputs += len(outs)
        if self._unscheduled:
            self._mark_scheduled(start)
        return outs

    def _mark_scheduled(self, step_start: float) -> None:
        seqs = getattr(self._engine, "seqs", None)
        if seqs is None:
            return
        # The scheduler admits first-come first-served, so the scan stops at the first
        # request still waiting: O(newly admitted) per step, not O(queue).
        while self._unscheduled:
            rid = next(iter(self._unscheduled))
            seq = seqs.get(rid)
            # Gone from the table (finished or aborted this step) or no longer WAITING.
            if seq is not None and getattr(seq, "status", None) is Status.WAITING:
                break
            self.first_scheduled[rid] = step_start
            del self._unscheduled[rid]

    def step_stats(self) -> dict:
        """Engine step wall time (ms) and outputs per step, over the steps since reset()."""
        if not self.step_walls:
            return {"num_steps": 0}
        t = np.asarray(self.step_walls) * 1e3
        return {"num_steps": len(t), "step_ms_mean": float(t.mean()),
                "step_ms_p50": float(np.percentile(t, 50)),
                "step_ms_p99": float(np.percentile(t, 99)),
                "outputs_per_step_mean": float(np.mean(self.step_outputs))}
