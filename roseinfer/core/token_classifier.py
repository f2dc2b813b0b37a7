"""A language model's next-token logits as a classifier (``classifier_from_token``, as
vLLM names it): the model's own LM head over each input's last token, the named tokens'
logits kept, so a reranker that answers in tokens is served as a cross-encoder. (The
head runs on one row an input: next to the layers over every token, by arithmetic about
a thousandth of a Qwen3-Reranker-0.6B batch's work.)

Two tokens (Qwen3-Reranker's ``["no", "yes"]``) give one logit, the second's minus the
first's: its sigmoid is the second token's probability against the first's, as the model
card computes it (a softmax over the two logits). One token, or three and more, give a
logit each: classify gives the softmax over those tokens' logits (one: its sigmoid).
"""
from __future__ import annotations

import torch

from roseinfer.core.errors import ConfigError
from roseinfer.models.bert import classifies, headless


def token_ids(tokenizer, tokens: tuple[str, ...]) -> list[int]:
    """Each token's id in the tokenizer's vocabulary; a name that is not one token of it
    is refused by name."""
    if tokenizer is None:
        raise ConfigError("classifier_from_token needs the model's tokenizer, to find the "
                          "tokens: pass tokenizer=")
    vocab = tokenizer.get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ConfigError(f"classifier_from_token: {missing} are not tokens of this model's "
                          f"vocabulary; name tokens as the tokenizer spells them")
    return [vocab[t] for t in tokens]


class TokenScore:
    """The ``score`` of a language model: its LM head's logits of ``ids`` [B, labels]."""

    def __init__(self, head, ids: list[int]):
        self.head, self.ids = head, ids

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)[:, self.ids].float()
        return logits[:, 1:] - logits[:, :1] if len(self.ids) == 2 else logits


def token_classifier(model, hf_config, tokenizer, tokens: tuple[str, ...]
                     ) -> tuple[TokenScore, list[str]]:
    """(the ``score`` of ``model``'s LM head over ``tokens``, its labels)."""
    if getattr(hf_config, "final_logit_softcapping", None):
        raise ConfigError("classifier_from_token compares raw LM-head logits; this model "
                          "caps them (final_logit_softcapping)")
    if classifies(hf_config) or headless(hf_config) or getattr(model, "head", None) is None:
        raise ConfigError("classifier_from_token needs a language model with its LM head "
                          "(a *ForCausalLM checkpoint)")
    score = TokenScore(model.head, token_ids(tokenizer, tokens))
    return score, [tokens[1]] if len(tokens) == 2 else list(tokens)
