"""What the engine hands back: one delta per request that progressed in a step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from roseinfer.core.request import Sequence


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]      # ids generated in this step
    new_text: str                 # text released in this step
    finished: bool
    finish_reason: Optional[str]  # "stop" | "length" | "abort" once finished
    seq: Sequence

    # The whole-request views are built on access: per-step deltas stay O(new tokens).
    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seq.token_ids[:self.seq.num_prompt_tokens]

    @property
    def token_ids(self) -> list[int]:
        """Every generated id so far (a stop id that ended the request included)."""
        return self.seq.output_ids

    @property
    def text(self) -> str:
        """Generated text so far, stop strings cut off."""
        return self.seq.detok.text if self.seq.detok is not None else ""

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens
