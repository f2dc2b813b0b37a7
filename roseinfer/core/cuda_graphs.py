"""CUDA graphs for decode steps, one per batch-size bucket and KV-append variant.

Captured once at start-up. A decode batch of S rows replays the graph of the
smallest bucket >= S; padding rows write to the scratch block and their
logits are dropped. Attention is captured with the context bound
(max_model_len), so one graph serves every context length.

With decode windows, each bucket also gets a window graph: ``decode_steps``
steps captured back to back (each step samples, greedily or not, and
advances the inputs on the device), so a full greedy window is one replay. Replays of
one-step graphs each cost host time and a gap on the GPU between graphs.
"""
from __future__ import annotations

import bisect
import logging
import time

import torch

from roseinfer.core.kv_cache import SlotBatch
from roseinfer.core.step_inputs import PackedInputs

log = logging.getLogger(__name__)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16))
    return sorted({min(s, max_num_seqs) for s in sizes})


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int, window: int):
        self.runner = runner
        self.sizes = bucket_sizes(max_num_seqs)
        self.window_len = window
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.windows: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, str], torch.Tensor] = {}
        self.pool = None
        self.prepared: tuple[int, str] | None = None

    def bucket(self, n_seq: int):
        i = bisect.bisect_left(self.sizes, n_seq)
        return self.sizes[i] if i < len(self.sizes) else None

    def _variants(self, ctx) -> set[str]:
        """The KV-append backends that "auto" (or the configured name) picks for
        decode batches with and without one shared offset."""
        cache, slots = self.runner.kv_cache, ctx.slots
        unshared = SlotBatch(slots.block_idx, slots.offsets)
        return {cache.select(slots), cache.select(unshared)}

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        for size in reversed(self.sizes):  # largest first: later graphs reuse its pool
            for name in sorted(self._variants(self._dummy(size)[0])):
                # fresh inputs each time: the warm-up run advances them
                self._capture_one(size, name, *self._dummy(size))
        torch.cuda.synchronize()
        log.info("captured %d decode CUDA graphs in %.1fs",
                 len(self.graphs) + len(self.windows), time.perf_counter() - start)

    def _dummy(self, size: int):
        """(context, device inputs) of a decode batch of padding rows."""
        r = self.runner
        host = r.stager.host_views(size, size)
        _dummy_decode(host, r.kv_cache.scratch_block, r.rows.pad_row)
        inp = r.to_device(host)
        return r.context(inp, 1, r.max_model_len), inp

    def _capture_one(self, size, name, ctx, inp) -> None:
        r = self.runner
        r.kv_cache.force(name)
        try:
            r.capture_step(ctx, inp)  # warm-up: compiles kernels outside the capture
            torch.cuda.synchronize()
            if self.window_len > 1:
                self.windows[size, name] = self._graph(ctx, inp, self.window_len)[0]
            self.graphs[size, name], self.logits[size, name] = self._graph(ctx, inp, 1)
        finally:
            r.kv_cache.force(None)

    def _graph(self, ctx, inp, steps: int):
        """A graph of ``steps`` decode steps; returns it and the last step's logits."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            for _ in range(steps):
                logits = self.runner.capture_step(ctx, inp)
        self.pool = self.pool or graph.pool()
        return graph, logits

    def prepare(self, size: int, host: PackedInputs, n_seq: int, num_samples: int):
        """Load the step's inputs into the bucket's graph; returns (device inputs,
        a function that replays the graph and returns the sampling rows' logits)."""
        r = self.runner
        shared = bool((host.offsets[:n_seq] == host.offsets[0]).all())
        if shared:  # padding rows (scratch block) follow the real rows' offset
            host.offsets[n_seq:] = host.offsets[0]
        inp = r.to_device(host)
        slots = SlotBatch(inp.block_idx, inp.offsets, shared_offset=inp.offsets[:1] if shared else None)
        name = r.kv_cache.select(slots)
        self.prepared = size, name
        graph, logits = self.graphs[size, name], self.logits[size, name]
        sample_idx = inp.sample_idx[:num_samples]

        def run(_step: int) -> torch.Tensor:
            r.kv_cache.steps_by_backend[name] += 1
            graph.replay()
            # Rows that do not sample (a one-token prefill chunk that is not
            # the prompt's last) are rare: the common case is a plain slice.
            return logits[sample_idx] if num_samples < n_seq else logits[:n_seq]
        return inp, run

    def run_window(self, steps: int) -> None:
        """Run ``steps`` steps of the prepared bucket (each graph samples
        and advances by itself): one replay of its window graph when the
        window is full, else one replay per step."""
        key = self.prepared
        self.runner.kv_cache.steps_by_backend[key[1]] += steps
        if steps == self.window_len and key in self.windows:
            self.windows[key].replay()
            return
        for _ in range(steps):
            self.graphs[key].replay()


def _dummy_decode(host: PackedInputs, scratch_block: int, pad_row: int) -> None:
    host.input_ids[:] = 0
    host.src_rows[:] = -1
    host.positions[:] = 0
    host.block_idx[:] = scratch_block
    host.offsets[:] = 0
    host.context_lens[:] = 1
    host.query_start[:] = range(host.n_seq + 1)
    host.sample_idx[:] = range(host.n_seq)
    host.sample_seq_rows[:] = pad_row
    host.seq_rows[:] = pad_row
    host.window_step[:] = 0
