"""Packed attention's choice of torch's flash kernel, whose arguments changed over
releases: what each signature can run, and (on a GPU) that it agrees with the padded path."""
import pytest
import torch

from roseinfer.layers import encoder_attention
from roseinfer.layers.encoder_attention import Packed, flash_kwargs, packed_attention

NEW = frozenset({"query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k",
                 "return_aux", "scale", "window_size", "enable_gqa", "seqused_k"})
OLD = frozenset({"query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k",
                 "is_causal", "return_aux"})  # torch 2.11's: no scale, window or GQA
Q, GQA_KV = (10, 8, 64), 2


def test_the_newer_signature_takes_every_call():
    assert flash_kwargs(NEW, Q, 8, False, None, None) == {"window_size": (-1, -1)}
    assert flash_kwargs(NEW, Q, GQA_KV, True, 0.5, 16) == {
        "window_size": (16, 0), "enable_gqa": True, "scale": 0.5}


def test_the_older_signature_takes_what_it_can_and_refuses_the_rest():
    assert flash_kwargs(OLD, Q, 8, False, None, None) == {}
    assert flash_kwargs(OLD, Q, 8, True, 64 ** -0.5, None) == {"is_causal": True}
    assert flash_kwargs(OLD, Q, 8, False, 0.5, None) is None  # a scale it cannot take
    assert flash_kwargs(OLD, Q, GQA_KV, False, None, None) is None
    assert flash_kwargs(OLD, Q, 8, False, None, 16) is None
    assert flash_kwargs(OLD - {"is_causal"}, Q, 8, True, None, None) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's flash kernel needs CUDA")
@pytest.mark.parametrize("causal,kv_heads", [(False, 8), (True, 8), (False, 2)])
def test_flash_agrees_with_the_padded_path(monkeypatch, causal, kv_heads):
    torch.manual_seed(0)
    lens = [5, 17, 1, 9]
    packed = Packed.of(lens, None, "cuda")
    q = torch.randn(sum(lens), 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens), kv_heads, 64, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    fast = packed_attention(q, k, v, packed, causal=causal)
    monkeypatch.setattr(encoder_attention, "_varlen", lambda: None)
    padded = packed_attention(q, k, v, packed, causal=causal)
    torch.testing.assert_close(fast, padded, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("causal,window,kv_heads,dim", [
    (False, None, 4, 64), (True, None, 4, 32), (False, 3, 2, 48), (True, None, 1, 64)])
def test_the_graph_kernel_agrees_with_the_padded_path(causal, window, kv_heads, dim):
    """Sequences packed across the kernel's 64-row blocks (one of 70 rows spans two),
    one of a single token, and padding rows past them, which come back zero."""
    from roseinfer.layers.packed_attention_kernel import packed_attention_kernel, \
        sequence_bounds
    torch.manual_seed(0)
    lens, rows = [5, 70, 1, 30], 120
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    qkv = torch.randn(rows, 4 + 2 * kv_heads, dim, device=device, dtype=dtype)
    q, k, v = qkv.split([4, kv_heads, kv_heads], dim=1)  # strided, as a fused qkv's
    out = packed_attention_kernel(q, k, v, sequence_bounds(lens, rows).to(device), causal,
                                  None, window)
    used = sum(lens)
    packed = Packed.of(lens, None, device)
    want = packed_attention(*(x[:used].float() for x in (q, k, v)), packed, causal=causal,
                            window=window)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out[:used].float(), want, atol=tol, rtol=tol)
    assert not out[used:].any()
