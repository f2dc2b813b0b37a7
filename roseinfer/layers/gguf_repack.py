"""GGUF kinds the block kernels do not read as stored, repacked at load into 32-weight
blocks they read, holding exactly the file's values: the K-quants (Q4_K, Q5_K, Q6_K) and
the 5-bit legacy kinds (Q5_0, Q5_1), which llama.cpp's K-quant mixes use wherever a row's
length is not a multiple of 256 (all of a 576-wide model's attention, for one).

A K-quant super-block holds 256 weights under one fp16 scale (and minimum), with 6- or
8-bit scales for each sub-block of 32 (16 for Q6_K). Its values are d * sc * q - dmin * m
(Q6_K: d * sc * (q - 32)), and every factor is exact in float32, so a block that keeps
d * sc and dmin * m as float32 computes the same values. Q5_0 and Q5_1 are d (q - 16) and
d q + m over 5-bit levels.

- Q4_K -> ``F32_Q4`` (kind 100): float32 scale and minimum, 16 bytes of nibbles; 24 bytes
  for 32 weights where Q4_K takes 18, read by the Q4 kernel.
- Q5_K, Q6_K, Q5_0 and Q5_1 -> ``F32_Q8`` (kind 101): float32 scales of each half (16
  weights), float32 minimum, 32 int8; 44 bytes where they take 22-26, read by an int8
  kernel.

The layouts and the unpacking follow the ``gguf`` package's ``dequantize`` (quants.py).
"""
from __future__ import annotations

import numpy as np

QK_K = 256
F32_Q4, F32_Q8 = 100, 101  # the repacked kinds (outside ggml's type numbers)
Q5_0, Q5_1, Q4_K, Q5_K, Q6_K = 6, 7, 12, 13, 14  # ggml's
REPACKED = {Q4_K: F32_Q4, Q5_K: F32_Q8, Q6_K: F32_Q8, Q5_0: F32_Q8, Q5_1: F32_Q8}


def repack(kind: int, raw: np.ndarray) -> tuple[int, np.ndarray]:
    """(kind the kernels read, its rows of blocks [rows, bytes] uint8) of a tensor's rows
    of ``kind`` ([rows, bytes] uint8)."""
    rows = raw.shape[0]
    blocks = raw.reshape(-1, _BYTES[kind])
    if kind == Q4_K:
        scale, minimum, q = _q4_k(blocks)
        return F32_Q4, _f32_q4(scale, minimum, q).reshape(rows, -1)
    unpack = {Q5_K: _q5_k, Q6_K: _q6_k, Q5_0: _q5_0, Q5_1: _q5_1}[kind]
    scale, minimum, q = unpack(blocks)
    return F32_Q8, _f32_q8(scale, minimum, q).reshape(rows, -1)


_BYTES = {Q4_K: 144, Q5_K: 176, Q6_K: 210, Q5_0: 22, Q5_1: 24}


def _split(blocks: np.ndarray, *sizes: int) -> list[np.ndarray]:
    return np.hsplit(blocks, np.cumsum(sizes))


def _scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 sub-blocks' 6-bit scales and minimums packed in 12 bytes."""
    d, m, m_d = np.split(scales.reshape(-1, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(-1, 8).astype(np.float32), mn.reshape(-1, 8).astype(np.float32)


def _half(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float32)


def _q4_k(blocks):
    """Per 32 weights: scale, minimum (both [n, 8], float32), levels [n, 8, 32] uint8."""
    d, dmin, scales, qs = _split(blocks, 2, 2, 12)
    sc, mn = _scale_min(scales)
    q = (qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    return _half(d) * sc, -(_half(dmin) * mn), q.reshape(-1, 8, 32)


def _q5_k(blocks):
    """Per 32 weights: scale and minimum for each half ([n, 8, 2]), minimum, levels."""
    d, dmin, scales, qh, qs = _split(blocks, 2, 2, 12, 32)
    sc, mn = _scale_min(scales)
    low = (qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 0x01
    q = (low.reshape(-1, 8, 32) | (high << 4)).astype(np.int8)
    scale = np.repeat((_half(d) * sc)[..., None], 2, axis=-1)
    return scale, -(_half(dmin) * mn), q


def _q6_k(blocks):
    ql, qh, scales, d = _split(blocks, QK_K // 2, QK_K // 4, QK_K // 16)
    scale = _half(d) * scales.copy().view(np.int8).astype(np.float32)  # [n, 16]
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)).astype(np.int8) - 32
    return scale.reshape(-1, 8, 2), np.zeros((len(blocks), 8), np.float32), q


def _q5_levels(qh, qs) -> np.ndarray:
    """A legacy 5-bit block's 32 levels: nibbles as Q4_1's, the fifth bits in a word."""
    high = (qh.copy().view("<u4") >> np.arange(32, dtype=np.uint32).reshape(1, 32)) & 1
    low = (qs.reshape(-1, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)) & 0x0F
    return (low.reshape(-1, 32) | (high.astype(np.uint8) << 4)).astype(np.int8)


def _q5_0(blocks):
    d, qh, qs = _split(blocks, 2, 4)
    scale = np.repeat(_half(d), 2, axis=-1).reshape(-1, 1, 2)
    return scale, np.zeros((len(blocks), 1), np.float32), (_q5_levels(qh, qs) - 16)[:, None]


def _q5_1(blocks):
    d, m, qh, qs = _split(blocks, 2, 2, 4)
    scale = np.repeat(_half(d), 2, axis=-1).reshape(-1, 1, 2)
    return scale, _half(m), _q5_levels(qh, qs)[:, None]


def _f32_q4(scale, minimum, q) -> np.ndarray:
    nib = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)
    head = np.stack([scale, minimum], axis=-1).astype(np.float32).view(np.uint8)
    return np.concatenate([head.reshape(*q.shape[:2], 8), nib], axis=-1)


def _f32_q8(scale, minimum, q) -> np.ndarray:
    head = np.concatenate([scale, minimum[..., None]], axis=-1).astype(np.float32)
    return np.concatenate([head.view(np.uint8).reshape(*q.shape[:2], 12),
                           q.astype(np.int8).view(np.uint8)], axis=-1)
