"""The pooling runner (core/pooling_engine.py) against sentence-transformers: tiny random
BERT and XLM-RoBERTa encoders saved as sentence-transformers directories (mean or CLS
pooling, with and without Normalize), cross-encoders against ``CrossEncoder.predict``,
classifiers against transformers' own logits; bad inputs refused by name."""
import json
import shutil

import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer
from transformers import BertTokenizerFast

from roseinfer import LLM
from roseinfer.core.errors import InvalidRequestError
from tests.conftest import DEVICE
from tests.pooling_models import TEXTS, VOCAB, cross_encoder, sentence_model


def pooling_llm(folder, **config):
    """float32 on this machine's device: equal to sentence-transformers' float32."""
    return LLM(folder, device=DEVICE, dtype="float32", **config)


@pytest.fixture(scope="module")
def mean_bert(tmp_path_factory):
    return sentence_model(tmp_path_factory, "bert", "mean", normalize=True)


def embeddings(llm, texts, **kw):
    return torch.tensor([o.embedding for o in llm.embed(texts, **kw)])


@pytest.mark.parametrize("family, mode, normalize", [
    ("bert", "mean", True), ("bert", "mean", False), ("bert", "cls", True),
    ("xlm-roberta", "cls", False), ("xlm-roberta", "mean", True),
    ("qwen3", "lasttoken", True), ("qwen3", "mean", False), ("qwen3-untied", "lasttoken", True),
    ("modernbert", "mean", True), ("modernbert", "cls", False)])
def test_embeddings_equal_sentence_transformers(tmp_path_factory, family, mode, normalize):
    folder = sentence_model(tmp_path_factory, family, mode, normalize)
    want = torch.tensor(SentenceTransformer(folder).encode(TEXTS))
    llm = pooling_llm(folder)  # an encoder: the pooling runner, unasked
    got = embeddings(llm, TEXTS)
    cosine = torch.nn.functional.cosine_similarity(got, want)
    assert cosine.min() >= 0.99999, cosine
    torch.testing.assert_close(got.norm(dim=-1), want.norm(dim=-1), rtol=1e-4, atol=1e-5)
    if not normalize:
        assert not torch.allclose(got.norm(dim=-1), torch.ones(len(TEXTS)))


def test_batches_by_token_budget_give_the_same_vectors(mean_bert):
    whole = embeddings(pooling_llm(mean_bert), TEXTS * 3)
    small = embeddings(pooling_llm(mean_bert, max_num_batched_tokens=40), TEXTS * 3)
    torch.testing.assert_close(small, whole, rtol=1e-5, atol=1e-6)


def test_token_ids_embed_as_their_text(mean_bert):
    llm = pooling_llm(mean_bert)
    ids = llm.tokenizer(TEXTS[2])["input_ids"]
    (by_ids, by_text) = embeddings(llm, [ids, TEXTS[2]])
    torch.testing.assert_close(by_ids, by_text)
    assert llm.embed([ids])[0].num_tokens == len(ids)


def test_too_long_is_refused_unless_truncated(mean_bert):
    """The model's max length (sentence-transformers' 40): over it, ``too_long``, naming
    the item; truncated on the right, as sentence-transformers truncates."""
    llm = pooling_llm(mean_bert)
    long = " ".join(["abc"] * 60)
    with pytest.raises(InvalidRequestError) as e:
        llm.embed(["ok", long])
    assert e.value.code == "too_long" and "item 1" in str(e.value)
    want = torch.tensor(SentenceTransformer(mean_bert).encode([long]))
    got = embeddings(llm, [long], truncate="right")
    assert torch.nn.functional.cosine_similarity(got, want).item() >= 0.99999
    left = embeddings(llm, [long + " zz"], truncate="left")
    assert not torch.allclose(left, got)


@pytest.mark.parametrize("bad, field", [
    ([""], "input"), ([[]], "input"), ([[len(VOCAB) + 5]], "input"), ([3.5], "input"),
    ([["a", "b"]], "input")])
def test_bad_inputs_are_refused_by_name(mean_bert, bad, field):
    with pytest.raises(InvalidRequestError) as e:
        pooling_llm(mean_bert).embed(bad)
    assert e.value.field == field


def test_dimensions_need_a_matryoshka_model(mean_bert, tmp_path):
    with pytest.raises(InvalidRequestError) as e:
        pooling_llm(mean_bert).embed(["abc"], dimensions=8)
    assert e.value.field == "dimensions"
    matryoshka = tmp_path / "matryoshka"
    shutil.copytree(mean_bert, matryoshka)
    config = json.loads((matryoshka / "config.json").read_text())
    (matryoshka / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [8, 16]}))
    llm = pooling_llm(str(matryoshka))
    cut = embeddings(llm, TEXTS, dimensions=8)
    full = embeddings(llm, TEXTS)
    assert cut.shape == (len(TEXTS), 8)
    torch.testing.assert_close(cut, torch.nn.functional.normalize(full[:, :8], dim=-1))
    with pytest.raises(InvalidRequestError):
        llm.embed(["abc"], dimensions=12)


@pytest.mark.parametrize("family", ["bert", "xlm-roberta", "qwen3"])
def test_cross_encoder_scores_equal_sentence_transformers(tmp_path_factory, family):
    folder = cross_encoder(tmp_path_factory, family, labels=1)
    query, docs = "where is the fox", TEXTS
    want = CrossEncoder(folder).predict([(query, d) for d in docs])
    got = [o.score for o in pooling_llm(folder).score(query, docs)]
    assert max(abs(g - w) for g, w in zip(got, want)) <= 1e-4


@pytest.mark.parametrize("family", ["bert", "modernbert", "qwen3"])
def test_classifier_probabilities_equal_transformers(tmp_path_factory, family):
    """BERT's pooler head, ModernBERT's mean-pooled one, and a decoder's score of its last
    token (Qwen3ForSequenceClassification), against transformers."""
    from transformers import AutoModelForSequenceClassification
    folder = cross_encoder(tmp_path_factory, family, labels=3)
    hf = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    enc = BertTokenizerFast.from_pretrained(folder)(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        want = torch.softmax(hf(**enc).logits, -1)
    got = torch.tensor([o.probs for o in pooling_llm(folder).classify(TEXTS)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_an_embedder_scores_by_cosine(mean_bert):
    llm = pooling_llm(mean_bert)
    vectors = embeddings(llm, ["where is the fox", *TEXTS[:3]])
    got = [o.score for o in llm.score("where is the fox", TEXTS[:3])]
    torch.testing.assert_close(torch.tensor(got), vectors[1:] @ vectors[0], rtol=1e-5, atol=1e-6)


def test_runners_refuse_each_others_tasks(mean_bert, llama_model):
    with pytest.raises(InvalidRequestError, match="generate needs a model that generates"):
        pooling_llm(mean_bert).generate(["hi"])
    with pytest.raises(InvalidRequestError, match="embed needs a model that pools"):
        LLM(llama_model, device="cpu", num_kv_blocks=16).embed(["hi"])
    with pytest.raises(InvalidRequestError, match="classification head"):
        pooling_llm(mean_bert).classify(["hi"])


def test_a_headless_decoder_embeds_by_its_last_token(tmp_path_factory):
    """A base model saved without any head (``Qwen3Model``, untied): the pooling runner by
    itself, the last token's state normalised, as transformers' model gives it."""
    from transformers import AutoModel
    from tests.pooling_models import encoder
    folder = encoder(tmp_path_factory, "qwen3-untied")
    llm = pooling_llm(folder)
    hf = AutoModel.from_pretrained(folder).eval()
    ids = llm.tokenizer(TEXTS[2])["input_ids"]
    with torch.no_grad():
        want = torch.nn.functional.normalize(hf(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1)
    torch.testing.assert_close(embeddings(llm, [TEXTS[2]])[0], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "lm_head"])
def test_a_language_model_scores_by_its_yes_and_no_logits(tmp_path_factory, tied):
    """classifier_from_token (Qwen3-Reranker's no/yes): each pair's score is the second
    token's probability against the first's at the last position, as the model card
    computes it from transformers' logits; three tokens classify by their softmax."""
    from transformers import AutoModelForCausalLM
    from tests.pooling_models import language_model
    folder = language_model(tmp_path_factory, tied)
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    llm = pooling_llm(folder, classifier_from_token="n,y")
    query = "is it a fox"
    ids = [llm.tokenizer(query, d)["input_ids"] for d in TEXTS]
    no, yes = llm.tokenizer.convert_tokens_to_ids(["n", "y"])
    with torch.no_grad():
        last = torch.stack([hf(torch.tensor([i])).logits[0, -1] for i in ids])
    want = torch.softmax(last[:, [no, yes]], -1)[:, 1]
    got = torch.tensor([o.score for o in llm.score(query, TEXTS)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

    three = pooling_llm(folder, classifier_from_token=("a", "b", "c"))
    abc = three.tokenizer.convert_tokens_to_ids(["a", "b", "c"])
    with torch.no_grad():
        last = torch.stack([hf(torch.tensor([three.tokenizer(t)["input_ids"]])).logits[0, -1]
                            for t in TEXTS])
    outputs = three.classify(TEXTS)
    assert three.engine.labels == ["a", "b", "c"]
    torch.testing.assert_close(torch.tensor([o.probs for o in outputs]),
                               torch.softmax(last[:, abc], -1), rtol=1e-4, atol=1e-5)


def test_classifier_from_token_refusals(tmp_path_factory, mean_bert):
    from roseinfer.core.errors import ConfigError
    from tests.pooling_models import language_model
    folder = language_model(tmp_path_factory, tied=True)
    with pytest.raises(ConfigError, match=r"\['maybe'\] are not tokens"):
        pooling_llm(folder, classifier_from_token="n,maybe")
    with pytest.raises(ConfigError, match="runner auto or set it to pooling"):
        pooling_llm(folder, classifier_from_token="n,y", runner="generate")
    with pytest.raises(ConfigError, match="needs a language model with its LM head"):
        pooling_llm(mean_bert, classifier_from_token="n,y")
