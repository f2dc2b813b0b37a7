"""Reference paged attention on torch SDPA: any device, padded per sequence."""
import torch
import torch.nn.functional as F

from roseinfer.core.hookspecs import hookimpl


def gather_context(cache, block_tables, max_context_len):
    """[blocks, H_kv, bs, D] through [S, MB] tables -> [S, H_kv, max_ctx, D]."""
    _, h, bs, d = cache.shape
    mb = -(-max_context_len // bs)  # tables may be wider than the longest context
    s = block_tables.shape[0]
    x = cache[block_tables[:, :mb].long()]              # [S, MB, H_kv, bs, D]
    x = x.permute(0, 2, 1, 3, 4).reshape(s, h, mb * bs, d)
    return x[:, :, :max_context_len]


class TorchSDPAAttention:
    def supports(self, device) -> bool:
        return True

    def forward(self, q, k_cache, v_cache, attn, scale):
        k = gather_context(k_cache, attn.block_tables, attn.max_context_len)
        v = gather_context(v_cache, attn.block_tables, attn.max_context_len)
        qlens = attn.query_start[1:] - attn.query_start[:-1]
        kpos = torch.arange(attn.max_context_len, device=q.device)
        if attn.is_decode:
            qp = (attn.context_lens - 1)[:, None]                  # [S, 1]
            mask = kpos[None, None, None, :] <= qp[:, None, :, None]
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            return out.squeeze(2)
        seq, local = self._token_index(attn, qlens, q.shape[0], q.device)
        padded = q.new_zeros(attn.num_seqs, attn.max_query_len, *q.shape[1:])
        padded[seq, local] = q
        first = (attn.context_lens - qlens)[:, None]
        qp = first + torch.arange(attn.max_query_len, device=q.device)[None, :]
        mask = kpos[None, None, None, :] <= qp[:, None, :, None]
        out = F.scaled_dot_product_attention(
            padded.transpose(1, 2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return out.transpose(1, 2)[seq, local]

    @staticmethod
    def _token_index(attn, qlens, n, device):
        seq = torch.repeat_interleave(torch.arange(attn.num_seqs, device=device), qlens.long())
        local = torch.arange(n, device=device) - attn.query_start[:-1].long()[seq]
        return seq, local


@hookimpl
def roseinfer_register_attention_backends(register):
    register("torch_sdpa", TorchSDPAAttention)
