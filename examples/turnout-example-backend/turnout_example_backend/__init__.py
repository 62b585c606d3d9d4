"""A third-party attention backend: per request, gather the paged keys and run explicit softmax.

Slow and simple on purpose; it shows the whole contract (plugin API 3) in its three parts: the backend
declares capabilities; its metadata builder finds the valid KV rows once per step; its impl, one per layer,
writes the KV cache through slot_mapping with turnout's store_kv and attends causally over the cached
context as its layer says (scale, sliding window and logit soft-cap).
"""

import torch

import turnout
from turnout.attention import (
    LAYER_FEATURES,
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    store_kv,
    valid_rows,
)


class NaiveBuilder(AttentionMetadataBuilder):
    """Once a step for each KV-cache group: the token rows whose k, v go into the cache."""

    def build(self, meta: AttentionMetadata) -> torch.Tensor | None:
        return valid_rows(meta.slot_mapping)  # [n] rows with a slot, or None when every row has one


class NaiveImpl(AttentionImpl):
    """One layer: explicit softmax over each request's gathered keys."""

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,  # backend_data: what NaiveBuilder.build returned
    ) -> torch.Tensor:
        layer = self.layer
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


class NaiveBackend(AttentionBackend):
    """What the naive backend serves, and its two parts."""

    name = "naive"
    priority = -10  # never chosen by "auto" over the built-ins; pick it with attention_backend = "naive"
    device_types = ("cpu", "cuda")
    dtypes = (torch.float32, torch.bfloat16, torch.float16)  # the CPU runs float32 unless it has bf16
    attention_features = frozenset(LAYER_FEATURES)  # per-layer scale, sliding_window, logits_soft_cap
    kv_cache_specs = ("full", "sliding_window")  # blocks freed out of a window read as masked keys
    builder_cls = NaiveBuilder
    impl_cls = NaiveImpl


@turnout.hookimpl
def turnout_attention_backends(platform):
    return [NaiveBackend()]
