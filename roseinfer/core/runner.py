"""Builds one step's inputs, runs the model (eagerly or as a CUDA graph), samples."""
from __future__ import annotations

import numpy as np
import torch

from roseinfer.core.attention import AttnMetadata, StepContext, set_context
from roseinfer.core.cuda_graphs import DecodeGraphs
from roseinfer.core.kv_cache import KVCache, SlotBatch
from roseinfer.core.sampling import Sampler
from roseinfer.core.scheduler import ScheduledBatch
from roseinfer.core.step_inputs import InputStager, PackedInputs, fill


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, attention, device: torch.device,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 cuda_graphs: bool):
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.device = device
        self.block_size = kv_cache.block_size
        self.max_blocks = -(-max_model_len // self.block_size)
        self.max_model_len = max_model_len
        tokens = max(max_num_batched_tokens, max_num_seqs)
        self.stager = InputStager(5 * tokens + 2 * max_num_seqs + 1
                                  + max_num_seqs * self.max_blocks, device)
        self.sampler = Sampler()
        self.graphs = None
        if cuda_graphs and device.type == "cuda":
            self.graphs = DecodeGraphs(self, max_num_seqs)
            self.graphs.capture()

    def context(self, inp: PackedInputs, max_query_len: int, max_context_len: int) -> StepContext:
        offsets = inp.offsets
        slots = SlotBatch(inp.block_idx, offsets, shared_offset=offsets[:1])
        attn = AttnMetadata(inp.block_tables, inp.context_lens, inp.query_start,
                            max_query_len, max_context_len)
        return StepContext(self.kv_cache, self.attention, attn, slots)

    def forward(self, ctx: StepContext, inp: PackedInputs, logits_rows=None) -> torch.Tensor:
        """Model forward under ``ctx``; logits of ``logits_rows`` (all rows if None)."""
        self.kv_cache.begin_step(ctx.slots)
        set_context(ctx)
        try:
            hidden = self.model(inp.input_ids, inp.positions)
        finally:
            set_context(None)
        if logits_rows is not None:
            hidden = hidden[logits_rows]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[int], list[int]]:
        """Returns (batch rows that sampled, their token ids)."""
        seqs, num_tokens = batch.seqs, batch.num_tokens
        n_tok, n_seq = sum(num_tokens), len(seqs)
        graph = self.graphs.bucket(n_seq) if self.graphs and n_tok == n_seq else None
        if graph is not None:
            host = self.stager.host_views(graph, graph, self.max_blocks)
        else:
            width = max(len(s.block_table) for s in seqs)
            host = self.stager.host_views(n_tok, n_seq, width)
        rows = fill(host, seqs, num_tokens, self.block_size, self.kv_cache.scratch_block)
        if graph is not None:
            logits = self.graphs.replay(graph, host, n_seq)[:n_seq]
        else:
            logits = self._eager(host, num_tokens, rows)
        if not rows:
            return [], []
        picked = [seqs[r] for r in rows]
        tokens = self.sampler(logits, [s.params for s in picked], [s.generator for s in picked])
        return rows, tokens.tolist()

    def _eager(self, host: PackedInputs, num_tokens, rows) -> torch.Tensor:
        shared = bool((host.offsets == host.offsets[0]).all())
        inp = self.stager.to_device(host)
        ctx = self.context(inp, max(num_tokens), int(host.context_lens.max()))
        if not shared:
            ctx.slots.shared_offset = None
        last = host.query_start[1:][rows].astype(np.int64) - 1
        return self.forward(ctx, inp, torch.from_numpy(last).to(self.device))
