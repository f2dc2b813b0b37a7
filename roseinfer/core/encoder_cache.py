"""The vision tower's features of recent images, by the image's content (its prepared
pixels' digest): the same image in the next turn of a conversation, or in another
request, is not encoded again (core/multimodal.py); sent again as the same bytes, it is
not even prepared again (decoded, resized), which on a GPU was most of such a turn's TTFT.
Held in host memory, least recently used first out past a byte budget: a 1,024 x 1,024
image's features on the Qwen2.5-VL-7B shape are 1,369 x 3,584 bfloat16 values, 9.8 MB, so
the default holds about 50 of them, and the GPU memory the KV cache was sized for is never
taken."""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch

DEFAULT_BYTES = 512 << 20
MAX_SENT = 4096  # images as sent remembered (a few dozen bytes each), oldest out first


class EncoderCache:
    def __init__(self, max_bytes: int = DEFAULT_BYTES):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = self.misses = 0
        self._features: OrderedDict[int, torch.Tensor] = OrderedDict()
        # an image as sent (its bytes' digest) -> (its grid, its prepared pixels' digest)
        self._sent: dict[int, tuple[torch.Tensor, int]] = {}
        self._naming = threading.Lock()  # a worker's reader threads name images at once

    def seen(self, source: int) -> tuple[torch.Tensor, int] | None:
        """(grid, key) of an image sent before whose features are held: what a worker's
        reader thread asks, so it reads and changes no order."""
        seen = self._sent.get(source)
        return seen if seen is not None and seen[1] in self._features else None

    def name(self, source: int, grid: torch.Tensor, key: int) -> None:
        """An image as sent, prepared to ``grid`` and pixels of digest ``key``."""
        with self._naming:
            if len(self._sent) >= MAX_SENT:
                self._sent.pop(next(iter(self._sent)))
            self._sent[source] = (grid, key)

    def get(self, key: int) -> torch.Tensor | None:
        features = self._features.get(key)
        if features is None:
            self.misses += 1
            return None
        self.hits += 1
        self._features.move_to_end(key)
        return features

    def put(self, key: int, features: torch.Tensor) -> None:
        """Keeps a host copy of ``features``; one larger than the whole budget is not kept."""
        size = features.numel() * features.element_size()
        if key in self._features or size > self.max_bytes:
            return
        self._features[key] = features.to("cpu", copy=True)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self._features.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()

    def __len__(self) -> int:
        return len(self._features)
