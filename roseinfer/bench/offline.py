"""`bench offline`: the engine in this process, requests added on the workload's schedule.

A request can only join between two steps, so on a schedule its submit time is when it was
actually added (the delay past its due time shows as submit lag). Token times are taken
when step() returns; step() hands back Python ints, so on CUDA the step's work is done.
The timed loop only appends each step's outputs; per-request bookkeeping comes after.
"""
from __future__ import annotations

from roseinfer.bench.metrics import RequestRecord, run_metrics
from roseinfer.bench.probe import EngineProbe
from roseinfer.bench.progress import Progress
from roseinfer.bench.timing import now, sleep_until, sync
from roseinfer.bench.workloads import Workload
from roseinfer.core.sampling import SamplingParams


def sampling_params(w: Workload) -> list[SamplingParams]:
    """Each request's parameters (one object per distinct output length)."""
    by_len = {n: SamplingParams(max_tokens=n, ignore_eos=w.ignore_eos,
                                **{"temperature": 0.0, **w.sampling})
              for n in set(w.output_lens)}
    return [by_len[n] for n in w.output_lens]


class _Submitter:
    """Hands out the requests that are due, by the absolute or the relative schedule."""

    def __init__(self, w: Workload, t0: float):
        self.w, self.t0, self.next = w, t0, 0
        self.last_submit = t0

    def pending(self) -> bool:
        return self.next < self.w.num_requests

    def due_at(self) -> float:
        if self.next == 0:
            return self.t0
        if self.w.schedule == "relative":
            return self.last_submit + self.w.submit_interval_s
        return self.t0 + self.w.offset(self.next)


def run_offline(probe: EngineProbe, w: Workload, run_id: str,
                progress: Progress) -> tuple[dict, list[RequestRecord]]:
    """One run of the workload; returns (its metrics, its request records)."""
    params = sampling_params(w)
    records = [RequestRecord(f"{run_id}-{i}") for i in range(w.num_requests)]
    by_rid = {r.rid: r for r in records}
    steps: list[tuple[float, list]] = []
    probe.reset()
    sync(probe.device)
    sub = _Submitter(w, now())
    while sub.pending() or probe.has_unfinished():
        t = now()
        while sub.pending() and sub.due_at() <= t:
            rec = records[sub.next]
            rec.due = sub.due_at()
            rec.submit = sub.last_submit = now()
            probe.add_request(rec.rid, w.prompts[sub.next], params[sub.next])
            sub.next += 1
        if not probe.has_unfinished():
            sleep_until(sub.due_at())
            continue
        outs = probe.step()
        t = now()
        steps.append((t, outs))  # bookkeeping waits until the clock has stopped
        progress.advance(t, len(outs))
    sync(probe.device)
    for t, outs in steps:
        for out in outs:
            _record(by_rid[out.request_id], out, t)
    end = max((r.chunks[-1][0] for r in records if r.chunks), default=now())
    for r in records:
        r.first_scheduled = probe.first_scheduled.get(r.rid)
    return finish_run(records, end - sub.t0, probe), records


def finish_run(records: list[RequestRecord], duration_s: float, probe: EngineProbe) -> dict:
    metrics = run_metrics(records, duration_s)
    if probe is not None:  # None: a fleet elsewhere served the run
        metrics["engine_steps"] = probe.step_stats()
    metrics["requests"] = [r.to_row() for r in records]
    return metrics


def _record(rec: RequestRecord, out, t: float) -> None:
    if out.new_token_ids:
        rec.chunks.append((t, len(out.new_token_ids)))
        rec.token_ids += out.new_token_ids
    if out.finished:
        rec.finish_reason = out.finish_reason
        rec.prompt_tokens = out.num_prompt_tokens
