"""Phi3ForCausalLM on the shared decoder, as HF's modeling_phi3 computes it: Llama's layers; the checkpoint
holds q, k, v as one qkv_proj and gate, up as one gate_up_proj; rope turns the first partial_rotary_factor
of each head (LongRoPE where config.json says longrope, su or yarn); every layer attends within
sliding_window where it is set."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from turnout import TurnoutError
from turnout.layers import RotaryEmbedding
from turnout.models import DecoderForCausalLM


class PartialRotary(nn.Module):
    """A RotaryEmbedding over the first `rot` dims of each head; the rest of the head passes unchanged."""

    def __init__(self, rope: RotaryEmbedding, rot: int) -> None:
        super().__init__()
        self.rope, self.rot = rope, rot

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm=None, k_norm=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hkv, D] -> the same with dims [0, rot) rotated at positions [T]."""
        q_rot, k_rot = self.rope(positions, q[..., : self.rot], k[..., : self.rot])
        return torch.cat([q_rot, q[..., self.rot :]], -1), torch.cat([k_rot, k[..., self.rot :]], -1)


def phi3_rope(cfg: dict[str, Any], head_size: int) -> tuple[int, float, dict[str, Any]]:
    """(rotated dims, rope_theta, the flat scaling dict) as HF's Phi3Config reads them: rope_scaling or
    rope_parameters, its su and yarn meaning longrope, and the top-level original_max_position_embeddings
    (default 4096) replacing the dict's."""
    rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    base = rope.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
    factor = cfg.get("partial_rotary_factor", rope.pop("partial_rotary_factor", 1.0))
    kind = rope.pop("type", None) or rope.get("rope_type") or "default"
    rope["rope_type"] = "longrope" if kind in ("su", "yarn") else kind
    if rope["rope_type"] == "longrope":
        rope["original_max_position_embeddings"] = cfg.get("original_max_position_embeddings", 4096)
    return int(head_size * factor), base, rope


class Phi3ForCausalLM(DecoderForCausalLM):
    """The decoder with Phi-3's rope and window; load_weights splits the fused checkpoint tensors into the
    q/k/v and gate/up parts the shared loader takes, so tensor parallelism shards each part."""

    implemented_keys = frozenset({"sliding_window", "partial_rotary_factor"})

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.check_config(cfg)
        # the decoder's own rotary tables are replaced below: plain rope over one position keeps them small
        plain = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_parameters")}
        super().__init__({**plain, "max_position_embeddings": 1})
        self.cfg = cfg
        head_size = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        rot, base, scaling = phi3_rope(cfg, head_size)
        try:
            rope = RotaryEmbedding(rot, cfg.get("max_position_embeddings", 4096), base, scaling)
        except ValueError as e:
            raise TurnoutError(
                f"config.json's rope_scaling: {e}; fix config.json or use a model plugin that implements it"
            ) from None
        rotary = rope if rot == head_size else PartialRotary(rope, rot)  # one table for every layer
        for layer in self.model.layers:
            layer.self_attn.rotary = rotary

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The shared loader over the checkpoint with qkv_proj split into q/k/v_proj and gate_up_proj into
        gate/up_proj; a fused tensor of the wrong size is refused naming it."""
        return super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.cfg
        heads = cfg["num_attention_heads"]
        head_size = cfg.get("head_dim") or cfg["hidden_size"] // heads
        q, kv = heads * head_size, (cfg.get("num_key_value_heads") or heads) * head_size
        parts = {
            "qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
            "gate_up_proj": (("gate_proj", cfg["intermediate_size"]), ("up_proj", cfg["intermediate_size"])),
        }
        for name, tensor in weights:
            fused = next((f for f in parts if f".{f}." in name), None)
            if fused is None:
                yield name, tensor
                continue
            sizes = [n for _, n in parts[fused]]
            if tensor.shape[0] != sum(sizes):
                raise TurnoutError(
                    f"checkpoint tensor {name} has {tensor.shape[0]} rows where config.json gives "
                    f"{' + '.join(map(str, sizes))} ({', '.join(p for p, _ in parts[fused])}); "
                    "the checkpoint and its config.json disagree: re-download the model"
                )
            for (part, _), piece in zip(parts[fused], tensor.split(sizes)):
                yield name.replace(fused, part), piece
