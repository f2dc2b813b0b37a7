"""SamplingParams: what a request asks of the sampler, validated."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from roseinfer.core.errors import InvalidRequestError


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def bad(name, why):
            raise InvalidRequestError(name, why)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not is_number(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            bad("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not is_number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not (is_int(self.seed) and -2**63 <= self.seed < 2**64):
            bad("seed", f"must be a 64-bit integer or None, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of token ids (integers >= 0)")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", f"must be true or false, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    """A finite number: NaN and infinities are refused by name, never sampled with."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

