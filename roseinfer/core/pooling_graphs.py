"""CUDA graphs of an encoder's forward, one per token bucket (cuda_graphs.token_buckets up
to ``GRAPH_TOKENS``), for the pooling runner.

Eager, a BGE-large batch of 128 tokens took 15 ms of host time for 1.6 ms of GPU work on
an H200 (docs/bench/pooling_step.py), and beside decoding chats (core/paired_engine.py)
every chat's step waited for it. A batch of N tokens replays the graph of the smallest
bucket >= N: its tokens are copied into the graph's inputs, the rows past them are
padding that attends to nothing, and attention runs the packed kernel, whose grid does
not depend on how the tokens split into sequences (layers/packed_attention_kernel.py).
Larger batches, and decoder families (their own causal path), run eager.
"""
from __future__ import annotations

import bisect
import logging
import time

import torch

from roseinfer.core.cuda_graphs import token_buckets
from roseinfer.layers.encoder_attention import Packed
from roseinfer.layers.packed_attention_kernel import sequence_bounds

log = logging.getLogger(__name__)

GRAPH_TOKENS = 2048  # above this a batch's GPU work hides its launches


class EncoderGraphs:
    def __init__(self, model, device: torch.device, max_tokens: int):
        self.model, self.sizes = model, token_buckets(min(max_tokens, GRAPH_TOKENS))
        n = self.sizes[-1]
        new = lambda: torch.zeros(n, dtype=torch.long, device=device)  # noqa: E731
        self.ids, self.positions, self.types = new(), new(), new()
        self.bounds = torch.zeros(2, n, dtype=torch.int32, device=device)
        self.graphs, self.outputs, pool = {}, {}, None
        start = time.perf_counter()
        for size in reversed(self.sizes):  # the largest first: the others fit in its pool
            self.bounds.copy_(sequence_bounds([size], n))
            self.model(self.ids[:size], self._packed(size))  # compiles outside the capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(self.ids[:size], self._packed(size))
            pool = pool or graph.pool()
            self.graphs[size] = graph
        log.info("captured %d encoder graphs up to %d tokens in %.1fs", len(self.graphs), n,
                 time.perf_counter() - start)

    def _packed(self, size: int) -> Packed:
        """The packing the captured forward reads: the static inputs' first ``size`` rows
        (only positions, token types and bounds are read on this path)."""
        return Packed([size], self.positions[:size], self.types[:size], None, None, None,
                      None, None, self.bounds[:, :size])

    def forward(self, ids: torch.Tensor, packed: Packed) -> torch.Tensor | None:
        """The hidden states [N, H] of the batch, from its bucket's graph; None where the
        batch is larger than the largest."""
        n = ids.shape[0]
        i = bisect.bisect_left(self.sizes, n)
        if i == len(self.sizes):
            return None
        size = self.sizes[i]
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(packed.positions)
        self.types[:n].copy_(packed.token_types)
        self.bounds[:, :size].copy_(sequence_bounds(packed.lens, size))
        self.graphs[size].replay()
        return self.outputs[size][:n]
