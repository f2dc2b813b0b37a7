"""The vision tower as a phase of the engine's step: queued requests' images are encoded
a budget of image tokens at a time, images of several requests in one call of the tower,
before the step is scheduled; a request waits in the queue (the scheduler's ``admits``,
``_encoded`` in core/engine.py) until all its images have their features. So a burst of
image requests adds at most one budget's encoding to each step of the sequences decoding
meanwhile, instead of every image's encoding to the step that admits it, and the tower
runs batched. On a GPU (``EngineConfig.encoder_beside_steps``) the call runs beside the
steps instead (core/side_work.py): a step starts it and a later step takes its features,
so no decode step waits for the tower; a step with nothing else to run waits for it.

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
from roseinfer.core.side_work import SideWork


class ImageEncoder:
    def __init__(self, model, budget: int, cache: EncoderCache | None = None,
                 beside: bool = False):
        self.model, self.budget = model, budget  # image tokens a call, at least one image
        self.cache = cache if cache is not None else EncoderCache()
        self.pending: deque[Images] = deque()
        self.calls = 0  # the tower's calls, for tests and benchmarks
        self.device = model.embed_tokens.weight.device
        # where set, the tower runs beside the steps (core/side_work.py), a call at a time
        self.side = SideWork(self.device) if beside else None
        self.running: list[tuple[Images, int]] | None = None  # the call's batch

    def add(self, images: Images) -> None:
        if images.features is None:
            self.pending.append(images)

    def drop(self, images: Images) -> None:
        """A request that left before its images were encoded."""
        if images in self.pending:
            self.pending.remove(images)

    def step(self, wait: bool = False) -> list[tuple[Images, Exception]]:
        """Take the tower's finished call, if one is (``wait``: wait for it, as a step
        with nothing else to run does), and start the next on the oldest pending images
        up to the budget; returns the requests' Images whose encoding raised, with the
        error (they leave the queue). Without a side thread the call runs here."""
        failed = self._finish(self.side.result(wait)) if self.running is not None else []
        batch = self._take() if self.running is None else []
        if batch:
            parts = self._start(batch)
            if self.side is None:
                failed += self._finish(self._tower(parts))
            else:
                self.side.submit(lambda: self._tower(parts))
        for images in [imgs for imgs in self.pending if not imgs.missing()]:
            self.pending.remove(images)
            try:
                images.complete(self.device)
            except Exception as error:  # noqa: BLE001 - e.g. no device memory for them
                failed.append((images, error))
        return failed

    def close(self) -> None:
        if self.side is not None:
            self.side.close()

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

    def _start(self, batch: list[tuple[Images, int]]) -> list:
        """The batch's images the cache holds found; the parts of one call of the tower
        for the distinct others (by key)."""
        todo: dict[int, tuple[Images, int]] = {}
        for images, i in batch:
            cached = self.cache.get(images.keys[i])
            if cached is not None:
                images.found[i] = cached
            else:
                todo.setdefault(images.keys[i], (images, i))
        parts = [(key, imgs.patches[i], imgs.grids[i], imgs.counts[i], imgs)
                 for key, (imgs, i) in todo.items()]
        self.running = batch
        return parts

    def _finish(self, result) -> list[tuple[Images, Exception]]:
        """The running call's ``result`` (None: still running) into the cache and its
        Images; the requests whose images raised, out of the queue."""
        if result is None:
            return []
        features, errors = result
        batch, self.running = self.running, None
        for key, f in features.items():
            self.cache.put(key, f)
        for images, i in batch:
            if images.found[i] is None and images.keys[i] in features:
                images.found[i] = features[images.keys[i]]
        for images, error in errors:
            self.drop(images)
        return errors

    def _tower(self, parts) -> tuple[dict, list]:
        """(features by key, [(Images, error)]): one call of the tower for all the parts
        (key, patches, grid, tokens, their Images); where it raises, each request's parts
        alone, so that only the request whose images raise fails. Runs on the side
        thread where there is one: it reads only ``parts`` and the model."""
        if not parts:
            return {}, []
        try:
            return self._call(parts), []
        except Exception:  # noqa: BLE001 - tried again request by request
            features, errors = {}, []
            for owner in {id(p[4]): p[4] for p in parts}.values():
                try:
                    features.update(self._call([p for p in parts if p[4] is owner]))
                except Exception as error:  # noqa: BLE001 - this request's images raise
                    errors.append((owner, error))
            return features, errors

    def _call(self, parts) -> dict:
        out = self.model.encode_images(torch.cat([p[1] for p in parts]),
                                       torch.stack([p[2] for p in parts]))
        self.calls += 1
        return dict(zip([p[0] for p in parts], out.split([p[3] for p in parts])))
