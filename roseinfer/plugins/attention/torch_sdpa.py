"""Reference paged attention on torch SDPA: any device, padded per sequence. An FP8 cache
(``kv_cache_dtype="fp8"``) is read in the query's dtype: only the rows a step gathers are
converted. A sliding-window layer's query at position p sees keys p - window + 1 .. p.
Attention sinks (gpt-oss: a learned logit per head, a key with no value) join each row's
softmax; a soft cap (Gemma 2) bounds each score to (-cap, cap) by cap * tanh(score / cap).
A prompt's image tokens that attend both ways (``AttnMetadata.visible``) see the keys up to
their image's last."""
import torch
import torch.nn.functional as F

from roseinfer.core.attention import AttnMetadata
from roseinfer.core.hookspecs import hookimpl
from roseinfer.core.kv_cache import cache_rows


def context_index(block_tables, max_context_len, block_size):
    """The block ids to gather: tables may be wider than the longest context."""
    return block_tables[:, :-(-max_context_len // block_size)]


def select(cache, index, dtype):
    """``cache.index_select(0, index)`` in ``dtype``."""
    x = cache.index_select(0, index)
    return x if x.dtype == dtype else x.to(dtype)


def gather_context(cache, index, max_context_len, dtype):
    """[blocks, H_kv, bs, D] through [S, MB] block ids -> [S, H_kv, max_ctx, D]."""
    _, h, bs, d = cache.shape
    s, mb = index.shape
    x = select(cache, index.flatten(), dtype)  # 2-3x faster than cache[index] on the CPU
    x = x.view(s, mb, h, bs, d).permute(0, 2, 1, 3, 4).reshape(s, h, mb * bs, d)
    return x[:, :, :max_context_len]


class TorchSDPAAttention:
    def supports(self, device) -> bool:
        return True

    def forward(self, q, k_cache, v_cache, attn, scale, window=None, sinks=None, softcap=None):
        extra = (window, sinks, softcap)
        if attn.is_decode:
            return _decode(q, k_cache, v_cache, attn.block_tables, attn.context_lens,
                           attn.max_context_len, scale, attn.memo, *extra)
        qlens = attn.query_start[1:] - attn.query_start[:-1]
        single = qlens == 1
        if not bool(single.any()):
            return _prefill(q, k_cache, v_cache, attn, qlens, scale, *extra)
        # A mixed step: decode rows and prefill chunks attend apart. One padded
        # batch would pad every decode row to the longest chunk and context
        # (16 decode rows beside a 128-token chunk at 1,000 tokens of context:
        # 0.6 s of a 0.8 s GPT-2 step on two CPU cores, docs/benchmarks.md).
        out = torch.empty_like(q)
        dec = single.nonzero().squeeze(1)
        dec_rows = attn.query_start[dec].long()
        ctx = attn.context_lens[dec]
        out[dec_rows] = _decode(q[dec_rows], k_cache, v_cache, attn.block_tables[dec], ctx,
                                int(ctx.max()), scale, attn.memo, *extra)
        pre = (~single).nonzero().squeeze(1)
        pre_qlens = qlens[pre]
        starts = torch.zeros(len(pre) + 1, dtype=attn.query_start.dtype, device=q.device)
        torch.cumsum(pre_qlens, 0, out=starts[1:])
        rows = ~torch.repeat_interleave(single, qlens.long())
        sub = AttnMetadata(attn.block_tables[pre], attn.context_lens[pre], starts,
                           int(pre_qlens.max()), int(attn.context_lens[pre].max()),
                           visible=None if attn.visible is None else attn.visible[rows])
        out[rows] = _prefill(q[rows], k_cache, v_cache, sub, pre_qlens, scale, *extra)
        return out


def _decode(q, k_cache, v_cache, block_tables, context_lens, max_context_len, scale, memo,
            window=None, sinks=None, softcap=None):
    """One query row per sequence: [S, H, D]. Every layer of a forward with the same
    window attends through the same block ids and mask: the first computes them into
    ``memo``."""
    key = ("decode", window)
    if key not in memo:
        memo[key] = _decode_plan(block_tables, context_lens, max_context_len,
                                 k_cache.shape[2], k_cache.shape[1], window)
    index, padding = memo[key]
    if padding is not None:
        return _decode_blocks(q, k_cache, v_cache, index, padding, scale, sinks, softcap)
    # One sequence: its rows, head by head, in one index op a cache and no second copy.
    _, hkv, _, d = k_cache.shape
    k = select(k_cache.view(-1, d), index, q.dtype).view(1, hkv, -1, d)
    v = select(v_cache.view(-1, d), index, q.dtype).view(1, hkv, -1, d)
    return attend(q.unsqueeze(2), k, v, None, scale, sinks, softcap).squeeze(2)


def attend(q, k, v, mask, scale, sinks=None, softcap=None):
    """Attention of q [S, H, Q, D] over k, v [S, H_kv, K, D] (``mask`` True where a query
    sees a key): SDPA, or spelled out in float32 where SDPA has no place for ``softcap``
    (scores capped) or ``sinks`` ([H]: one more logit per row, of a key with no value)."""
    if sinks is None and softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, 1) for t in (k, v))
    scores = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    p = torch.softmax(scores, dim=-1)[..., :k.shape[2]]
    return torch.matmul(p, v).to(q.dtype)


def _decode_plan(block_tables, context_lens, max_context_len, block_size, num_kv_heads,
                 window=None):
    """For one sequence, the rows of its context (its last ``window``) in the cache seen
    as [rows, D], head-major ([H_kv * context]). For a batch, the block ids and the
    padding of the gathered blocks, [S, 1, 1, blocks * block_size], True past each
    context and before its window."""
    if block_tables.shape[0] == 1:
        first = max(0, max_context_len - window) if window else 0
        t = torch.arange(first, max_context_len, device=block_tables.device)
        rows = cache_rows(block_tables[0][t // block_size], t % block_size, num_kv_heads,
                          block_size)
        return rows.t().flatten(), None
    index = context_index(block_tables, max_context_len, block_size)
    kpos = torch.arange(index.shape[1] * block_size, device=block_tables.device)
    ctx = context_lens[:, None, None, None]
    padding = kpos[None, None, None, :] >= ctx
    if window:
        padding |= kpos[None, None, None, :] < ctx - window
    return index, padding


def _decode_blocks(q, k_cache, v_cache, index, padding, scale, sinks=None, softcap=None):
    """Attention over the gathered blocks as they lie, [S, blocks, H_kv, bs, D],
    for a batch: gather_context's second copy, into one run per sequence and head,
    cost more than SDPA itself (16 rows of GPT-2 on two CPU cores: 1.3-1.5x
    faster this way, docs/benchmarks.md)."""
    s, h, d = q.shape
    _, hkv, bs, _ = k_cache.shape
    mb, g = index.shape[1], h // hkv
    flat = index.flatten()
    k = select(k_cache, flat, q.dtype).view(s, mb, hkv, bs, d)
    v = select(v_cache, flat, q.dtype).view(s, mb, hkv, bs, d)
    qt = (q * scale).view(s, 1, hkv, g, d).transpose(-1, -2)           # [S, 1, H_kv, D, G]
    scores = torch.matmul(k, qt).permute(0, 2, 4, 1, 3).reshape(s, hkv, g, mb * bs)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill_(padding, float("-inf"))
    if sinks is not None:  # one more logit per row, of a key with no value
        sink = sinks.to(scores.dtype).view(1, hkv, g, 1).expand(s, -1, -1, -1)
        scores = torch.cat([scores, sink], dim=-1)
    p = torch.softmax(scores, dim=-1)[..., :mb * bs]
    p = p.reshape(s, hkv, g, mb, bs).permute(0, 3, 1, 2, 4)            # [S, blocks, H_kv, G, bs]
    return torch.matmul(p, v).sum(1).reshape(s, h, d)


def _prefill(q, k_cache, v_cache, attn, qlens, scale, window=None, sinks=None, softcap=None):
    """Query chunks padded per sequence to the longest one."""
    index = context_index(attn.block_tables, attn.max_context_len, k_cache.shape[2])
    k = gather_context(k_cache, index, attn.max_context_len, q.dtype)
    v = gather_context(v_cache, index, attn.max_context_len, q.dtype)
    kpos = torch.arange(attn.max_context_len, device=q.device)
    seq = torch.repeat_interleave(torch.arange(attn.num_seqs, device=q.device), qlens.long())
    local = torch.arange(q.shape[0], device=q.device) - attn.query_start[:-1].long()[seq]
    padded = q.new_zeros(attn.num_seqs, attn.max_query_len, *q.shape[1:])
    padded[seq, local] = q
    first = (attn.context_lens - qlens)[:, None]
    qp = first + torch.arange(attn.max_query_len, device=q.device)[None, :]
    seen = qp  # the last key each query sees: its own, or its image's last (both ways)
    if attn.visible is not None:
        seen = torch.full_like(qp, -1)
        seen[seq, local] = attn.visible.to(qp.dtype)
        seen = torch.maximum(seen, qp)
    mask = kpos[None, None, None, :] <= seen[:, None, :, None]
    if window:
        mask &= kpos[None, None, None, :] > qp[:, None, :, None] - window
    out = attend(padded.transpose(1, 2), k, v, mask, scale, sinks, softcap)
    return out.transpose(1, 2)[seq, local]


@hookimpl
def roseinfer_register_attention_backends(register):
    register("torch_sdpa", TorchSDPAAttention)
