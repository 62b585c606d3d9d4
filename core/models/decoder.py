"""The dense pre-norm decoder shared by Llama, Qwen2 and Qwen3: model plugins pick the options.

Options read from the HF config: attention_bias (qkv bias; Qwen2 always), qk_norm (Qwen3's per-head RMSNorm
on q and k), rope_scaling (linear, llama3, yarn), tie_word_embeddings. The layers choose their kernels (fused
norms, the decode GEMV with the norm or SiLU-and-mul in its prologue); the model only says which output feeds
which.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from turnout.distributed import get_parallel_state
from turnout.layers.activation import SiluAndMul
from turnout.layers.attention import Attention
from turnout.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from turnout.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from turnout.layers.norm import RMSNorm
from turnout.layers.rotary import RotaryEmbedding


class DecoderAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        self.head_size = cfg.get("head_dim") or hidden // heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_size, heads, kv_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(heads * self.head_size, hidden)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        rope_base = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        self.rotary = RotaryEmbedding(
            self.head_size, cfg.get("max_position_embeddings", 2048), rope_base, scaling
        )
        self.q_norm = RMSNorm(self.head_size, cfg["rms_norm_eps"]) if qk_norm else None
        self.k_norm = RMSNorm(self.head_size, cfg["rms_norm_eps"]) if qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_size, self.head_size**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        q, k, v = qkv.split([self.num_heads * self.head_size] + [self.num_kv_heads * self.head_size] * 2, -1)
        q = q.view(-1, self.num_heads, self.head_size)  # [T, H, D]
        k, v = k.view(-1, self.num_kv_heads, self.head_size), v.view(-1, self.num_kv_heads, self.head_size)
        q, k = self.rotary(positions, q, k, self.q_norm, self.k_norm)
        return self.o_proj(self.attn(q, k, v))


class DecoderMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2)
        self.down_proj = RowParallelLinear(intermediate, hidden)
        self.act = SiluAndMul(feeds_linear=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: dict[str, Any], qkv_bias: bool, qk_norm: bool, mlp: nn.Module | None = None
    ) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.self_attn = DecoderAttention(cfg, qkv_bias, qk_norm)
        self.mlp = mlp if mlp is not None else DecoderMLP(hidden, cfg["intermediate_size"])
        self.input_layernorm = RMSNorm(hidden, eps, feeds_linear=True)
        # only the dense MLP's gate_up_proj takes a PendingNorm
        self.post_attention_layernorm = RMSNorm(hidden, eps, feeds_linear=isinstance(self.mlp, DecoderMLP))

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def layer_range(num_layers: int) -> tuple[int, int]:
    """This pipeline stage's [start, end) layers, split as evenly as possible."""
    ps = get_parallel_state()
    per, extra = divmod(num_layers, ps.pp_size)
    start = ps.pp_rank * per + min(ps.pp_rank, extra)
    return start, start + per + (ps.pp_rank < extra)


class DecoderModel(nn.Module):
    def __init__(
        self,
        cfg: dict[str, Any],
        qkv_bias: bool,
        qk_norm: bool,
        make_mlp: Callable[[int], nn.Module | None] = lambda layer: None,
    ) -> None:
        super().__init__()
        self.start, self.end = layer_range(cfg["num_hidden_layers"])
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, qkv_bias, qk_norm, make_mlp(i)) for i in range(self.start, self.end)
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids, positions [T] -> [T, hidden]; a later pipeline stage passes `intermediate` instead
        of embedding: [2, T, hidden] (hidden, residual). A non-last stage returns that pair stacked."""
        if intermediate is None:
            x, residual = self.embed_tokens(input_ids), None
        else:
            x, residual = intermediate[0], intermediate[1]
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        if not get_parallel_state().is_last_pp:
            return torch.stack([x, residual])
        x, _ = self.norm(x, residual)
        return x


class DecoderForCausalLM(nn.Module):
    """A turnout.models.CausalLM. Subclasses set qkv_bias / qk_norm (or derive them from the config); a
    mixture-of-experts model also overrides make_mlp."""

    qkv_bias: bool = False
    qk_norm: bool = False
    packed = {  # checkpoint name -> (our parameter, shard id)
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv_bias = bool(cfg.get("attention_bias", self.qkv_bias))
        self.model = DecoderModel(cfg, self.qkv_bias, self.qk_norm, self.make_mlp)
        self.tie = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"])
        if self.tie:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp(self, layer: int) -> nn.Module | None:
        """The feed-forward block of layer `layer` (its global index): forward(x [T, hidden]) -> [T, hidden].
        None = the dense DecoderMLP of intermediate_size; a MoE model returns its sparse block."""
        return None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 -> hidden states [T, hidden] after the final norm; a later pipeline
        stage takes `intermediate` [2, T, hidden] (hidden, residual) instead, and a non-last stage returns
        that pair stacked (CausalLM.forward)."""
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        """hidden [N, hidden] -> logits [N, vocab_size] through lm_head (the embedding, where tied), the
        whole vocabulary on every tensor-parallel rank."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Feed checkpoint tensors through each parameter's weight_loader; returns the names loaded."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            name = self._local_name(name)
            if name is None:
                continue
            for ckpt, (ours, shard) in self.packed.items():
                if f".{ckpt}." in name:
                    target = name.replace(ckpt, ours)
                    if target in params:
                        params[target].weight_loader(params[target], tensor, shard)
                        loaded.add(target)
                    break
            else:
                if name in params:
                    p = params[name]
                    getattr(p, "weight_loader", _default_loader)(p, tensor)
                    loaded.add(name)
        return loaded

    def _local_name(self, name: str) -> str | None:
        """Drop tensors this rank doesn't hold; renumber layers to this stage's local index."""
        if "rotary_emb" in name or (self.tie and name == "lm_head.weight"):
            return None
        if name.startswith("model.layers."):
            idx = int(name.split(".")[2])
            if not self.model.start <= idx < self.model.end:
                return None
            name = name.replace(f"layers.{idx}.", f"layers.{idx - self.model.start}.", 1)
        return name


def _default_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)
