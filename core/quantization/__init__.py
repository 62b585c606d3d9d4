"""Quantization methods, the fifth plugin kind: how a checkpoint's quantized weights load and compute.

A `QuantizationMethod` (returned by the `turnout_quantization_methods` hook) declares the checkpoint formats
it reads (by `quantization_config.quant_method`), whether it quantizes an unquantized checkpoint at load
(`online`, asked for by `quantization = "fp8"`), the devices and compute capabilities it runs on, and which
layers it replaces (`replaces`: "linear", "moe", "lm_head"). Selection (`turnout.selection`) picks one the
way it picks the other kinds; a checkpoint whose `quantization_config` no installed method serves is refused
at start-up, never loaded as if it were unquantized.

For each tensor-parallel linear layer of the model (`turnout.layers.ColumnParallelLinear`,
`MergedColumnParallelLinear`, `QKVParallelLinear`, `RowParallelLinear`) the chosen method returns a
`LinearMethod` (or None to leave the layer as it is). Before the checkpoint loads, `create_weights` gives the
layer its parameters (the quantized weight and its scales, each with a `weight_loader` that keeps this
rank's shard: the layer's `shard_rows` / `shard_cols` say where each checkpoint part goes); after it loads,
`process_weights_after_loading` checks and converts them; each forward calls `apply`, or `apply_pending` where
the layer's input is a norm or activation deferred into it (`turnout.layers.PendingNorm`, `PendingSiluMul`),
which a method that quantizes its input may compute in the same kernel as that quantization.

A method whose `replaces` includes "moe" returns a `MoEMethod` for each `turnout.layers.FusedMoE` layer
(`moe_method`): it gives the layer its quantized expert parameters (`w13_weight`, `w2_weight` and their
scales, named so that `w13_<suffix>` reads the checkpoint's `experts.<e>.gate_proj.<suffix>` and
`up_proj.<suffix>`, `w2_<suffix>` its `down_proj.<suffix>`), each loaded per expert and sharded as the
layer's own `weight_loader` shards its weights; after loading it either leaves `w13_weight` and
`w2_weight` in the compute dtype and sets the layer's `quant_method` to None (the layer's MoE kernel then
computes the experts), or keeps them quantized, leaves `quant_method` set and computes the experts itself in
`apply`. `notes` says how each layer kind computes,
for `turnout explain`: a method that changes a layer's precision at load says so there.

A method whose checkpoint holds static FP8 KV cache scales says so in `kv_cache_scales(ctx)`. Each
`turnout.layers.Attention` layer then gets two float32 parameters, `k_scale` and `v_scale`, which the
checkpoint fills from `<attention module>.k_scale` / `.v_scale` (vLLM's names; llm-compressor's
`k_proj.output_scale` / `v_proj.output_scale` load into them too), one positive finite scale each; after
loading they become the layer's float `k_scale` / `v_scale`, the FP8 KV cache's scales (stored
e4m3(x / scale), read stored * scale). Selection then runs the KV cache in FP8 where `kv_cache_dtype` is
auto, as vLLM does, and says so (`kv_cache_dtype_for`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from turnout.errors import ConfigError, WeightLoadError
from turnout.layers.activation import PendingSiluMul
from turnout.layers.attention import Attention
from turnout.layers.linear import ColumnParallelLinear, RowParallelLinear
from turnout.layers.moe import FusedMoE, num_experts
from turnout.layers.norm import PendingNorm
from turnout.platform import Platform
from turnout.priority import Priority

LinearLayer = ColumnParallelLinear | RowParallelLinear
LAYER_KINDS = ("linear", "moe", "lm_head")  # what a method may declare it replaces

# The plugin that serves a quant_method, for the refusal's one line where none installed does.
KNOWN_FORMATS = {
    "fp8": "turnout-fp8",
    "compressed-tensors": "turnout-fp8 (its FP8 schemes)",
}


@dataclass(frozen=True)
class QuantizationContext:
    """What a method is checked against: the platform, the checkpoint's `quantization_config` (None for an
    unquantized checkpoint), the `quantization` the user asked for (None: the checkpoint's), the compute
    dtype, the checkpoint's whole config.json and the tensor-parallel size."""

    platform: Platform
    quant_config: dict[str, Any] | None
    requested: str | None
    dtype: torch.dtype
    hf_config: dict[str, Any] = field(default_factory=dict)
    tp_size: int = 1

    @property
    def quant_method(self) -> str | None:
        """The checkpoint's `quantization_config.quant_method`, lower-cased; None where it has none."""
        qc = self.quant_config
        return None if qc is None else str(qc.get("quant_method", "")).lower() or "?"

    @property
    def online(self) -> bool:
        """An unquantized checkpoint, to be quantized at load because `quantization` asks for it."""
        return self.quant_config is None and self.requested is not None


class LinearMethod:
    """How one linear layer holds and multiplies its weights. The unquantized layer needs none (None)."""

    def create_weights(self, layer: LinearLayer) -> None:
        """Replace layer.weight (a [out / tp, in] or [out, in / tp] parameter of the compute dtype) by this
        method's parameters, registered on the layer under the checkpoint's names (`weight`,
        `weight_scale`, ...), each with a `weight_loader(param, tensor[, shard_id])` as the layer's own."""

    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        """Check the loaded parameters (every scale filled, in range) and convert them to the form `apply`
        takes; raise turnout.errors.WeightLoadError naming the checkpoint tensor where one is wrong."""

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [N, in of this rank] (compute dtype) -> [N, out of this rank] (compute dtype), bias added."""
        raise NotImplementedError

    def apply_pending(
        self, layer: LinearLayer, x: PendingNorm | PendingSiluMul, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """`apply` for an input still to be computed: an RMSNorm (with its residual add, whose sum goes to
        x.residual_out) or a SiLU-and-mul deferred into this layer. The default materializes it and calls
        apply; a method may compute it fused with its own input quantization, writing x.residual_out."""
        return self.apply(layer, x.materialize(), bias)


class MoEMethod:
    """How one FusedMoE layer's experts load from a quantized checkpoint and compute. After loading either
    `w13_weight` [E, 2I, H] and `w2_weight` [E, H, I] (this rank's experts and shards) hold the compute
    dtype and layer.quant_method is None, so the layer's MoE kernel computes them; or the method keeps them
    quantized, layer.quant_method stays this method, and `apply` computes them. `notes` says which."""

    def create_weights(self, layer: FusedMoE) -> None:
        """Replace layer.w13_weight and layer.w2_weight by this method's parameters and register their
        scales (`w13_weight_scale`, `w2_weight_scale_inv`, ...), each with a
        `weight_loader(param, tensor, expert, shard)` that keeps this rank's part as FusedMoE.weight_loader
        does (shard 0 gate_proj, 1 up_proj, 2 down_proj) and returns False for another rank's expert."""

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        """Check the loaded parameters (every scale filled, positive; turnout.errors.WeightLoadError naming
        the checkpoint tensor where one is wrong), then either leave w13_weight and w2_weight in the compute
        dtype and set layer.quant_method to None, or convert them to the form `apply` takes."""

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [N, H] (compute dtype), topk_ids [N, k] (indices of this rank's experts) -> pair outputs
        [N * k, H] in the compute dtype, row n * k + j from expert topk_ids[n, j] (w2 silu-and-mul(w13 x), as
        turnout.layers.moe's kernels); called only where process_weights_after_loading kept
        layer.quant_method. It must not wait on the device (CUDA graphs capture it)."""
        raise NotImplementedError


class QuantizationMethod:
    """A quantization method a plugin offers, selected by the checkpoint's `quantization_config` or by
    `quantization = name` (vLLM's names: "fp8"). Subclasses set the class attributes and implement
    `linear_method` (and `moe_method` where `replaces` includes "moe"); `check` adds format validation to
    the platform checks here; `notes` says how the replaced layers compute."""

    name: str = ""
    priority: int = Priority.DEFAULT
    checkpoint_formats: tuple[str, ...] = ()  # quantization_config.quant_method values this reads
    online: bool = False  # quantizes an unquantized checkpoint at load
    devices: tuple[str, ...] = ("cuda", "cpu")
    min_capability: tuple[int, int] | None = None  # on CUDA
    replaces: frozenset[str] = frozenset({"linear"})  # of LAYER_KINDS

    def check(self, ctx: QuantizationContext) -> list[str]:
        """Every reason this method cannot serve ctx; empty if it can. The base checks the request (the
        checkpoint's format or `quantization`), the device and capability, and that the model has no
        layer kind the checkpoint quantizes that this method does not replace (fused MoE experts)."""
        why = []
        if ctx.quant_config is not None and ctx.quant_method not in self.checkpoint_formats:
            why.append(
                f"reads {', '.join(self.checkpoint_formats) or 'no'} checkpoints, not {ctx.quant_method}"
            )
        if ctx.quant_config is None and not (self.online and ctx.requested == self.name):
            why.append("not requested" if self.online else "quantizes no checkpoint at load")
        p = ctx.platform
        if p.device_type not in self.devices:
            why.append(f"needs device {' or '.join(self.devices)}, have {p.device_type}")
        elif p.is_cuda and self.min_capability and (p.capability or (0, 0)) < self.min_capability:
            have = "sm{}{}".format(*(p.capability or (0, 0)))
            why.append(
                f"needs compute capability sm{self.min_capability[0]}{self.min_capability[1]}+, have {have}"
            )
        if ctx.quant_config is not None and _has_experts(ctx.hf_config) and "moe" not in self.replaces:
            why.append("does not quantize fused MoE experts, which this checkpoint stores quantized")
        return why

    def notes(self, ctx: QuantizationContext) -> list[str]:
        """How each layer kind this method replaces computes on ctx's platform, one line each (what
        `turnout explain` prints under the method); a layer it dequantizes at load is named with the dtype
        it then runs in."""
        return []

    def kv_cache_scales(self, ctx: QuantizationContext) -> bool:
        """Whether ctx's checkpoint holds static per-tensor FP8 KV cache scales (a k_scale and a v_scale for
        every attention layer) that the KV cache must use; False (the default): it holds none."""
        return False

    def moe_method(self, ctx: QuantizationContext, prefix: str, projections: list[str]) -> MoEMethod | None:
        """The MoEMethod for the FusedMoE layer whose checkpoint tensors are `<prefix>.<expert>.<proj>.*`
        (projections: the checkpoint's names of shards 0, 1, 2, e.g. gate_proj, up_proj, down_proj); None
        leaves the experts unquantized. Only called where `replaces` includes "moe"."""
        return None

    def linear_method(self, ctx: QuantizationContext, checkpoint_names: list[str]) -> LinearMethod | None:
        """The LinearMethod for the linear layer whose checkpoint tensors are named checkpoint_names (the
        fused parts of one layer, e.g. `model.layers.0.self_attn.q_proj`, `.k_proj`, `.v_proj`); None leaves
        it unquantized (a module the checkpoint's ignore list names)."""
        raise NotImplementedError


def _has_experts(hf_config: dict[str, Any]) -> bool:
    return bool(num_experts(hf_config))


def linear_layers(model: nn.Module) -> Iterator[tuple[str, LinearLayer, list[str]]]:
    """Every tensor-parallel linear layer of model: (module name, layer, the checkpoint names of its parts).
    A fused layer's parts come from the model's `packed` map (checkpoint name -> (our name, shard)), as
    DecoderForCausalLM declares it; its module names are the checkpoint's, up to that map."""
    packed: dict[str, tuple[str, Any]] = getattr(model, "packed", {})
    for name, m in model.named_modules():
        if not isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            continue
        prefix, _, leaf = name.rpartition(".")
        parts = [f"{prefix}.{ckpt}" for ckpt, (ours, _) in packed.items() if ours == leaf]
        yield name, m, parts or [name]


def moe_layers(model: nn.Module) -> Iterator[tuple[str, FusedMoE, list[str]]]:
    """Every FusedMoE layer of model: (module name, layer, the checkpoint projection names of its shards 0,
    1 and 2, from the model's `expert_packed` map, as DecoderForCausalLM declares it)."""
    packed: dict[str, int] = getattr(model, "expert_packed", {})
    projections = [proj for proj, _ in sorted(packed.items(), key=lambda kv: kv[1])]
    for name, m in model.named_modules():
        if isinstance(m, FusedMoE):
            yield name, m, projections


KV_SCALES = ("k_scale", "v_scale")  # an Attention layer's FP8 KV cache scales, by vLLM's names
# llm-compressor's older names of the KV cache scales -> vLLM's, as vLLM maps them (get_cache_scale)
KV_SCALE_ALIASES = {".k_proj.output_scale": ".k_scale", ".v_proj.output_scale": ".v_scale"}


def kv_scale_name(name: str) -> str:
    """A checkpoint tensor's name with llm-compressor's KV cache scale names (`self_attn.k_proj.output_scale`)
    read as vLLM's (`self_attn.k_scale`); any other name unchanged."""
    for old, new in KV_SCALE_ALIASES.items():
        if name.endswith(old):
            return name.removesuffix(old) + new
    return name


def kv_cache_dtype_for(
    requested: str, method: QuantizationMethod | None, ctx: QuantizationContext
) -> tuple[str, str]:
    """The KV cache dtype (a kv_cache_dtype name) for a checkpoint served by method, and why, in words (""
    where nothing changes requested). A checkpoint with FP8 KV cache scales runs an FP8 cache where
    requested is auto (vLLM does the same: its Attention sets fp8 wherever the checkpoint has a
    kv_cache_scheme), and with requested fp8 the scales are the checkpoint's."""
    if method is None or not method.kv_cache_scales(ctx):
        return requested, ""
    scales = "per-layer k_scale / v_scale from the checkpoint"
    if requested == "auto":
        return "fp8", f"auto: the checkpoint's kv_cache_scheme asks for an FP8 cache, as in vLLM; {scales}"
    return requested, scales


def _kv_scale_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if loaded.numel() != 1:
        raise ValueError(
            f"a per-tensor KV cache scale is one number, not shape {list(loaded.shape)} (kv_cache_scheme "
            "strategy 'tensor')"
        )
    value = float(loaded.reshape(()).float())
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"a KV cache scale must be positive and finite, not {value:g}")
    param.data.fill_(value)


def add_kv_cache_scales(model: nn.Module) -> int:
    """Give every Attention layer of model its `k_scale` and `v_scale` parameters (NaN until loaded), each
    with a weight_loader that takes one positive finite number; returns how many layers took them."""
    n = 0
    for m in model.modules():
        if isinstance(m, Attention):
            for name in KV_SCALES:
                delattr(m, name)  # the float 1.0 gives way to the checkpoint's scale until loaded
                p = nn.Parameter(torch.full((), math.nan, dtype=torch.float32), requires_grad=False)
                p.weight_loader = _kv_scale_loader  # type: ignore[attr-defined]
                m.register_parameter(name, p)
            n += 1
    return n


def quantize_linears(model: nn.Module, method: QuantizationMethod, ctx: QuantizationContext) -> int:
    """Give every linear layer the method's LinearMethod, where the method replaces "moe" every FusedMoE
    layer its MoEMethod, and where the checkpoint holds KV cache scales (method.kv_cache_scales) every
    Attention layer its scale parameters (add_kv_cache_scales), all before the checkpoint loads; returns
    how many layers took one."""
    n = add_kv_cache_scales(model) if method.kv_cache_scales(ctx) else 0
    for _, layer, parts in linear_layers(model):
        if (lm := method.linear_method(ctx, parts)) is not None:
            layer.quant_method = lm
            lm.create_weights(layer)
            n += 1
    for name, moe, projections in moe_layers(model) if "moe" in method.replaces else ():
        if (mm := method.moe_method(ctx, name, projections)) is not None:
            moe.quant_method = mm
            mm.create_weights(moe)
            n += 1
    return n


def process_weights_after_loading(model: nn.Module) -> None:
    """Each quantized layer's process_weights_after_loading, once the checkpoint has loaded; an Attention
    layer's loaded k_scale / v_scale parameters become its float scales."""
    for path, m in model.named_modules():
        if isinstance(m, Attention) and isinstance(getattr(m, "k_scale", None), nn.Parameter):
            values = [float(getattr(m, name)) for name in KV_SCALES]
            if not all(v > 0 for v in values):  # NaN: a loader that never filled it
                raise WeightLoadError(
                    f"attention layer {path} got no FP8 KV cache scales (k_scale, v_scale) from the "
                    "checkpoint, which declares a kv_cache_scheme; re-download the model"
                )
            for name, value in zip(KV_SCALES, values):
                delattr(m, name)
                setattr(m, name, value)
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, FusedMoE)) and m.quant_method is not None:
            m.quant_method.process_weights_after_loading(m)


__all__ = [
    "ConfigError",
    "KNOWN_FORMATS",
    "KV_SCALES",
    "KV_SCALE_ALIASES",
    "LAYER_KINDS",
    "LinearLayer",
    "LinearMethod",
    "MoEMethod",
    "QuantizationContext",
    "QuantizationMethod",
    "add_kv_cache_scales",
    "kv_cache_dtype_for",
    "kv_scale_name",
    "linear_layers",
    "moe_layers",
    "process_weights_after_loading",
    "quantize_linears",
    "WeightLoadError",
]
