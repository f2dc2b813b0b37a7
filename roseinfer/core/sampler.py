"""The batched sampler: greedy, temperature, top-k, top-p, min-p, per-request seeds."""
from __future__ import annotations

from typing import Optional

import torch

from roseinfer.core.sampling import SamplingParams


class Sampler:
    """Samples one token per row; rows with a seed draw noise from their own generator,
    so their tokens do not depend on what else is in the batch."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[Optional[torch.Generator]]) -> torch.Tensor:
        probs = self.probs(logits, params)
        noise = self._exponential(probs, generators)
        sampled = (probs / noise).argmax(dim=-1)
        greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)

    @classmethod
    def probs(cls, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Each row's distribution as it is sampled: after temperature, top-k, top-p
        and min-p (unnormalized where a filter dropped tokens)."""
        temps = torch.tensor([p.temperature or 1.0 for p in params], device=logits.device)
        return cls._filter(torch.softmax(logits.float() / temps[:, None], dim=-1), params)

    @staticmethod
    def _filter(probs, params):
        """top-k, top-p and min-p on a descending sort of each row's probabilities."""
        if all(p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0 for p in params):
            return probs
        dev, vocab = probs.device, probs.shape[-1]
        top_k = torch.tensor([p.top_k or vocab for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        min_p = torch.tensor([p.min_p for p in params], device=dev)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=dev)[None, :]
        drop = rank >= top_k[:, None]
        drop |= (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p[:, None]  # keeps the first
        drop |= sorted_p < (min_p * sorted_p[:, 0])[:, None]
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        return torch.zeros_like(probs).scatter_(-1, order, sorted_p)

    @staticmethod
    def _exponential(probs, generators):
        noise = torch.empty_like(probs).exponential_()
        for row, g in enumerate(generators):
            if g is not None:
                noise[row].exponential_(generator=g)
        return noise
