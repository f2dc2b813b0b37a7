"""CUDA graphs for steps: decode graphs per batch-size bucket and KV-append
variant, and mixed graphs (prefill chunks with or without decode rows) per
token-count bucket.

Captured once at start-up. A decode batch of S rows replays the graph of the
smallest bucket >= S; padding rows write to the scratch block and their
logits are dropped. Attention is captured with the context bound
(max_model_len), so one graph serves every context length.

With decode windows, each bucket also gets a window graph: ``decode_steps``
steps captured back to back (each step samples, greedily or not, and
advances the inputs on the device), so a full greedy window is one replay. Replays of
one-step graphs each cost host time and a gap on the GPU between graphs.

A step that carries a prefill chunk has N tokens over S sequences in any
split. Its graph is captured for a token bucket >= N and ``max_num_seqs + 1``
sequences: the paged attention kernel's grid depends only on (N, S), and
sequences with no tokens cost it one idle program each. The spare sequence
takes the padding tokens (step_inputs._pad). Without these graphs a mixed
step launches every kernel from Python, which under steady arrivals is most
steps (docs/benchmarks.md, "Latency against arrival rate").
"""
from __future__ import annotations

import bisect
import logging
import time
from typing import NamedTuple

import torch

from roseinfer.core.kv_cache import SlotBatch
from roseinfer.core.step_inputs import PackedInputs, fill

log = logging.getLogger(__name__)


class Layout(NamedTuple):
    """The (tokens, sequences) a step is padded to, and which graph runs it: a
    verify graph (``all_logits``) is laid out as a mixed one."""
    n_tok: int
    n_seq: int
    mixed: bool
    all_logits: bool = False


def bucket_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16))
    return sorted({min(s, max_num_seqs) for s in sizes})


def token_buckets(max_tokens: int) -> list[int]:
    """Mixed-step buckets: steps of 64 tokens to 512, of 128 to 1024, then
    of 256, so padding stays within about an eighth of a step's tokens."""
    sizes, size = [], 64
    while size < max_tokens:
        sizes.append(size)
        size += 64 if size < 512 else 128 if size < 1024 else 256
    return sizes + [max_tokens] if max_tokens > 0 else []


def verify_buckets(max_tokens: int, per_seq: int) -> list[int]:
    """Verify-step buckets: 1, 2, 4, ... sequences of ``per_seq`` tokens (k + 1), then the
    largest. Padding rows are rows every layer computes: on the 8B shape at batch 1, a
    verify step of 5 rows took 1.22x a plain step, 8 rows 1.24x (docs/benchmarks.md)."""
    sizes, n = [], per_seq
    while 0 < n < max_tokens:
        sizes.append(n)
        n *= 2
    return sizes + [max_tokens] if max_tokens > 0 else []


def _smallest_at_least(sizes: list[int], n: int):
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def padding_step(runner, layout: Layout, adapted: bool = True):
    """(context, device inputs) of a step of padding only: its tokens write the scratch
    block, and attention reads up to the longest context. ``adapted``: the graph holds
    the LoRA launches (runner.context)."""
    host = runner.stager.host_views(layout.n_tok, layout.n_seq)
    fill(host, [], [], runner.block_size, runner.rows, runner.kv_cache.scratch_block)
    inp = runner.to_device(host)
    # a mixed graph holds the prefill attention kernel: any query length > 1 picks it
    return runner.context(inp, 2 if layout.mixed else 1, runner.max_model_len, adapted), inp


class StepGraphs:
    def __init__(self, runner, max_num_seqs: int, window: int, mixed_max_tokens: int,
                 verify_tokens: tuple[int, int] = (0, 0)):
        self.runner = runner
        self.sizes = bucket_sizes(max_num_seqs)
        self.token_sizes = token_buckets(mixed_max_tokens)
        self.verify_sizes = verify_buckets(*verify_tokens)
        self.mixed_seqs = max_num_seqs + 1
        self.window_len = window
        # keys: (tokens, KV-append backend); decode graphs have tokens == sequences, and
        # on an engine with LoRA adapters (runner.lora) a third part: whether the graph
        # holds the LoRA launches. Base requests then pay nothing for them: 1.138x the
        # base model's step on the 8B shape before (docs/benchmarks.md).
        self.adapted = (False, True) if runner.lora else (False,)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.windows: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.mixed: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.verify: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple, torch.Tensor] = {}
        self.verify_logits: dict[tuple[int, str], torch.Tensor] = {}
        self.mixed_backend = ""
        self.pool = None
        self.prepared: tuple[dict, tuple[int, str]] | None = None

    def layout(self, n_tok: int, n_seq: int, verify: bool = False) -> Layout | None:
        """The captured layout a step of ``n_tok`` tokens over ``n_seq``
        sequences runs in, or None (too big: it runs eagerly). ``verify``: the
        step checks drafts, and needs every token's logits."""
        if verify:
            size = _smallest_at_least(self.verify_sizes, n_tok)
            return Layout(size, self.mixed_seqs, True, True) if size else None
        if n_tok == n_seq:
            size = _smallest_at_least(self.sizes, n_seq)
            return Layout(size, size, False) if size else None
        size = _smallest_at_least(self.token_sizes, n_tok)
        return Layout(size, self.mixed_seqs, True) if size else None

    def _variants(self, ctx) -> set[str]:
        """The KV-append backends that "auto" (or the configured name) picks for
        decode batches with and without one shared offset."""
        cache, slots = self.runner.kv_cache, ctx.slots
        unshared = SlotBatch(slots.block_idx, slots.offsets)
        return {cache.select(slots), cache.select(unshared)}

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        # Largest first: later graphs reuse its memory pool.
        for size in reversed(self.token_sizes):
            ctx, inp = padding_step(self.runner, Layout(size, self.mixed_seqs, True))
            ctx.slots.shared_offset = None  # mixed steps' offsets differ
            self.mixed_backend = self.mixed_backend or self.runner.kv_cache.select(ctx.slots)
            self._capture_mixed(size, ctx, inp)
        for size in reversed(self.verify_sizes):
            ctx, inp = padding_step(self.runner, Layout(size, self.mixed_seqs, True))
            ctx.slots.shared_offset = None
            self.mixed_backend = self.mixed_backend or self.runner.kv_cache.select(ctx.slots)
            ((graph, logits),) = self._capture(self.runner.capture_verify, self.mixed_backend,
                                                ctx, inp, (1,))
            self.verify[size, self.mixed_backend] = graph
            self.verify_logits[size, self.mixed_backend] = logits
        for size in reversed(self.sizes):
            layout = Layout(size, size, False)
            for name in sorted(self._variants(padding_step(self.runner, layout)[0])):
                for adapted in self.adapted:
                    # fresh inputs each time: the warm-up run advances them
                    self._capture_decode((size, name, adapted),
                                         *padding_step(self.runner, layout, adapted))
        torch.cuda.synchronize()
        log.info("captured %d CUDA graphs (%d for mixed steps, %d for verify steps) in %.1fs",
                 len(self.graphs) + len(self.windows) + len(self.mixed) + len(self.verify),
                 len(self.mixed), len(self.verify), time.perf_counter() - start)

    def _capture_decode(self, key, ctx, inp) -> None:
        step, name = self.runner.capture_step, key[1]
        if self.window_len > 1:
            window, one = self._capture(step, name, ctx, inp, (self.window_len, 1))
            self.windows[key] = window[0]
        else:
            (one,) = self._capture(step, name, ctx, inp, (1,))
        self.graphs[key], self.logits[key] = one

    def _capture_mixed(self, size, ctx, inp) -> None:
        name = self.mixed_backend
        ((self.mixed[size, name], _),) = self._capture(self.runner.capture_mixed, name, ctx, inp, (1,))

    def _capture(self, step, name, ctx, inp, lengths):
        """Graphs of ``step`` repeated each of ``lengths`` times, with the KV-append
        backend ``name``, after one warm-up call (it compiles kernels outside the
        capture)."""
        cache = self.runner.kv_cache
        cache.force(name)
        try:
            step(ctx, inp)
            torch.cuda.synchronize()
            return [self._graph(step, ctx, inp, n) for n in lengths]
        finally:
            cache.force(None)

    def _graph(self, step, ctx, inp, steps: int):
        """A graph of ``steps`` calls of ``step``; returns it and the last call's result."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            for _ in range(steps):
                out = step(ctx, inp)
        self.pool = self.pool or graph.pool()
        return graph, out

    def prepare(self, layout: Layout, host: PackedInputs, n_seq: int, num_samples: int,
                extra_rows=None):
        """Load the step's inputs into the layout's graph; returns (device inputs,
        a function that replays a decode or verify graph and returns the sampling
        rows' logits, then ``extra_rows``'). A mixed graph samples by itself: run it
        with run_window."""
        r = self.runner
        if layout.all_logits:
            return self._prepare_verify(layout, host, num_samples, extra_rows)
        if layout.mixed:
            self.prepared = self.mixed, (layout.n_tok, self.mixed_backend)
            return r.to_device(host), None
        shared = bool((host.offsets[:n_seq] == host.offsets[0]).all())
        if shared:  # padding rows (scratch block) follow the real rows' offset
            host.offsets[n_seq:] = host.offsets[0]
        inp = r.to_device(host)
        slots = SlotBatch(inp.block_idx, inp.offsets, shared_offset=inp.offsets[:1] if shared else None)
        key = layout.n_tok, r.kv_cache.select(slots), r.adapted(host)
        self.prepared = self.graphs, key
        graph, logits = self.graphs[key], self.logits[key]
        sample_idx = inp.sample_idx[:num_samples]

        def run(_step: int) -> torch.Tensor:
            r.kv_cache.steps_by_backend[key[1]] += 1
            graph.replay()
            # Rows that do not sample (a one-token prefill chunk that is not
            # the prompt's last) are rare: the common case is a plain slice.
            return logits[sample_idx] if num_samples < n_seq else logits[:n_seq]
        return inp, run

    def _prepare_verify(self, layout: Layout, host: PackedInputs, num_samples: int, extra_rows):
        r = self.runner
        inp = r.to_device(host)
        key = layout.n_tok, self.mixed_backend
        graph, logits = self.verify[key], self.verify_logits[key]
        rows = inp.sample_idx[:num_samples].long()
        if extra_rows is not None:
            rows = torch.cat([rows, extra_rows])

        def run(_step: int) -> torch.Tensor:
            r.kv_cache.steps_by_backend[key[1]] += 1
            graph.replay()
            return logits[rows]
        return inp, run

    def run_window(self, steps: int) -> None:
        """Run ``steps`` steps of the prepared graph (each samples and
        advances by itself): one replay of its window graph when the window
        is full, else one replay per step."""
        graphs, key = self.prepared
        self.runner.kv_cache.steps_by_backend[key[1]] += steps
        if steps == self.window_len and key in self.windows and graphs is self.graphs:
            self.windows[key].replay()
            return
        for _ in range(steps):
            graphs[key].replay()
