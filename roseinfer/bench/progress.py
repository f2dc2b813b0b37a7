"""Progress of a run in generated tokens, refreshed at most once a second (cheap per step)."""
from __future__ import annotations

import sys


class Progress:
    def __init__(self, total_tokens: int, desc: str, enabled: bool = True):
        self._bar = None
        self._pending = 0
        self._last = 0.0
        if enabled:
            from tqdm import tqdm
            self._bar = tqdm(total=total_tokens, desc=desc, unit="tok", file=sys.stderr,
                             mininterval=1.0, leave=False, dynamic_ncols=True)

    def advance(self, t: float, tokens: int) -> None:
        if self._bar is None:
            return
        self._pending += tokens
        if t - self._last >= 1.0:
            self._bar.update(self._pending)
            self._pending, self._last = 0, t

    def close(self) -> None:
        if self._bar is not None:
            self._bar.update(self._pending)
            self._bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
