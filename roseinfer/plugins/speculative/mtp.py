"""The checkpoint's own multi-token-prediction module drafts (DeepSeek-V3, GLM-4.5):
``--speculative mtp``.

After every step the model ran, the module runs over the same positions (those kept),
from the model's final hidden states there and the token after each (models/mtp.py),
writing its one layer's cache at the model's slots; its logits at a sequence's last
position give the token after next, which the next round drafts. Drafting or not, every
sequence goes through it each step, so its cache covers what the model's does: blocks
the prefix cache shares hold its rows too (copy-on-write copies them beside the
model's), and rows of rejected tokens are written over as the model's are.

One token a round: the module predicts the token after next, as it was trained
(DeepSeek-V3 reports 85-90 % of those kept). Drafts are its argmax, a deterministic
proposal, so the rejection rule keeps sampled rows' distribution exact.
"""
from __future__ import annotations

import torch

from roseinfer.core.attention import AttnMetadata, StepContext, set_context
from roseinfer.core.errors import ConfigError
from roseinfer.core.kv_cache import SlotBatch
from roseinfer.core.speculation import Draft


class MultiTokenPrediction:
    needs_hidden_states = True

    def __init__(self, ctx):
        from roseinfer.core.device_side import build_kv_cache
        from roseinfer.models import loader

        cfg, target = ctx.config, ctx.target
        if cfg.tensor_parallel_size > 1:
            raise ConfigError("speculative mtp runs on one device: use "
                              "tensor_parallel_size=1, or speculative ngram")
        if cfg.num_speculative_tokens not in (None, 1):
            raise ConfigError(f"speculative mtp drafts one token a round (the module "
                              f"predicts the token after next), not "
                              f"{cfg.num_speculative_tokens}: leave num_speculative_tokens "
                              f"unset or 1")
        weights = "float32" if cfg.cpu_weight_dtype == "gguf" else cfg.cpu_weight_dtype
        self.module = loader.load(target.spec, dtype=ctx.dtype, device=ctx.device,
                                  seed=(cfg.seed or 0) + 1, plugins=ctx.plugins,
                                  cpu_weight_dtype=weights, quantization=cfg.quantization,
                                  part="mtp")[0]
        self.module.share(target.model)
        # its one layer over the model's block ids; on a GPU out of the memory the model
        # left (a layer's share of the model's cache)
        self.cache = build_kv_cache(self.module, cfg, ctx.plugins, ctx.device, ctx.dtype,
                                    num_blocks=target.kv_cache.scratch_block)
        self.attention = target.runner.attention
        self.block_size = target.kv_cache.block_size
        target.runner.keep_hidden = True
        target.runner.side_caches.append(self.cache)
        self.device = ctx.device
        self.next: dict[str, tuple[int, int]] = {}  # by sequence key: (its length, draft)

    @staticmethod
    def needs_memory(cfg, hf_config, dtype, plugins) -> tuple[int, int]:
        """(the module's weight bytes in ``dtype``, its one cache layer)."""
        from roseinfer.models import loader

        module = loader.meta_module(hf_config, dtype, plugins, "mtp")
        return sum(p.numel() * p.element_size() for p in module.parameters()), 1

    def propose(self, seqs, room: list[int]) -> list:
        """The token the module predicted at each sequence's last position, if it ran
        there (it has not for a sequence whose last step it did not see)."""
        drafts = []
        for seq in seqs:
            length, token = self.next.get(seq.key, (-1, 0))
            drafts.append(Draft([token]) if length == len(seq.token_ids) else None)
        return drafts

    @torch.inference_mode()
    def observe(self, seqs, firsts: list[int], counts: list[int],
                hidden: torch.Tensor) -> None:
        """Run the module over each sequence's ``counts[i]`` positions from
        ``firsts[i]`` (``hidden``: the model's final hidden states there, in order)."""
        ids, positions, block_idx, ends, tables, last = [], [], [], [], [], []
        for seq, first, count in zip(seqs, firsts, counts):
            span = range(first, first + count)
            ids += seq.token_ids[first + 1:first + count + 1]
            positions += span
            block_idx += [seq.block_table[p // self.block_size] for p in span]
            ends.append(first + count)
            tables.append(seq.block_table)
            last.append(len(positions) - 1)
        logits = self._forward(ids, positions, block_idx, ends, tables, counts, hidden, last)
        drafts = logits.argmax(dim=-1).tolist()
        for seq, token in zip(seqs, drafts):
            self.next[seq.key] = (len(seq.token_ids), token)
        if len(self.next) > 2 * len(seqs):  # keys of sequences gone since
            live = {s.key for s in seqs}
            self.next = {k: v for k, v in self.next.items() if k in live}

    def _forward(self, ids, positions, block_idx, ends, tables, counts, hidden, last):
        """The module's logits at rows ``last``, under a step context of its own cache."""
        def tensor(values):
            return torch.tensor(values, dtype=torch.int32, device=self.device)

        width = max(len(t) for t in tables)
        table = tensor([t + [0] * (width - len(t)) for t in tables])
        pos = tensor(positions)
        starts = tensor([0] + counts).cumsum(0, dtype=torch.int32)
        slots = SlotBatch(tensor(block_idx), pos % self.block_size)
        attn = AttnMetadata(table, tensor(ends), starts, max(counts), max(ends))
        self.cache.begin_step(slots)
        set_context(StepContext(self.cache, self.attention, attn, slots))
        try:
            out = self.module(tensor(ids), hidden, pos)
        finally:
            set_context(None)
        return self.module.compute_logits(out[last])
