"""Benchmark harness: `roseinfer bench offline | serve | plot` (docs/benchmarks.md)."""
