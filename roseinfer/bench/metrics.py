"""Per-request timing records and the metrics vLLM's benchmarks report.

All times are ``time.monotonic()`` seconds (CLOCK_MONOTONIC on Linux, so a client process
and the worker's process read the same clock). Definitions, as in vLLM's benchmark_serving:

- duration: first submit of the run to the last token of the run (prefill included).
- completion (output) token throughput: generated tokens / duration.
- total token throughput: (prompt + generated tokens) / duration.
- request throughput: completed requests / duration.
- TTFT: submit -> first generated token received.
- TPOT: (end-to-end latency - TTFT) / (generated tokens - 1), requests with >= 2 tokens.
- ITL: gap between consecutive token arrivals of one request, pooled over requests; when
  tokens arrive in chunks (stream interval > 1) it is the gap between chunks.
- end-to-end latency: submit -> last token received.
- queue wait: submit -> start of the engine step that first scheduled the request
  (includes the Redis hop for `bench serve`); None where it cannot be observed.

Each latency is reported in milliseconds as mean, p50, p95, p99 (numpy linear percentiles).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

PERCENTILES = (50, 95, 99)


@dataclass
class RequestRecord:
    rid: str
    submit: float = 0.0                     # when the request was handed to the engine / XADD
    due: Optional[float] = None             # when the schedule wanted it submitted
    prompt_tokens: int = 0
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens)
    first_scheduled: Optional[float] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    token_ids: list[int] = field(default_factory=list)  # to compare with transformers

    @property
    def completed(self) -> bool:
        return self.finish_reason in ("stop", "length") and self.error is None

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def token_chunks(self) -> list[tuple[float, int]]:
        return [c for c in self.chunks if c[1] > 0]

    @property
    def ttft(self) -> Optional[float]:
        chunks = self.token_chunks
        return chunks[0][0] - self.submit if chunks else None

    @property
    def latency(self) -> Optional[float]:
        chunks = self.token_chunks
        return chunks[-1][0] - self.submit if chunks else None

    @property
    def tpot(self) -> Optional[float]:
        n = self.output_tokens
        if n < 2:
            return None
        return (self.latency - self.ttft) / (n - 1)

    @property
    def itls(self) -> list[float]:
        times = [t for t, _ in self.token_chunks]
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def queue_wait(self) -> Optional[float]:
        return None if self.first_scheduled is None else self.first_scheduled - self.submit

    def to_row(self) -> dict:
        ms = lambda v: None if v is None else round(v * 1e3, 4)  # noqa: E731
        return {"rid": self.rid, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "finish_reason": self.finish_reason,
                "error": self.error, "ttft_ms": ms(self.ttft), "tpot_ms": ms(self.tpot),
                "e2e_latency_ms": ms(self.latency), "queue_wait_ms": ms(self.queue_wait)}


def distribution(values_s: list[float]) -> dict:
    """mean/p50/p95/p99 in milliseconds of values in seconds; None for an empty list."""
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    a = np.asarray(values_s, dtype=np.float64) * 1e3
    return {"mean": float(a.mean()),
            **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


def run_metrics(records: list[RequestRecord], duration_s: float) -> dict:
    """The metrics of one run over its records (failed requests count only as failed)."""
    done = [r for r in records if r.completed]
    n_in = sum(r.prompt_tokens for r in done)
    n_out = sum(r.output_tokens for r in done)
    lags = [r.submit - r.due for r in records if r.due is not None]
    return {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(done) / duration_s,
        "output_throughput": n_out / duration_s,
        "total_token_throughput": (n_in + n_out) / duration_s,
        "ttft_ms": distribution([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": distribution([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": distribution([x for r in done for x in r.itls]),
        "e2e_latency_ms": distribution([r.latency for r in done if r.latency is not None]),
        "queue_wait_ms": distribution([r.queue_wait for r in done if r.queue_wait is not None]),
        "submit_lag_ms": distribution(lags),
    }


def summarize(runs: list[dict]) -> dict:
    """Mean over runs of every numeric leaf (None where any run has None), plus the spread
    of the headline throughput."""
    if not runs:
        return {}
    out = _mean_tree(runs)
    tput = [r["output_throughput"] for r in runs if "output_throughput" in r]
    if tput:
        out["output_throughput_min"] = min(tput)
        out["output_throughput_max"] = max(tput)
    out["num_runs"] = len(runs)
    return out


def _mean_tree(items: list):
    first = items[0]
    if isinstance(first, dict):
        return {k: _mean_tree([it.get(k) for it in items]) for k in first
                if not isinstance(first[k], list)}
    if any(v is None for v in items):
        return None
    if isinstance(first, bool) or not all(isinstance(v, (int, float)) for v in items):
        return first if all(v == first for v in items) else None
    return float(sum(items) / len(items))
