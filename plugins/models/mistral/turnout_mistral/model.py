"""MistralForCausalLM on the shared decoder: Llama's layers, each attending to its latest sliding_window
keys (its own included), as HF's MistralAttention does."""

from __future__ import annotations

from turnout.models import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    """Llama's decoder; config.json's sliding_window (null: none) bounds every layer's attention."""

    implemented_keys = frozenset({"sliding_window"})  # the shared decoder applies it to every layer
