"""MistralForCausalLM on the shared decoder: Llama's layers, each attending to its latest sliding_window
keys (its own included), as HF's MistralAttention does."""

from __future__ import annotations

from typing import Any

from turnout.layers import Attention
from turnout.models import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    """Llama's decoder; config.json's sliding_window (null: none) bounds every layer's attention."""

    implemented_keys = frozenset({"sliding_window"})

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(cfg)
        if window := cfg.get("sliding_window"):
            for layer in self.model.layers:
                a = layer.self_attn.attn
                layer.self_attn.attn = Attention(
                    a.num_heads, a.num_kv_heads, a.head_size, a.scale, sliding_window=window
                )
