"""A tokenizer for a random-weight vision-language shape, so that chats with images can be
sent to it through the queue: word ``wN`` is id N for every id of the shape's vocabulary,
Qwen's special tokens sit at their ids (<|im_start|>, <|image_pad|>, ...), and the chat
template renders an image part as Qwen2-VL's does (one image token between its marks).
Text for it is words: ``w17 w42 ...`` is those ids.

Usage: python3 docs/bench/synthetic_tokenizer.py --model qwen2.5-vl-7b-random --out DIR
  then: roseinfer bench serve --model qwen2.5-vl-7b-random --tokenizer DIR --images 1024 ...
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.vision_models import QWEN_VL_TEMPLATE  # noqa: E402

QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                 "<|vision_start|>": 151652, "<|vision_end|>": 151653,
                 "<|image_pad|>": 151655}


def build(vocab_size: int, image_token_id: int):
    """Qwen's special ids where the vocabulary holds them (the real shapes'), else the
    top ids of a small one (a test model's), the image token at the model's own id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = dict(QWEN_SPECIALS)
    if max(specials.values()) >= vocab_size:
        free = (i for i in range(vocab_size - 1, 0, -1) if i != image_token_id)
        specials = {name: next(free) for name in specials}
    specials["<|image_pad|>"] = image_token_id
    taken = set(specials.values())
    vocab = {f"w{i}": i for i in range(vocab_size) if i not in taken}
    vocab.update(specials)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(specials))
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0",
                                  eos_token="<|im_end|>", pad_token="<|endoftext|>")
    out.chat_template = QWEN_VL_TEMPLATE
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-vl-7b-random",
                   help="a random shape's name, or a checkpoint directory")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from roseinfer.models.loader import text_part
    from roseinfer.models.random_shapes import RANDOM
    if args.model in RANDOM:
        config, _ = RANDOM[args.model]()
    else:
        from transformers import AutoConfig
        config = text_part(AutoConfig.from_pretrained(args.model))
    tokenizer = build(config.vocab_size, config.image_token_id)
    tokenizer.save_pretrained(args.out)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w17 w42"}]}],
        tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert config.image_token_id in ids and 17 in ids and 42 in ids, ids
    print(f"{args.out}: {len(tokenizer)} tokens; a chat with an image: {ids}")


if __name__ == "__main__":
    main()
