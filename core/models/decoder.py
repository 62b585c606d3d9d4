"""The dense pre-norm decoder shared by Llama, Qwen2 and Qwen3: model plugins pick the options.

Options read from the HF config: attention_bias (qkv bias; Qwen2 always), qk_norm (Qwen3's per-head RMSNorm
on q and k), rope_scaling / rope_parameters (the kinds RotaryEmbedding implements), tie_word_embeddings. A
config key in MATH_KEYS that changes the math (a sliding window, soft-capping, ...) is refused at build time
unless the class declares it in implemented_keys. The layers choose their kernels (fused norms, the decode
GEMV with the norm or SiLU-and-mul in its prologue); the model only says which output feeds which.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from turnout.distributed import get_parallel_state
from turnout.errors import ConfigError, TurnoutError, WeightLoadError
from turnout.layers.activation import SiluAndMul
from turnout.layers.attention import Attention
from turnout.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from turnout.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from turnout.layers.moe import FusedMoE
from turnout.layers.norm import RMSNorm
from turnout.layers.rotary import RotaryEmbedding
from turnout.quantization import kv_scale_name


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
    "use_bidirectional_attention": lambda c: c.get("use_bidirectional_attention") or None,
    "no_rope_layers": lambda c: c["no_rope_layers"] if 0 in (c.get("no_rope_layers") or ()) else None,
    "attention_multiplier": lambda c: _not(1.0)(c.get("attention_multiplier")),
    "embedding_multiplier": lambda c: _not(1.0)(c.get("embedding_multiplier")),
    "residual_multiplier": lambda c: _not(1.0)(c.get("residual_multiplier")),
    "logits_scaling": lambda c: _not(1.0)(c.get("logits_scaling")),
}
# a key whose implementation lives in the Attention layers: key -> the layer attribute it sets
_LAYER_KEYS = {"sliding_window": "sliding_window", "attn_logit_softcapping": "logits_soft_cap"}


def decoder_rope(cfg: dict[str, Any]) -> RotaryEmbedding:
    """The RotaryEmbedding of config.json's rope_theta and its one flat rope_scaling / rope_parameters."""
    heads = cfg["num_attention_heads"]
    head_size = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope_base = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    try:
        return RotaryEmbedding(head_size, cfg.get("max_position_embeddings", 2048), rope_base, cfg.get(key))
    except ValueError as e:
        raise ConfigError(f"config.json's {key}: {e}; use a model plugin that implements it") from None


class DecoderAttention(nn.Module):
    def __init__(
        self, cfg: dict[str, Any], qkv_bias: bool, qk_norm: bool, rotary: RotaryEmbedding | None = None
    ) -> None:
        super().__init__()
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        self.head_size = cfg.get("head_dim") or hidden // heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_size, heads, kv_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(heads * self.head_size, hidden)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.rotary = rotary if rotary is not None else decoder_rope(cfg)  # one table the layers share
        self.q_norm = RMSNorm(self.head_size, cfg["rms_norm_eps"]) if qk_norm else None
        self.k_norm = RMSNorm(self.head_size, cfg["rms_norm_eps"]) if qk_norm else None
        # a set window reaches here only where the class implements it (check_config refuses it otherwise)
        window = MATH_KEYS["sliding_window"](cfg) or None
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_size, self.head_size**-0.5, sliding_window=window
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        q, k, v = qkv.split([self.num_heads * self.head_size] + [self.num_kv_heads * self.head_size] * 2, -1)
        q = q.view(-1, self.num_heads, self.head_size)  # [T, H, D]
        k, v = k.view(-1, self.num_kv_heads, self.head_size), v.view(-1, self.num_kv_heads, self.head_size)
        q, k = self.rotary(positions, q, k, self.q_norm, self.k_norm)
        return self.o_proj(self.attn(q, k, v))


class DecoderMLP(nn.Module):
    """The SwiGLU feed-forward block (gate_proj and up_proj fused): x [T, hidden] -> [T, hidden]."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2)
        self.down_proj = RowParallelLinear(intermediate, hidden)
        self.act = SiluAndMul(feeds_linear=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down_proj(silu(gate) * up)."""
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: dict[str, Any],
        qkv_bias: bool,
        qk_norm: bool,
        mlp: nn.Module | None = None,
        rotary: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.self_attn = DecoderAttention(cfg, qkv_bias, qk_norm, rotary)
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
        rotary = decoder_rope(cfg)  # [max_position, head_dim / 2] tables: one for every layer, not one each
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, qkv_bias, qk_norm, make_mlp(i), rotary) for i in range(self.start, self.end)
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
    # config.json keys that change the math, refused unless implemented; a subclass adds its architecture's
    # own as {**DecoderForCausalLM.math_keys, key: cfg -> the value it does not implement, or None}
    math_keys: dict[str, Callable[[dict[str, Any]], Any]] = MATH_KEYS
    packed = {  # checkpoint name -> (our parameter, shard id)
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    expert_packed: dict[str, int] = {}  # a FusedMoE's checkpoint projection -> its weight_loader shard

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
        implement; implemented_keys must name math_keys (MATH_KEYS and the class's own) only."""
        name = type(self).__qualname__
        if unknown := sorted(set(self.implemented_keys) - self.math_keys.keys()):
            raise TurnoutError(
                f"{name}.implemented_keys names {', '.join(unknown)}, not among its math_keys "
                f"({', '.join(self.math_keys)}); a bug in the model plugin {type(self).__module__}"
            )
        for key, changes in self.math_keys.items():
            if key not in self.implemented_keys and (value := changes(cfg)) is not None:
                raise ConfigError(
                    f"config.json sets {key} = {value!r}, which changes the model's math and {name} "
                    f"({type(self).__module__}) does not implement; use a model plugin that does"
                )

    def check_layers(self) -> None:
        """The layers as built use what implemented_keys claims for this config: a declared sliding_window
        or attn_logit_softcapping that no Attention layer carries would answer silently wrong. Checked
        where this rank holds every layer: one pipeline stage may hold none of the layers a key touches."""
        if (self.model.start, self.model.end) != (0, self.cfg["num_hidden_layers"]):
            return
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
        """Feed each checkpoint tensor through its parameter's weight_loader (its part of a fused one);
        returns the parameters filled, each whole. A checkpoint that lacks a tensor this rank reads, holds
        one that no parameter takes, or one of another shape than config.json gives is refused with one line
        naming that tensor (WeightLoadError)."""
        self.check_layers()
        parts, params, seen = self.checkpoint_parts(), dict(self.named_parameters()), {}
        for given, tensor in weights:
            name = kv_scale_name(given) if given not in parts else given
            if (first := seen.get(name)) is not None:
                twice = f"{given} twice" if first == given else f"{first} and {given}, one tensor"
                raise WeightLoadError(f"the checkpoint holds {twice}; remove one from its files")
            seen[name] = given
            if name not in parts:
                if self._local_name(name) is None:  # another stage's layer, a tied lm_head, rotary tables
                    continue
                raise WeightLoadError(
                    f"the checkpoint's {given} is used by no parameter of {self._who()}; re-convert the "
                    "model to match config.json, or use a model plugin that implements the layer it belongs "
                    "to"
                )
            if (part := parts[name]) is not None:
                self._load_part(given, tensor, params[part.param], part)
        if missing := sorted(parts.keys() - seen):
            part, more = parts[missing[0]], f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            whose = _part_of(part.shard) if part else ""
            raise WeightLoadError(
                f"the checkpoint lacks {missing[0]}{more}, which fills {whose}{self._who()}'s "
                f"{part.param if part else 'experts on another rank'}; re-download or re-convert the model: "
                "its weights do not match config.json"
            )
        return {part.param for part in parts.values() if part is not None}

    def checkpoint_parts(self) -> dict[str, Part | None]:
        """Every checkpoint tensor this stage reads -> the part of a parameter it fills (None: an expert that
        another expert-parallel rank holds). The parts of fused layers are named per shard through packed
        (and expert_packed for FusedMoE), for every parameter of the layer: weight, bias, scales alike."""
        owned, parts = dict(self.named_parameters()), {}
        unpack = {(ours, shard): ckpt for ckpt, (ours, shard) in self.packed.items()}
        for path, m in self.named_modules():
            for leaf, p in m.named_parameters(recurse=False):
                name = f"{path}.{leaf}" if path else leaf
                if owned.get(name) is p:
                    parts |= self._parts_of(m, path, leaf, name, p, unpack)
        return parts

    def _parts_of(
        self, m: nn.Module, path: str, leaf: str, name: str, p: nn.Parameter, unpack: dict[tuple, str]
    ) -> dict[str, Part | None]:
        """The checkpoint names (global layer index) that fill parameter `name` of module m at `path`."""
        parent, _, ours = self._global_name(path).rpartition(".")
        if isinstance(m, Attention):  # FP8 KV cache scales: vLLM's <attention module>.k_scale / .v_scale
            return {f"{parent}.{leaf}": Part(name, (), None)}
        if isinstance(m, FusedMoE):
            kind, _, rest = leaf.partition("_")  # w13_weight: shards 0 and 1; w2_weight: shard 2
            return {
                f"{parent}.{ours}.{e}.{proj}.{rest}": (
                    Part(name, (e, s), _full_shape(m, leaf, p, s)) if e in m.local_experts else None
                )
                for proj, s in self.expert_packed.items()
                if (s < 2) == (kind == "w13")
                for e in range(m.num_experts)
            }
        shards = _shard_ids(m)
        if shards is None:
            return {self._global_name(name): Part(name, (), _full_shape(m, leaf, p, None))}
        if lost := [s for s in shards if (ours, s) not in unpack]:
            raise TurnoutError(
                f"{type(self).__qualname__}.packed names no checkpoint tensor for shard {lost[0]!r} of "
                f"{name}; a bug in the model plugin {type(self).__module__}"
            )
        return {
            f"{parent}.{unpack[ours, s]}.{leaf}": Part(name, (s,), _full_shape(m, leaf, p, s)) for s in shards
        }

    def _load_part(self, name: str, tensor: torch.Tensor, p: nn.Parameter, part: Part) -> None:
        if part.shape is not None and tuple(tensor.shape) != part.shape:
            raise WeightLoadError(
                f"the checkpoint's {name} has shape {list(tensor.shape)}, where {self._who()} expects "
                f"{list(part.shape)} from config.json; re-download or re-convert the model to match it"
            )
        try:
            getattr(p, "weight_loader", _default_loader)(p, tensor, *part.shard)
        except (RuntimeError, IndexError, ValueError) as e:  # a loader's own check of the tensor
            raise WeightLoadError(
                f"the checkpoint's {name} (shape {list(tensor.shape)}) does not fit {self._who()}'s "
                f"{part.param}: {' '.join(str(e).split())}; re-download or re-convert the model"
            ) from None

    def _who(self) -> str:
        return f"{type(self).__qualname__} ({type(self).__module__})"

    def _global_name(self, name: str) -> str:
        """Our parameter's name with its layer's index in the checkpoint (this stage's layers are local)."""
        if not name.startswith("model.layers."):
            return name
        idx = name.split(".")[2]
        return name.replace(f"layers.{idx}.", f"layers.{int(idx) + self.model.start}.", 1)

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


def _part_of(shard: tuple) -> str:
    if len(shard) == 2:  # a FusedMoE's (expert, shard)
        return f"expert {shard[0]}'s part {shard[1]} of "
    return f"part {shard[0]!r} of " if shard else ""


class Part(NamedTuple):
    """What one checkpoint tensor fills: our parameter, the shard arguments of its weight_loader (() for
    the whole parameter), and the tensor's shape (None where the layer does not say, e.g. a scale)."""

    param: str
    shard: tuple
    shape: tuple[int, ...] | None


def _shard_ids(m: nn.Module) -> tuple | None:
    """The shard ids of a fused layer's parameters, each filled by its own checkpoint tensor; None: a
    parameter filled whole."""
    if isinstance(m, QKVParallelLinear):
        return ("q", "k", "v")
    if isinstance(m, MergedColumnParallelLinear):
        return tuple(range(len(m.output_sizes)))
    return None


def _full_shape(m: nn.Module, leaf: str, p: nn.Parameter, shard: Any) -> tuple[int, ...] | None:
    """The checkpoint tensor's shape for part `shard` of m's parameter `leaf` (p: this rank's); None for
    a parameter whose layer does not give it, e.g. a quantization scale (its loader checks it)."""
    rest = tuple(p.shape[1:])
    if not hasattr(p, "weight_loader"):  # replicated
        return tuple(p.shape)
    if leaf not in ("weight", "bias", "w13_weight", "w2_weight"):
        return None
    if isinstance(m, VocabParallelEmbedding):
        return (m.vocab_size, *rest)
    if isinstance(m, QKVParallelLinear):
        heads = m.num_heads * m.tp_size if shard == "q" else m.num_kv_heads * m.tp_size // m.kv_replicas
        return (heads * m.head_size, *rest)
    if isinstance(m, MergedColumnParallelLinear):
        return (m.output_sizes[shard], *rest)
    if isinstance(m, ColumnParallelLinear):
        return (p.shape[0] * m.tp_size, *rest)
    if isinstance(m, RowParallelLinear):
        return tuple(p.shape) if leaf == "bias" else (p.shape[0], p.shape[1] * m.tp_size)
    if isinstance(m, FusedMoE):  # w13 [E, 2I, H] per expert (gate | up), w2 [E, H, I]
        e, rows, cols = p.shape
        return (rows // 2 * m.tp_size, cols) if leaf == "w13_weight" else (rows, cols * m.tp_size)
    return None


def _default_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)
