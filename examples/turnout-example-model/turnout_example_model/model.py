"""GPT-NeoX (Pythia) as a turnout.models.CausalLM, from the public layers only.

Unlike the bundled decoder it has LayerNorms with bias, a parallel residual (attention and MLP both read
the layer's input), rotary embedding on the first rotary_pct of each head, GELU, and a fused
query_key_value whose checkpoint rows go head by head (q, k, v of head 0, then of head 1, ...).
Tensor parallelism comes with turnout's parallel linears; pipeline parallelism is not implemented, and its
ModelArchitecture declares so.
"""

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from turnout.layers import (
    Attention,
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)


class NeoXAttention(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        self.head_size = hidden // heads
        self.query_key_value = QKVParallelLinear(hidden, self.head_size, heads, heads, bias=True)
        self.dense = RowParallelLinear(hidden, hidden, bias=True)
        self.heads = self.query_key_value.num_heads  # this rank's
        self.rot = int(self.head_size * rope.get("partial_rotary_factor", cfg.get("rotary_pct", 1.0)))
        base = rope.get("rope_theta", cfg.get("rotary_emb_base", 10000.0))
        self.rotary = RotaryEmbedding(self.rot, cfg["max_position_embeddings"], base, None)
        self.attn = Attention(self.heads, self.heads, self.head_size, self.head_size**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.query_key_value(x).view(-1, 3, self.heads, self.head_size).unbind(1)  # [T, H, D]
        q_rot, k_rot = self.rotary(positions, q[..., : self.rot], k[..., : self.rot])
        q = torch.cat([q_rot, q[..., self.rot :]], -1)
        k = torch.cat([k_rot, k[..., self.rot :]], -1)
        return self.dense(self.attn(q, k, v))


class NeoXMLP(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(cfg["hidden_size"], cfg["intermediate_size"], bias=True)
        self.dense_4h_to_h = RowParallelLinear(cfg["intermediate_size"], cfg["hidden_size"], bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class NeoXLayer(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"])
        self.post_attention_layernorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"])
        self.attention = NeoXAttention(cfg)
        self.mlp = NeoXMLP(cfg)
        self.parallel_residual = cfg.get("use_parallel_residual", True)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        attn = self.attention(positions, self.input_layernorm(x))
        if self.parallel_residual:
            return self.mlp(self.post_attention_layernorm(x)) + attn + x
        attn = attn + x
        return self.mlp(self.post_attention_layernorm(attn)) + attn


class NeoXModel(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.embed_in = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(NeoXLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.final_layer_norm = nn.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"])


class GPTNeoXForCausalLM(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.num_heads, self.head_size = (
            cfg["num_attention_heads"],
            cfg["hidden_size"] // cfg["num_attention_heads"],
        )
        self.gpt_neox = NeoXModel(cfg)
        self.embed_out = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"])

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.gpt_neox.embed_in(input_ids)
        for layer in self.gpt_neox.layers:
            x = layer(positions, x)
        return self.gpt_neox.final_layer_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.embed_out(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in params:
                continue  # buffers HF saves (rotary inv_freq, causal masks): turnout computes its own
            param = params[name]
            if ".query_key_value." in name:  # rows per head: q, k, v -> one shard each
                per_head = tensor.view(self.num_heads, 3, self.head_size, *tensor.shape[1:])
                for i, shard in enumerate("qkv"):
                    param.weight_loader(param, per_head[:, i].reshape(-1, *tensor.shape[1:]), shard)
            elif hasattr(param, "weight_loader"):  # turnout's parallel layers keep this rank's shard
                param.weight_loader(param, tensor)
            else:  # LayerNorms: replicated
                param.data.copy_(tensor)
            loaded.add(name)
        return loaded
