"""Images prepared a second on one core: what a worker's reader thread does with each image
of a request (core/multimodal.py ``preprocess``: decode the encoded bytes, check, resize
and normalise with Qwen2.5-VL's image processor, cut into patches), for PNG and JPEG
photos-like random images of a few sizes, one thread. The processor as the
qwen2.5-vl-7b-random shape builds it (the processor's default pixel bounds) and with a
Qwen2.5-VL checkpoint's (up to 12.8 M pixels).

    python3 docs/bench/image_prepare.py [--sizes 512,1024,2048] [--seconds 3]
"""
import argparse
import io
import time

import numpy as np
import torch

from roseinfer.core import multimodal

CHECKPOINT = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14,
              "temporal_patch_size": 2, "merge_size": 2}


class Processor:
    """Just what ``preprocess`` reads of a model: its processor (and that it takes images)."""

    def __init__(self, settings: dict):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil)
        self.image_processor = Qwen2VLImageProcessorPil.from_dict(settings)

    def encode_images(self, *args):
        raise NotImplementedError


def encoded(size: int, kind: str) -> bytes:
    from PIL import Image

    # smooth gradients with noise: closer to a photo's compression than pure noise
    y, x = np.mgrid[0:size, 0:size] / size
    rgb = np.stack([x, y, (x + y) / 2], -1) * 200 + np.random.RandomState(0).rand(size, size, 3) * 55
    out = io.BytesIO()
    Image.fromarray(rgb.astype("uint8")).save(out, format=kind)
    return out.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="512,1024,2048")
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    processors = {"defaults": Processor({"patch_size": 14, "temporal_patch_size": 2,
                                         "merge_size": 2}),
                  "checkpoint": Processor(CHECKPOINT)}
    for size in map(int, args.sizes.split(",")):
        for kind in ("PNG", "JPEG"):
            data = encoded(size, kind)
            for name, model in processors.items():
                n, start = 0, time.perf_counter()
                while time.perf_counter() - start < args.seconds or n < 3:
                    pixels = multimodal.preprocess(model, [data])
                    n += 1
                rate = n / (time.perf_counter() - start)
                tokens = int(pixels.grids.prod()) // 4
                print(f"{size:5d}x{size:<5d} {kind:4} ({len(data) / 1e6:5.2f} MB), processor "
                      f"{name:10}: {rate:6.1f} images/s on one core, {tokens} image tokens",
                      flush=True)


if __name__ == "__main__":
    main()
