"""xgrammar's host mask fill and device apply at two vocabulary sizes, GPT-2's tokenizer.

128 matchers of {"type": "object"}, each inside a string; fill: all 128 rows on one
thread; apply: apply_token_bitmask_inplace on [128, V] CUDA logits, with and without
row indices. Run from the repository root on a GPU:
    python3 docs/bench/grammar_mask_probe.py
"""
import tempfile
import time

import torch
import xgrammar as xgr

from roseinfer.models.tokenizers import gpt2_tokenizer

ROWS = 128


def seconds(fn, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def main():
    tok = gpt2_tokenizer(tempfile.mkdtemp())
    for vocab in (50257, 128256):
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[50256])
        grammar = xgr.GrammarCompiler(info).compile_json_schema(
            '{"type": "object"}', any_whitespace=False, strict_mode=False)
        matchers = [xgr.GrammarMatcher(grammar) for _ in range(ROWS)]
        for m in matchers:
            for t in tok.encode('{"a'):
                m.accept_token(t)
        mask = xgr.allocate_token_bitmask(ROWS, vocab).pin_memory()

        def fill():
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(mask, i)
        fill_s = seconds(fill, 5)
        device_mask, rows = mask.to("cuda"), list(range(ROWS))
        for dtype in (torch.bfloat16, torch.float32):
            logits = torch.randn(ROWS, vocab, device="cuda", dtype=dtype)
            indexed = seconds(lambda: xgr.apply_token_bitmask_inplace(
                logits, device_mask, indices=rows), 20)
            whole = seconds(lambda: xgr.apply_token_bitmask_inplace(logits, device_mask), 20)
            print(f"V {vocab} {dtype}: fill {ROWS} rows {fill_s * 1e3:.2f} ms, apply with "
                  f"indices {indexed * 1e3:.3f} ms, without {whole * 1e3:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
