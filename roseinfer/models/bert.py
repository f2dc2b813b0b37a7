"""BERT, RoBERTa and XLM-RoBERTa: encoders for embeddings and scores (core/pooling.py),
with bidirectional attention within each sequence and no KV cache.

Post-norm layers: attention, add, LayerNorm; a GELU MLP, add, LayerNorm. Tokens run
packed, one row a token (layers/encoder_attention.py). RoBERTa's positions start after
its padding index. A ``*ForSequenceClassification`` checkpoint keeps its head: BERT's
pooler (dense, tanh over [CLS]) and a linear; RoBERTa's dense, tanh and ``out_proj``
over <s>."""
from __future__ import annotations

import re
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.layers.encoder_attention import Packed, encoder_attention
from roseinfer.layers.fused import add_layer_norm

ACTIVATIONS = {"gelu": F.gelu, "gelu_new": partial(F.gelu, approximate="tanh"),
               "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"), "relu": F.relu,
               "silu": F.silu}
ROBERTA = ("roberta", "xlm-roberta")


def classifies(cfg) -> bool:
    """Whether the checkpoint is a sequence classifier (a cross-encoder, a reward model)."""
    return any(a.endswith("ForSequenceClassification") for a in cfg.architectures or ())


def headless(cfg) -> bool:
    """Whether the checkpoint is a base model without any head (``Qwen3Model``: an
    embedder saved by sentence-transformers)."""
    names = getattr(cfg, "architectures", None) or ()
    return bool(names) and all(a.endswith("Model") and not a.endswith("LMHeadModel")
                               for a in names)  # GPT2LMHeadModel has its LM head


class BertEmbeddings(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        e = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, e)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, e)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, e)
        self.LayerNorm = nn.LayerNorm(e, eps=cfg.layer_norm_eps)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, types: torch.Tensor):
        x = self.word_embeddings(ids) + self.token_type_embeddings(types)
        return self.LayerNorm(x + self.position_embeddings(positions))


class BertLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        e, self.heads = cfg.hidden_size, cfg.num_attention_heads
        self.qkv = nn.Linear(e, 3 * e)
        self.o = nn.Linear(e, e)
        self.attn_norm = nn.LayerNorm(e, eps=cfg.layer_norm_eps)
        self.up = nn.Linear(e, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, e)
        self.mlp_norm = nn.LayerNorm(e, eps=cfg.layer_norm_eps)
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported; supported: "
                             f"{', '.join(ACTIVATIONS)}")
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, packed: Packed) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        attn = self.o(encoder_attention(q, k, v, self.heads, packed))
        x = _add_norm(attn, x, self.attn_norm)
        return _add_norm(self.down(self.act(self.up(x))), x, self.mlp_norm)


def _add_norm(x: torch.Tensor, residual: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    return add_layer_norm(x, residual, norm.weight, norm.bias, norm.eps)[0]


class BertModel(nn.Module):
    """An encoder: ``forward`` gives each packed token's last hidden state, ``classify``
    a classifier checkpoint's logits per sequence."""
    pooling_only = True  # no LM head: the pooling runner serves it (core/pooling.py)

    def __init__(self, cfg):
        super().__init__()
        self.position_offset = cfg.pad_token_id + 1 if cfg.model_type in ROBERTA else 0
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.head = None
        if classifies(cfg):
            labels, e = cfg.num_labels, cfg.hidden_size
            self.head = nn.ModuleDict({"dense": nn.Linear(e, e), "out": nn.Linear(e, labels)})

    def bind_head(self) -> None:
        """Nothing to tie: an encoder has no LM head."""

    def forward(self, ids: torch.Tensor, packed: Packed) -> torch.Tensor:
        x = self.embeddings(ids, packed.positions + self.position_offset, packed.token_types)
        for layer in self.layers:
            x = layer(x, packed)
        return x

    def classify(self, hidden: torch.Tensor, packed: Packed) -> torch.Tensor:
        """Logits [B, labels] from each sequence's first token ([CLS] or <s>)."""
        first = torch.tanh(self.head["dense"](hidden[packed.starts]))
        return self.head["out"](first)

    @staticmethod
    def convert_hf_state_dict(sd: dict, cfg) -> dict:
        """transformers' names to this module's: q/k/v fused, the encoder's prefix
        (``bert.``, ``roberta.``) dropped; BERT's pooler and classifier, or RoBERTa's
        classifier, as ``head``; pretraining heads and position-id buffers left out."""
        out, qkv = {}, {}
        for key, t in sd.items():
            key = re.sub(r"^(bert|roberta|model)\.", "", key)
            name = _rename(key, cfg)
            if name is None:
                continue
            if m := re.fullmatch(r"encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.(weight|bias)", key):
                qkv.setdefault((int(m[1]), m[3]), {})[m[2]] = t
            else:
                out[name] = t
        for (layer, kind), parts in qkv.items():
            out[f"layers.{layer}.qkv.{kind}"] = torch.cat([parts[p] for p in ("query", "key", "value")])
        return out


_LAYER = {"attention.output.dense": "o", "attention.output.LayerNorm": "attn_norm",
          "intermediate.dense": "up", "output.dense": "down", "output.LayerNorm": "mlp_norm",
          "attention.self.query": "qkv", "attention.self.key": "qkv",
          "attention.self.value": "qkv"}


def _rename(key: str, cfg) -> str | None:
    if not key.endswith((".weight", ".bias")):
        return None  # buffers: position and token-type ids
    if key.startswith("embeddings."):
        return key
    if m := re.fullmatch(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias)", key):
        return f"layers.{m[1]}.{_LAYER[m[2]]}.{m[3]}"
    if not classifies(cfg):
        return None  # the pooler, pretraining heads: embeddings pool hidden states
    head = {"pooler.dense": "head.dense", "classifier": "head.out",  # BERT's
            "classifier.dense": "head.dense", "classifier.out_proj": "head.out"}  # RoBERTa's
    part, _, kind = key.rpartition(".")
    return f"{head[part]}.{kind}" if part in head else None

