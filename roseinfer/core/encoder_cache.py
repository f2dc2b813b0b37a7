"""The vision tower's features of recent images, by the image's content (its prepared
pixels' digest): the same image in the next turn of a conversation, or in another
request, is not encoded again (core/multimodal.py). Held in host memory, least recently
used first out past a byte budget: a 1,024 x 1,024 image's features on the Qwen2.5-VL-7B
shape are 1,369 x 3,584 bfloat16 values, 9.8 MB, so the default holds about 50 of them,
and the GPU memory the KV cache was sized for is never taken."""
from __future__ import annotations

from collections import OrderedDict

import torch

DEFAULT_BYTES = 512 << 20


class EncoderCache:
    def __init__(self, max_bytes: int = DEFAULT_BYTES):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = self.misses = 0
        self._features: OrderedDict[int, torch.Tensor] = OrderedDict()

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
