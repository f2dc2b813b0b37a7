"""Builds one step's input tensors, runs the model and samples."""
from __future__ import annotations

import numpy as np
import torch

from roseinfer.core.attention import AttnMetadata, StepContext, set_context
from roseinfer.core.kv_cache import KVCache, SlotBatch
from roseinfer.core.sampling import Sampler
from roseinfer.core.scheduler import ScheduledBatch


class StepInputs:
    """Host-side arrays for one step, built in one O(tokens) pass."""

    def __init__(self, batch: ScheduledBatch, block_size: int):
        n_tok = sum(batch.num_tokens)
        self.input_ids = np.empty(n_tok, dtype=np.int64)
        self.positions = np.empty(n_tok, dtype=np.int64)
        self.query_start = np.zeros(len(batch) + 1, dtype=np.int32)
        self.context_lens = np.empty(len(batch), dtype=np.int32)
        width = max(len(s.block_table) for s in batch.seqs)
        self.block_tables = np.zeros((len(batch), width), dtype=np.int32)
        self.sample_rows: list[int] = []   # batch rows whose chunk ends the sequence
        t = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            start = seq.num_computed
            self.input_ids[t:t + n] = seq.token_ids[start:start + n]
            self.positions[t:t + n] = np.arange(start, start + n)
            self.block_tables[i, :len(seq.block_table)] = seq.block_table
            t += n
            self.query_start[i + 1] = t
            self.context_lens[i] = start + n
            if start + n == seq.num_tokens:
                self.sample_rows.append(i)
        seq_of_token = np.repeat(np.arange(len(batch)), batch.num_tokens)
        self.block_idx = self.block_tables[seq_of_token, self.positions // block_size]
        self.offsets = (self.positions % block_size).astype(np.int32)
        self.max_query_len = max(batch.num_tokens)
        self.max_context_len = int(self.context_lens.max())


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, attention, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.device = device
        self.sampler = Sampler()

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device, non_blocking=True)

    def prepare(self, inp: StepInputs) -> StepContext:
        offsets = self._tensor(inp.offsets)
        shared = offsets[:1] if bool((inp.offsets == inp.offsets[0]).all()) else None
        slots = SlotBatch(self._tensor(inp.block_idx.astype(np.int32)), offsets,
                          shared_offset=shared)
        attn = AttnMetadata(self._tensor(inp.block_tables), self._tensor(inp.context_lens),
                            self._tensor(inp.query_start), inp.max_query_len,
                            inp.max_context_len)
        return StepContext(self.kv_cache, self.attention, attn, slots)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[int], list[int]]:
        """Returns (batch rows that sampled, their token ids)."""
        inp = StepInputs(batch, self.kv_cache.block_size)
        ctx = self.prepare(inp)
        self.kv_cache.begin_step(ctx.slots)
        set_context(ctx)
        try:
            hidden = self.model(self._tensor(inp.input_ids), self._tensor(inp.positions))
        finally:
            set_context(None)
        if not inp.sample_rows:
            return [], []
        last = (inp.query_start[1:][inp.sample_rows] - 1).astype(np.int64)
        logits = self.model.compute_logits(hidden[self._tensor(last)])
        seqs = [batch.seqs[r] for r in inp.sample_rows]
        tokens = self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs])
        return inp.sample_rows, tokens.tolist()
