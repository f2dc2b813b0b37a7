"""Prometheus metrics of one gateway, served on its own GET /metrics.

Times are the gateway's view: from the HTTP request's arrival to its first reply chunk
(TTFT, queue and prefill included) and to its end.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from roseinfer.frontends.redis_streams.metrics import REQUEST_BUCKETS, TTFT_BUCKETS


class GatewayMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("roseinfer:gateway_requests", "HTTP calls by endpoint and status.",
                                ("endpoint", "status"), registry=self.registry)
        self.in_flight = Gauge("roseinfer:gateway_requests_in_flight", "Calls being answered.",
                               registry=self.registry)
        self.ttft = Histogram("roseinfer:gateway_time_to_first_token_seconds",
                              "From the call's arrival to the first reply chunk.", ("endpoint",),
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.latency = Histogram("roseinfer:gateway_request_seconds",
                                 "From the call's arrival to its end.", ("endpoint",),
                                 buckets=REQUEST_BUCKETS, registry=self.registry)

    def ended(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
