"""Prometheus metrics of one worker, under vLLM's names with the ``roseinfer:`` prefix, so
dashboards and alerts written for vLLM work after a prefix swap.

Times are taken in the worker: a request arrives when Redis added its entry (the entry ID
is a timestamp), is admitted when the worker hands it to the engine, and its tokens come
out of engine.step().
"""
from __future__ import annotations

from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# vLLM's buckets, with finer ones at the low end: GPU decode steps take milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class Metrics:
    """The worker's metrics in their own registry (several workers may share a process)."""

    def __init__(self, model_name: str = "", registry: Optional[CollectorRegistry] = None):
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name

        def metric(kind, name, doc, extra_labels=(), **kw):
            m = kind(f"roseinfer:{name}", doc, ("model_name",) + extra_labels,
                     registry=self.registry, **kw)
            return m if extra_labels else m.labels(model_name)

        self.running = metric(Gauge, "num_requests_running", "Requests in the running batch.")
        self.waiting = metric(Gauge, "num_requests_waiting", "Requests admitted, waiting for KV cache.")
        self.kv_cache_usage = metric(Gauge, "kv_cache_usage_perc", "KV cache usage (1 = full).")
        self.preemptions = metric(Counter, "num_preemptions", "Preempted (recomputed) requests.")
        self.prompt_tokens = metric(Counter, "prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = metric(Counter, "generation_tokens", "Tokens generated.")
        self._success = metric(Counter, "request_success", "Finished requests by finish reason.",
                               ("finished_reason",))
        for reason in FINISH_REASONS:  # present at 0 from the start, for rate() and alerts
            self._success.labels(model_name, reason)
        self.ttft = metric(Histogram, "time_to_first_token_seconds",
                           "From the request entry's arrival to its first token.",
                           buckets=TTFT_BUCKETS)
        self.itl = metric(Histogram, "inter_token_latency_seconds",
                          "Between consecutive tokens of a request.", buckets=ITL_BUCKETS)
        self.e2e = metric(Histogram, "e2e_request_latency_seconds",
                          "From the request entry's arrival to its final chunk.",
                          buckets=REQUEST_BUCKETS)
        self.queue_time = metric(Histogram, "request_queue_time_seconds",
                                 "From the request entry's arrival until a worker admitted it.",
                                 buckets=REQUEST_BUCKETS)
        self.resumed = metric(Counter, "requests_resumed",
                              "Requests taken over from another worker (or a failed step).")
        self.routed = metric(Counter, "requests_routed",
                             "Request entries handed to the worker holding their prompt's prefix.")
        self.dead_lettered = metric(Counter, "requests_dead_lettered",
                                    "Entries moved to P:dead after too many deliveries.")
        self.step_failures = metric(Counter, "engine_step_failures", "engine.step() exceptions.")
        self.redis_outages = metric(Counter, "redis_outages", "Times Redis became unreachable.")
        # Speculative decoding (core/speculation.py), under vLLM's names.
        self.spec_drafts = metric(Counter, "spec_decode_num_drafts", "Drafts checked.")
        self.spec_draft_tokens = metric(Counter, "spec_decode_num_draft_tokens",
                                        "Draft tokens checked.")
        self.spec_accepted = metric(Counter, "spec_decode_num_accepted_tokens",
                                    "Draft tokens accepted.")
        self.spec_acceptance = metric(Gauge, "spec_decode_draft_acceptance_rate",
                                      "Accepted draft tokens over draft tokens checked, "
                                      "since start.")
        self.loras = metric(Gauge, "lora_adapters", "LoRA adapters this worker serves.")
        self.lora_swaps = metric(Counter, "lora_swaps",
                                 "Adapter slots filled: adapters moved to the GPU.")
        self._seen = {"num_preemptions": 0, "num_drafts": 0, "num_draft_tokens": 0,
                      "num_accepted_tokens": 0, "num_lora_swaps": 0}

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def engine_stats(self, stats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.loras.set(stats.num_loras)
        # The engine counts since it started; each counter takes the increase.
        for name, counter in (("num_preemptions", self.preemptions),
                              ("num_lora_swaps", self.lora_swaps),
                              ("num_drafts", self.spec_drafts),
                              ("num_draft_tokens", self.spec_draft_tokens),
                              ("num_accepted_tokens", self.spec_accepted)):
            total = getattr(stats, name)
            counter.inc(max(0, total - self._seen[name]))
            self._seen[name] = total
        if stats.num_draft_tokens:
            self.spec_acceptance.set(stats.num_accepted_tokens / stats.num_draft_tokens)


def serve(metrics: Metrics, port: int, addr: str = "0.0.0.0") -> Callable[[], None]:
    """Serve /metrics over HTTP from a thread; returns the function that stops it."""
    server, thread = start_http_server(port, addr, registry=metrics.registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join()

    return stop
