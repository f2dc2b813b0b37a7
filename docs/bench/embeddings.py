"""Embedding throughput: roseinfer's pooling runner against sentence-transformers'
``encode`` on the same random-weight model and the same texts, alternated, in one
process, on the CPU or a GPU.

Shapes (random weights, a WordPiece vocabulary of letters and their continuations, saved
as a sentence-transformers directory): ``minilm``, all-MiniLM-L6-v2's (BERT, 6 layers,
hidden 384, mean pooling, normalised); ``bge-large``, BGE-large's (24 layers, hidden 1024,
CLS pooling, normalised). Texts of random words, ``--min-tokens`` to ``--max-tokens``
each. sentence-transformers runs ``batch_size=BATCH``; roseinfer packs batches of BATCH
times the mean length in tokens. On a GPU both run in bfloat16 (``--st-float32``:
sentence-transformers in its default float32).

    python3 docs/bench/embeddings.py [--device cpu] [--shape minilm] [--texts 1024]
        [--batch 64] [--rounds 3] [--min-tokens 32] [--max-tokens 256]
"""
import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.pooling_models import VOCAB  # noqa: E402

SHAPES = {"minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                         intermediate_size=1536, pooling="mean"),
          "bge-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                            intermediate_size=4096, pooling="cls")}


def build(folder: Path, shape: dict) -> str:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Normalize, Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    BertTokenizerFast(vocab=str(folder / "vocab.txt")).save_pretrained(folder)
    torch.manual_seed(0)
    config = {k: v for k, v in shape.items() if k != "pooling"}
    BertModel(BertConfig(vocab_size=len(VOCAB), max_position_embeddings=512,
                         **config)).save_pretrained(folder)
    transformer = Transformer(str(folder), max_seq_length=512)
    st = SentenceTransformer(modules=[transformer, Pooling(shape["hidden_size"], shape["pooling"]),
                                      Normalize()])
    out = folder / "st"
    st.save(str(out))
    return str(out)


def texts(n: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    """Words of 2-8 letters: a word of k letters is k tokens of VOCAB, and a text of
    ``want`` tokens is words until their letters and [CLS], [SEP] make that many."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        want, words, size = rng.randint(lo, hi), [], 2
        while size < want:
            word = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=min(rng.randint(2, 8),
                                                                          want - size)))
            words.append(word)
            size += len(word)
        out.append(" ".join(words))
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", choices=SHAPES, default="minilm")
    p.add_argument("--texts", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--st-float32", action="store_true",
                   help="sentence-transformers in float32, its default, on a GPU too")
    a = p.parse_args()
    from sentence_transformers import SentenceTransformer

    from roseinfer import LLM
    gpu = a.device.startswith("cuda")
    dtype = torch.bfloat16 if gpu else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        folder = build(Path(tmp), SHAPES[a.shape])
        st = SentenceTransformer(folder, device=a.device).to(
            torch.float32 if a.st_float32 else dtype)
        corpus = texts(a.texts, a.min_tokens, a.max_tokens)
        tokens = [len(ids) for ids in st.tokenizer(corpus)["input_ids"]]
        mean = statistics.mean(tokens)
        llm = LLM(folder, device=a.device, dtype=str(dtype).removeprefix("torch."),
                  max_num_batched_tokens=int(a.batch * mean))
        ours = torch.tensor([o.embedding for o in llm.embed(corpus[:64])])
        theirs = torch.tensor(st.encode(corpus[:64], convert_to_numpy=False,
                                        convert_to_tensor=True).float().cpu())
        cosine = torch.nn.functional.cosine_similarity(ours, theirs).min().item()
        runs = {"sentence-transformers": [], "roseinfer": []}
        for _ in range(a.rounds):
            sync(a.device)
            start = time.perf_counter()
            st.encode(corpus, batch_size=a.batch)
            sync(a.device)
            runs["sentence-transformers"].append(time.perf_counter() - start)
            start = time.perf_counter()
            llm.embed(corpus)
            sync(a.device)
            runs["roseinfer"].append(time.perf_counter() - start)
        rate = {k: a.texts / statistics.median(v) for k, v in runs.items()}
        print(json.dumps({"device": torch.cuda.get_device_name() if gpu else "cpu",
                          "st_dtype": "float32" if a.st_float32 else str(dtype),
                          "shape": a.shape, "texts": a.texts, "tokens": sum(tokens),
                          "mean_tokens": mean, "batch": a.batch,
                          "threads": torch.get_num_threads(), "min_cosine": cosine,
                          "seconds": runs, "texts_per_s": rate,
                          "ratio": rate["roseinfer"] / rate["sentence-transformers"]}, indent=1))


if __name__ == "__main__":
    main()
