"""A third-party attention backend: per request, gather the paged keys and run explicit softmax.

Slow and simple on purpose; it shows the whole contract: declare capabilities, write the KV cache through
slot_mapping (skipping -1), attend causally over the cached context.
"""

import torch

import turnout
from turnout.attention import AttentionBackend, AttentionLayerSpec, AttentionMetadata


class NaiveBackend(AttentionBackend):
    name = "naive"
    priority = -10  # never chosen by "auto" over the built-ins; pick it with attention_backend = "naive"
    device_types = ("cpu", "cuda")
    dtypes = (torch.float32, torch.bfloat16, torch.float16)

    def forward(
        self,
        layer: AttentionLayerSpec,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = meta.num_actual_tokens
        slots = meta.slot_mapping[:t]
        ok = slots >= 0
        hkv, d = kv_cache.shape[-2:]
        kv_cache[0].view(-1, hkv, d)[slots[ok]] = k[:t][ok]
        kv_cache[1].view(-1, hkv, d)[slots[ok]] = v[:t][ok]
        out = torch.zeros_like(q)
        qsl, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        group = layer.num_heads // layer.num_kv_heads
        for b, seq_len in enumerate(lens):
            qs, qe = qsl[b], qsl[b + 1]
            blocks = meta.block_table[b].long()
            keys = kv_cache[0, blocks].reshape(-1, hkv, d)[:seq_len].repeat_interleave(group, 1)  # [L, H, D]
            vals = kv_cache[1, blocks].reshape(-1, hkv, d)[:seq_len].repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), keys.float()) * layer.scale
            pos = torch.arange(seq_len - (qe - qs), seq_len, device=q.device)  # query positions
            future = torch.arange(seq_len, device=q.device)[None, None, :] > pos[None, :, None]
            scores.masked_fill_(future, float("-inf"))
            out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals.float()).to(q.dtype)
        return out


@turnout.hookimpl
def turnout_attention_backends(platform):
    return [NaiveBackend()]
