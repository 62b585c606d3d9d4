"""The dense pre-norm decoder shared by Llama, Qwen2 and Qwen3: model plugins pick the options.

Options read from the HF config: attention_bias (qkv bias; Qwen2 always), qk_norm (Qwen3's per-head RMSNorm
on q and k), rope_scaling / rope_parameters (the kinds RotaryEmbedding implements), tie_word_embeddings. A
config key in MATH_KEYS that changes the math (a sliding window, soft-capping, ...) is refused at build time
unless the class declares it in implemented_keys. The layers choose their kernels (fused norms, the decode
GEMV with the norm or SiLU-and-mul in its prologue); the model only says which output feeds which.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from turnout.distributed import get_parallel_state
from turnout.errors import ConfigError, TurnoutError
from turnout.layers.activation import SiluAndMul
from turnout.layers.attention import Attention
from turnout.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from turnout.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from turnout.layers.norm import RMSNorm
from turnout.layers.rotary import RotaryEmbedding


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}


def _not(default: Any) -> Callable[[Any], Any]:
    """A value that changes the math unless it is None or `default`."""
    return lambda v: None if v is None or v == default else v


# config.json keys that change the math: key -> cfg -> the value that does (None: this config does not)
MATH_KEYS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "sliding_window": lambda c: None if c.get("use_sliding_window") is False else c.get("sliding_window"),
    "layer_types": lambda c: sorted(set(c.get("layer_types") or ()) - {"full_attention"}) or None,
    "attn_logit_softcapping": lambda c: c.get("attn_logit_softcapping"),
    "final_logit_softcapping": lambda c: c.get("final_logit_softcapping"),
    "rope_parameters": lambda c: sorted(k for k, v in _rope(c).items() if isinstance(v, dict)) or None,
    "partial_rotary_factor": lambda c: _not(1.0)(
        c.get("partial_rotary_factor", _rope(c).get("partial_rotary_factor"))
    ),
    "hidden_act": lambda c: _not("silu")(c.get("hidden_act")),
    "hidden_activation": lambda c: _not("silu")(c.get("hidden_activation")),
    "mlp_bias": lambda c: c.get("mlp_bias") or None,
    "query_pre_attn_scalar": lambda c: _not(c.get("head_dim"))(c.get("query_pre_attn_scalar")),
    "use_qk_norm": lambda c: c.get("use_qk_norm") or None,
    "no_rope_layers": lambda c: c["no_rope_layers"] if 0 in (c.get("no_rope_layers") or ()) else None,
    "attention_multiplier": lambda c: _not(1.0)(c.get("attention_multiplier")),
    "embedding_multiplier": lambda c: _not(1.0)(c.get("embedding_multiplier")),
    "residual_multiplier": lambda c: _not(1.0)(c.get("residual_multiplier")),
    "logits_scaling": lambda c: _not(1.0)(c.get("logits_scaling")),
}
# a key whose implementation lives in the Attention layers: key -> the layer attribute it sets
_LAYER_KEYS = {"sliding_window": "sliding_window", "attn_logit_softcapping": "logits_soft_cap"}


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
        key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
        try:
            self.rotary = RotaryEmbedding(
                self.head_size, cfg.get("max_position_embeddings", 2048), rope_base, cfg.get(key)
            )
        except ValueError as e:
            raise ConfigError(f"config.json's {key}: {e}; use a model plugin that implements it") from None
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
    mixture-of-experts model also overrides make_mlp. A config that sets a MATH_KEYS key the class does not
    list in implemented_keys is refused (ConfigError) before any layer is built."""

    qkv_bias: bool = False
    qk_norm: bool = False
    implemented_keys: frozenset[str] = frozenset()  # the MATH_KEYS a subclass implements itself
    packed = {  # checkpoint name -> (our parameter, shard id)
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.check_config(cfg)
        self.cfg = cfg
        self.qkv_bias = bool(cfg.get("attention_bias", self.qkv_bias))
        self.model = DecoderModel(cfg, self.qkv_bias, self.qk_norm, self.make_mlp)
        self.tie = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"])
        if self.tie:
            self.lm_head.weight = self.model.embed_tokens.weight

    def check_config(self, cfg: dict[str, Any]) -> None:
        """Refuse, in one line, a config.json key that changes the math and that this class does not
        implement; implemented_keys must name MATH_KEYS only."""
        name = type(self).__qualname__
        if unknown := sorted(set(self.implemented_keys) - MATH_KEYS.keys()):
            raise TurnoutError(
                f"{name}.implemented_keys names {', '.join(unknown)}, not among DecoderForCausalLM's "
                f"MATH_KEYS ({', '.join(MATH_KEYS)}); a bug in the model plugin {type(self).__module__}"
            )
        for key, changes in MATH_KEYS.items():
            if key not in self.implemented_keys and (value := changes(cfg)) is not None:
                raise ConfigError(
                    f"config.json sets {key} = {value!r}, which changes the model's math and {name} "
                    f"({type(self).__module__}) does not implement; use a model plugin that does"
                )

    def check_layers(self) -> None:
        """The layers as built use what implemented_keys claims for this config: a declared sliding_window
        or attn_logit_softcapping that no Attention layer carries would answer silently wrong."""
        for key, attr in _LAYER_KEYS.items():
            if key not in self.implemented_keys or MATH_KEYS[key](self.cfg) is None:
                continue
            if all(getattr(m, attr) is None for m in self.modules() if isinstance(m, Attention)):
                raise TurnoutError(
                    f"{type(self).__qualname__} declares {key} in implemented_keys, but none of its "
                    f"Attention layers sets {attr}; a bug in the model plugin {type(self).__module__}"
                )

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
        self.check_layers()
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
