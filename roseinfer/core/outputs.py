"""What the engine hands back: one delta per request that progressed in a step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]          # every generated id so far (stop ids included)
    text: str                     # generated text so far, stop strings cut off
    new_token_ids: list[int]      # ids generated in this step
    new_text: str                 # text released in this step
    finished: bool
    finish_reason: Optional[str]  # "stop" | "length" | "abort" once finished

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
