"""The vision tower as a phase of the engine's step: queued requests' images are encoded
a budget of image tokens at a time, images of several requests in one call of the tower,
before the step is scheduled; a request waits in the queue (the scheduler's ``admits``,
``_encoded`` in core/engine.py) until all its images have their features. So a burst of
image requests adds at most one budget's encoding to each step of the sequences decoding
meanwhile, instead of every image's encoding to the step that admits it, and the tower
runs batched.

An image already in the encoder cache (core/encoder_cache.py) is never queued; one that
two queued requests share is encoded once. Where the tower raises on a batch, each
request's images are encoded alone, so that only the request whose images raise fails; a
request whose features cannot be put together (no device memory for them) fails too.
"""
from __future__ import annotations

from collections import deque

import torch

from roseinfer.core.encoder_cache import EncoderCache
from roseinfer.core.multimodal import Images


class ImageEncoder:
    def __init__(self, model, budget: int, cache: EncoderCache | None = None):
        self.model, self.budget = model, budget  # image tokens a step, at least one image
        self.cache = cache if cache is not None else EncoderCache()
        self.pending: deque[Images] = deque()
        self.calls = 0  # the tower's calls, for tests and benchmarks

    def add(self, images: Images) -> None:
        if images.features is None:
            self.pending.append(images)

    def drop(self, images: Images) -> None:
        """A request that left before its images were encoded."""
        if images in self.pending:
            self.pending.remove(images)

    def step(self) -> list[tuple[Images, Exception]]:
        """Encode the oldest pending images up to the budget; returns the requests' Images
        whose encoding raised, with the error (they leave the queue)."""
        if not self.pending:
            return []
        batch, failed = self._take(), []
        try:
            self._encode(batch)
        except Exception:  # noqa: BLE001 - tried again request by request
            for images in {id(imgs): imgs for imgs, _ in batch}.values():
                try:
                    self._encode([(images, i) for imgs, i in batch if imgs is images])
                except Exception as error:  # noqa: BLE001 - this request's images raise
                    failed.append((images, error))
                    self.drop(images)
        device = self.model.embed_tokens.weight.device
        for images in [imgs for imgs in self.pending if not imgs.missing()]:
            self.pending.remove(images)
            try:
                images.complete(device)
            except Exception as error:  # noqa: BLE001 - e.g. no device memory for them
                failed.append((images, error))
        return failed

    def _take(self) -> list[tuple[Images, int]]:
        """(Images, index) of the images to encode now, oldest first: one at least, then
        while the budget holds."""
        batch, tokens = [], 0
        for images in self.pending:
            for i in images.missing():
                if batch and tokens + images.counts[i] > self.budget:
                    return batch
                batch.append((images, i))
                tokens += images.counts[i]
        return batch

    def _encode(self, batch: list[tuple[Images, int]]) -> None:
        """One call of the tower for the batch's distinct images (by key) the cache does
        not hold; each image's features into its Images and the cache."""
        todo: dict[int, tuple[Images, int]] = {}
        for images, i in batch:
            key = images.keys[i]
            cached = self.cache.get(key)
            if cached is not None:
                images.found[i] = cached
            else:
                todo.setdefault(key, (images, i))
        if todo:
            parts = list(todo.values())
            features = self.model.encode_images(
                torch.cat([imgs.patches[i] for imgs, i in parts]),
                torch.stack([imgs.grids[i] for imgs, i in parts]))
            self.calls += 1
            for key, f in zip(todo, features.split([imgs.counts[i] for imgs, i in parts])):
                self.cache.put(key, f)
                todo[key] = f
        for images, i in batch:
            if images.found[i] is None:
                images.found[i] = todo[images.keys[i]]
