"""Clock helpers: one clock everywhere, and a device sync before reading it on CUDA."""
from __future__ import annotations

import time

import torch


def sync(device) -> None:
    """Wait for queued GPU work, so that a timestamp taken next covers it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def now() -> float:
    return time.monotonic()


def sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)
