"""Work run beside the engine's steps: one call at a time on a thread of its own and, on a
GPU, a CUDA stream of its own, so that the steps of the sequences decoding meanwhile are
not held up by it (the vision tower: core/image_encoder.py). The host part of the call
(Python launching kernels) runs on the thread, and the kernels on the stream, beside the
step's; ``ready`` says when both have finished, without waiting."""
from __future__ import annotations

import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

# A thread that wants the GIL waits up to this long for the one holding it (Python's
# default, 5 ms, is a decode step's whole time on a GPU): the step loop gets it back
# within half a millisecond of the side thread's launches.
SWITCH_INTERVAL_S = 0.0005


class SideWork:
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="roseinfer-side")
        self.future: Future | None = None
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))

    def submit(self, fn: Callable[[], object]) -> None:
        assert self.future is None, "one call at a time"
        self.future = self.pool.submit(self._run, fn)

    def ready(self) -> bool:
        """Whether the call (host and device) has finished: its result can be taken."""
        if self.future is None or not self.future.done():
            return False
        if self.future.exception() is not None:
            return True
        done = self.future.result()[1]
        return done is None or done.query()

    def result(self, wait: bool = False):
        """The call's result, taken (raising what it raised); None if it is not ready and
        ``wait`` is not set. Tensors it made on the side stream are marked as used by the
        current one, so that their memory is not handed back to the side stream while the
        steps still read it."""
        if self.future is None or not (wait or self.ready()):
            return None
        future, self.future = self.future, None
        out, done = future.result()
        if done is not None:
            done.synchronize()
            current = torch.cuda.current_stream(self.device)
            for t in _tensors(out):
                if t.is_cuda:
                    t.record_stream(current)
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def _run(self, fn):
        with torch.inference_mode():  # thread-local: the steps' thread has its own
            if self.stream is None:
                return fn(), None
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                self.stream.wait_stream(torch.cuda.default_stream(self.device))
                out = fn()
                done = torch.cuda.Event()
                done.record(self.stream)
            return out, done


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
