"""Tiny random encoders saved as sentence-transformers directories and cross-encoders:
the pooling runner's test models (tests/test_pooling.py, the worker's tests)."""
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules as models
from transformers import (BertConfig, BertForSequenceClassification, BertModel,
                          BertTokenizerFast, ModernBertConfig,
                          ModernBertForSequenceClassification, ModernBertModel, Qwen3Config,
                          Qwen3ForSequenceClassification, Qwen3Model, XLMRobertaConfig, XLMRobertaForSequenceClassification,
                          XLMRobertaModel)

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz0123456789.,!?",
         *("##" + c for c in "abcdefghijklmnopqrstuvwxyz")]
TEXTS = ["hello world", "abc", "the quick brown fox jumps over the lazy dog 123",
         "a", "pack my box with five dozen liquor jugs!", "zz top"]
QWEN3 = dict(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, intermediate_size=64,
             max_position_embeddings=128, tie_word_embeddings=True)
MODERNBERT = dict(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=3,
                  num_attention_heads=4, intermediate_size=48, local_attention=8,
                  global_attn_every_n_layers=3, max_position_embeddings=128, pad_token_id=0,
                  bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3)
SHAPE = dict(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=64, max_position_embeddings=72)


def tokenizer(folder, token_types: bool):
    """A WordPiece tokenizer over VOCAB; without ``token_types`` it gives none, as
    XLM-RoBERTa's does."""
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if token_types else [])
    return BertTokenizerFast(vocab=str(folder / "vocab.txt"), model_input_names=names)


def save(model, folder):
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model.save_pretrained(folder)
    tokenizer(folder, getattr(model.config, "type_vocab_size", 1) > 1).save_pretrained(folder)
    return str(folder)


def encoder(tmp_path_factory, family: str) -> str:
    """A tiny random ``bert``, ``xlm-roberta``, ``modernbert`` or ``qwen3`` (a decoder, as Qwen3-Embedding:
    its base model without an LM head) saved with VOCAB's tokenizer."""
    folder = tmp_path_factory.mktemp(family)
    if family == "bert":
        return save(BertModel(BertConfig(**SHAPE)), folder)
    if family == "modernbert":  # windows of 4 either side in its 2nd and 3rd layers
        return save(ModernBertModel(ModernBertConfig(**MODERNBERT)), folder)
    if family in ("qwen3", "qwen3-untied"):  # untied: its checkpoint holds no LM head at all
        return save(Qwen3Model(Qwen3Config(**{**QWEN3,
                                              "tie_word_embeddings": family == "qwen3"})), folder)
    return save(XLMRobertaModel(XLMRobertaConfig(**SHAPE, type_vocab_size=1, pad_token_id=0)), folder)


def sentence_model(tmp_path_factory, family: str, mode: str, normalize: bool) -> str:
    base = encoder(tmp_path_factory, family)
    transformer = models.Transformer(base, max_seq_length=40)
    modules = [transformer, models.Pooling(transformer.get_embedding_dimension(), mode)]
    folder = tmp_path_factory.mktemp("st")
    SentenceTransformer(modules=modules + ([models.Normalize()] if normalize else [])).save(
        str(folder))
    return str(folder)


def language_model(tmp_path_factory, tied: bool) -> str:
    """A tiny random Qwen3ForCausalLM (Qwen3-Reranker's kind: it answers in tokens)."""
    from transformers import Qwen3ForCausalLM
    return save(Qwen3ForCausalLM(Qwen3Config(**{**QWEN3, "tie_word_embeddings": tied})),
                tmp_path_factory.mktemp("qwen3-lm"))


def cross_encoder(tmp_path_factory, family: str, labels: int) -> str:
    folder = tmp_path_factory.mktemp(f"{family}-ce")
    if family == "bert":
        return save(BertForSequenceClassification(BertConfig(**SHAPE, num_labels=labels)), folder)
    if family == "qwen3":  # a decoder's head: its last token's score (Qwen3-Reranker's kind)
        return save(Qwen3ForSequenceClassification(Qwen3Config(
            **QWEN3, num_labels=labels, pad_token_id=0)), folder)
    if family == "modernbert":
        return save(ModernBertForSequenceClassification(ModernBertConfig(
            **MODERNBERT, num_labels=labels, classifier_pooling="mean")), folder)
    return save(XLMRobertaForSequenceClassification(
        XLMRobertaConfig(**SHAPE, type_vocab_size=1, pad_token_id=0, num_labels=labels)), folder)
