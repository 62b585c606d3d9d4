"""A third-party attention backend: per request, gather the paged keys and run explicit softmax.

Slow and simple on purpose; it shows the whole contract: declare capabilities, find the valid KV rows once
per step (build_metadata), write the KV cache through slot_mapping with turnout's store_kv, and attend
causally over the cached context as the layer says (its scale, sliding window and logit soft-cap).
"""

import torch

import turnout
from turnout.attention import (
    LAYER_FEATURES,
    AttentionBackend,
    AttentionLayerSpec,
    AttentionMetadata,
    store_kv,
    valid_rows,
)


class NaiveBackend(AttentionBackend):
    name = "naive"
    priority = -10  # never chosen by "auto" over the built-ins; pick it with attention_backend = "naive"
    device_types = ("cpu", "cuda")
    dtypes = (torch.float32, torch.bfloat16, torch.float16)  # the CPU runs float32 unless it has bf16
    attention_features = frozenset(LAYER_FEATURES)  # per-layer scale, sliding_window, logits_soft_cap
    kv_cache_specs = ("full", "sliding_window")  # blocks freed out of a window read as masked keys

    def build_metadata(self, meta: AttentionMetadata) -> torch.Tensor | None:
        return valid_rows(meta.slot_mapping)  # [n] rows with a slot, or None when every row has one

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        layer: AttentionLayerSpec | None = None,  # None: a direct call, for layer 0
    ) -> torch.Tensor:
        layer = layer or self.spec.layer(0)
        store_kv(kv_cache, k, v, meta.slot_mapping, meta.backend_data, capturing=False)
        hkv, d = kv_cache.shape[-2:]
        out = torch.zeros_like(q)
        qsl, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        group = self.spec.num_heads // self.spec.num_kv_heads
        for b, seq_len in enumerate(lens):
            qs, qe = qsl[b], qsl[b + 1]
            blocks = meta.block_table[b].long()
            keys = kv_cache[0, blocks].reshape(-1, hkv, d)[:seq_len].repeat_interleave(group, 1)  # [L, H, D]
            vals = kv_cache[1, blocks].reshape(-1, hkv, d)[:seq_len].repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), keys.float()) * layer.scale
            if cap := layer.logits_soft_cap:
                scores = torch.tanh(scores / cap) * cap
            pos = torch.arange(seq_len - (qe - qs), seq_len, device=q.device)[None, :, None]  # queries
            keys_at = torch.arange(seq_len, device=q.device)[None, None, :]
            hidden = keys_at > pos  # the future
            if window := layer.sliding_window:
                hidden |= keys_at <= pos - window  # out of the window
            scores.masked_fill_(hidden, float("-inf"))
            out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals.float()).to(q.dtype)
        return out


@turnout.hookimpl
def turnout_attention_backends(platform):
    return [NaiveBackend()]
