"""The fp8 QuantizationMethod and its LinearMethod: FP8 parameters, their loading across tensor-parallel
shards, and the conversion after loading (kept in FP8 on CUDA, dequantized on the CPU). Fused MoE experts
(turnout_fp8.moe) stay in FP8 on CUDA (the core's Triton grouped GEMM) and are dequantized at load on the
CPU."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from turnout.layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear, num_experts
from turnout.quantization import (
    ConfigError,
    LinearLayer,
    LinearMethod,
    MoEMethod,
    QuantizationContext,
    QuantizationMethod,
    WeightLoadError,
)
from turnout_fp8 import scheme as schemes
from turnout_fp8.scheme import Scheme

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


class Fp8Method(QuantizationMethod):
    """FP8 e4m3 weights (see the package docstring for the formats)."""

    name = "fp8"
    checkpoint_formats = ("fp8", "compressed-tensors")
    online = True
    min_capability = (8, 9)  # FP8 tensor cores: Ada and Hopper
    replaces = frozenset({"linear", "moe"})

    def check(self, ctx: QuantizationContext) -> list[str]:
        """The base checks, and the quantization_config's fields (one reason naming a malformed one)."""
        why = super().check(ctx)
        try:
            s = schemes.parse(ctx)
        except ConfigError as e:
            return [*why, str(e)]
        if s.kv_cache and ctx.hf_config.get("kv_lora_rank"):
            why.append(
                "quantization_config.kv_cache_scheme: multi-head latent attention's latent KV cache runs in "
                "the model dtype only, not FP8; remove kv_cache_scheme"
            )
        return why

    def kv_cache_scales(self, ctx: QuantizationContext) -> bool:
        """A compressed-tensors checkpoint with a kv_cache_scheme (static, per-tensor FP8)."""
        return schemes.parse(ctx).kv_cache

    def notes(self, ctx: QuantizationContext) -> list[str]:
        """Where the weights stay in FP8 and where they are dequantized to the compute dtype at load."""
        s, dtype = schemes.parse(ctx), str(ctx.dtype).removeprefix("torch.")
        if s.weight == "none":
            return [
                "weights: not quantized (the checkpoint's quantization_config quantizes its KV cache only)",
                "KV cache: FP8 e4m3 with the checkpoint's per-layer k_scale / v_scale",
            ]
        if ctx.platform.is_cuda:
            where = (
                "a kernel of its own (static activation scales)"
                if s.activation == "static"
                else "the kernel quantizing its input (at one row, a kernel of its own before the GEMV)"
            )
            notes = [
                "linear layers: FP8 weights, FP8 GEMMs (decode: a GEMV that reads the FP8 weights); the norm "
                f"or SiLU-and-mul before each runs in {where}"
            ]
        else:
            notes = [
                f"linear layers: dequantized to {dtype} at load (no FP8 kernels on the CPU); run in {dtype}"
            ]
        if num_experts(ctx.hf_config) and s.online:
            notes.append(
                f"fused MoE experts: not quantized (online FP8 covers linear layers); run in {dtype}"
            )
        elif num_experts(ctx.hf_config) and ctx.platform.is_cuda and _moe_kernel_fits(s, ctx):
            notes.append(
                "fused MoE experts: FP8 weights, a Triton grouped GEMM that dequantizes each weight tile in "
                f"the kernel; activations in {dtype}"
            )
        elif num_experts(ctx.hf_config):
            why = (
                "no FP8 MoE kernel on the CPU" if not ctx.platform.is_cuda else "its block size does not tile"
            )
            notes.append(
                f"fused MoE experts: dequantized to {dtype} at load ({why}); run in {dtype}, "
                f"with {dtype}'s weight memory"
            )
        if s.kv_cache:
            notes.append("KV cache: FP8 e4m3 with the checkpoint's per-layer k_scale / v_scale")
        return notes

    def linear_method(self, ctx: QuantizationContext, checkpoint_names: list[str]) -> LinearMethod | None:
        """An Fp8LinearMethod, or None for a layer the checkpoint's ignore list names (all of its parts)."""
        s = schemes.parse(ctx)
        if s.weight == "none" or not _quantized(s, checkpoint_names):
            return None
        return Fp8LinearMethod(s, checkpoint_names, ctx.platform.is_cuda)

    def moe_method(self, ctx: QuantizationContext, prefix: str, projections: list[str]) -> MoEMethod | None:
        """An Fp8MoEMethod for a checkpoint that stores its experts in FP8; None where online quantization
        runs (the experts would compute in the compute dtype all the same) or the ignore list names them."""
        s = schemes.parse(ctx)
        names = [f"{prefix}.{e}.{proj}" for e in range(num_experts(ctx.hf_config)) for proj in projections]
        if s.online or s.weight == "none" or not _quantized(s, names):
            return None
        from turnout_fp8.moe import Fp8MoEMethod

        return Fp8MoEMethod(s, prefix, projections, ctx.platform.is_cuda)


def _moe_kernel_fits(s: Scheme, ctx: QuantizationContext) -> bool:
    """Whether the grouped GEMM takes the experts' scales at this TP size's intermediate rows."""
    from turnout_fp8.moe import kernel_fits

    rows = (ctx.hf_config.get("moe_intermediate_size") or 0) // max(ctx.tp_size, 1)
    return kernel_fits(s.block, rows)


def _quantized(s: Scheme, names: list[str]) -> bool:
    """Whether the checkpoint quantizes the layer whose parts are names: all of them, or (its ignore list
    names them all) none; a layer with some parts ignored is a ConfigError."""
    ignored = [s.ignores(n) for n in names]
    if any(ignored) and not all(ignored):
        raise ConfigError(
            f"quantization_config leaves some parts of one fused layer unquantized "
            f"({', '.join(n for n, i in zip(names, ignored) if i)}); fused parts must agree"
        )
    return not all(ignored)


def shard_ids(layer: LinearLayer) -> list[Any]:
    """The checkpoint parts a layer is fused from, as its weight_loader names them."""
    if isinstance(layer, QKVParallelLinear):
        return ["q", "k", "v"]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(range(len(layer.output_sizes)))
    return [None]


def full_rows(layer: LinearLayer, shard: Any) -> int:
    """Rows of checkpoint part `shard`'s whole tensor (all ranks)."""
    if isinstance(layer, RowParallelLinear):
        return layer.weight.shape[0]
    if isinstance(layer, QKVParallelLinear) and shard != "q":
        return layer.num_kv_heads * layer.head_size * layer.tp_size // layer.kv_replicas
    return layer.shard_rows(shard)[1] * layer.tp_size


def full_cols(layer: LinearLayer) -> int:
    """Columns of the checkpoint's whole weight (all ranks)."""
    return layer.weight.shape[1] * (layer.tp_size if isinstance(layer, RowParallelLinear) else 1)


def _param(data: torch.Tensor, loader) -> nn.Parameter:
    p = nn.Parameter(data, requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


class Fp8LinearMethod(LinearMethod):
    """One linear layer in FP8. Parameters (checkpoint names): `weight` [N, K] e4m3; the weight scale,
    float32, [N] for tensor and channel scales (a tensor's scale fills its part's rows) or
    [N / bn, K / bk] for block scales (`weight_scale_inv` in HF's format); `input_scale` [parts] for static
    activations. N, K: this rank's rows and columns. Scales start as NaN, so one the checkpoint never
    filled is found after loading."""

    def __init__(self, scheme: Scheme, names: list[str], cuda: bool) -> None:
        self.scheme, self.names, self.cuda = scheme, names, cuda

    # ---- parameters and loading ----
    def create_weights(self, layer: LinearLayer) -> None:
        """The FP8 weight, its scale and (static activations) the input scales; online: the layer keeps its
        weight of the compute dtype until process_weights_after_loading."""
        self.parts = dict(zip(shard_ids(layer), self.names))
        self.dtype = layer.weight.dtype  # the compute dtype the layer was built in
        if self.scheme.online:
            return
        n, k = layer.weight.shape
        dev = layer.weight.device
        layer.weight = _param(torch.empty(n, k, dtype=FP8, device=dev), self._weight_loader(layer))
        if self.scheme.block:
            self._check_blocks(layer)
            bn, bk = self.scheme.block
            scale = torch.full((math.ceil(n / bn), math.ceil(k / bk)), math.nan, device=dev)
        else:
            scale = torch.full((n,), math.nan, device=dev)
        layer.register_parameter(self.scheme.scale_name, _param(scale, self._scale_loader(layer)))
        if self.scheme.activation == "static":
            s = torch.full((len(self.parts),), math.nan, device=dev)
            layer.register_parameter("input_scale", _param(s, self._input_scale_loader()))

    def _check_blocks(self, layer: LinearLayer) -> None:
        bn, bk = self.scheme.block  # type: ignore[misc]
        what = f"quantization_config's block size [{bn}, {bk}]"
        if isinstance(layer, RowParallelLinear):
            start, n = layer.shard_cols()
            if start % bk or n % bk:
                raise ConfigError(
                    f"{what} does not divide {self.names[0]}'s {n} columns a rank; use another TP size"
                )
            return
        if layer.weight.shape[1] % bk:
            raise ConfigError(f"{what} does not divide {self.names[0]}'s {layer.weight.shape[1]} columns")
        for shard, name in self.parts.items():
            offset, size, start = layer.shard_rows(shard)
            if offset % bn or size % bn or start % bn:
                raise ConfigError(f"{what} does not divide {name}'s {size} rows a rank; use another TP size")

    def _where(self, shard: Any, suffix: str) -> str:
        return f"checkpoint tensor {self.parts.get(shard, self.names[0])}.{suffix}"

    def _expect(self, loaded: torch.Tensor, shape: tuple[int, ...], shard: Any, suffix: str) -> None:
        if tuple(loaded.shape) != shape:
            raise WeightLoadError(
                f"{self._where(shard, suffix)} has shape {tuple(loaded.shape)}, expected {shape} for "
                "its quantization_config; the checkpoint does not match its config.json"
            )

    def _weight_loader(self, layer: LinearLayer):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard: Any = None) -> None:
            if loaded.dtype != FP8:
                raise WeightLoadError(
                    f"{self._where(shard, 'weight')} is {str(loaded.dtype).removeprefix('torch.')}, but "
                    "quantization_config says FP8 (float8_e4m3fn); the checkpoint does not match it"
                )
            self._expect(loaded, (full_rows(layer, shard), full_cols(layer)), shard, "weight")
            self._call_layer_loader(layer, param, loaded, shard)

        return load

    @staticmethod
    def _call_layer_loader(layer: LinearLayer, param: nn.Parameter, loaded: torch.Tensor, shard: Any) -> None:
        if isinstance(layer, RowParallelLinear):
            layer.weight_loader(param, loaded)
        else:
            layer.weight_loader(param, loaded, shard)

    def _scale_loader(self, layer: LinearLayer):
        s = self.scheme

        def load(param: nn.Parameter, loaded: torch.Tensor, shard: Any = None) -> None:
            loaded = loaded.float()
            rows = full_rows(layer, shard)
            if s.block:
                bn, bk = s.block
                shape = (math.ceil(rows / bn), math.ceil(full_cols(layer) / bk))
                self._expect(loaded, shape, shard, s.scale_name)
                if isinstance(layer, RowParallelLinear):
                    start, n = layer.shard_cols()
                    param.data.copy_(loaded.narrow(1, start // bk, math.ceil(n / bk)))
                else:
                    offset, size, start = layer.shard_rows(shard)
                    dst = param.data.narrow(0, offset // bn, math.ceil(size / bn))
                    dst.copy_(loaded.narrow(0, start // bn, dst.shape[0]))
                return
            if s.weight == "tensor":
                if loaded.numel() != 1:
                    self._expect(loaded, (1,), shard, s.scale_name)
                dst = param.data
                if not isinstance(layer, RowParallelLinear):
                    offset, size, _ = layer.shard_rows(shard)
                    dst = dst.narrow(0, offset, size)
                dst.fill_(loaded.reshape(()).item())
                return
            if loaded.dim() == 2 and loaded.shape[1] == 1:
                loaded = loaded[:, 0]
            self._expect(loaded, (rows,), shard, s.scale_name)
            if isinstance(layer, RowParallelLinear):
                param.data.copy_(loaded)
            else:
                layer.weight_loader(param, loaded, shard)

        return load

    def _input_scale_loader(self):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard: Any = None) -> None:
            if loaded.numel() != 1:
                self._expect(loaded, (1,), shard, "input_scale")
            param.data[list(self.parts).index(shard)] = loaded.reshape(()).float()

        return load

    # ---- after loading ----
    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        """Online: quantize the loaded weight per channel. Then every scale must be filled and positive; on
        CUDA the layer keeps FP8 weights and float32 scales, on the CPU its weight becomes q * scale in the
        compute dtype and the layer computes as an unquantized one."""
        s = self.scheme
        if s.online:
            w = layer.weight.data
            scale = w.float().abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
            q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        else:
            q = layer.weight.data
            scale = getattr(layer, s.scale_name).data
            self._check_filled(layer, scale, s.scale_name)
        input_scale = None
        if s.activation == "static":
            self._check_filled(layer, layer.input_scale.data, "input_scale")
            input_scale = layer.input_scale.data.max().reshape(1, 1)
            del layer.input_scale
        if not s.online:
            delattr(layer, s.scale_name)
        if not self.cuda:
            layer.weight = nn.Parameter(dequantize(q, scale, s.block).to(self.dtype), requires_grad=False)
            layer.quant_method = None
            return
        layer.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale, self.input_scale = scale.contiguous(), input_scale
        if s.block is not None:
            from turnout_fp8 import kernels

            kernels.cublas_block_scaling(q.device.index or 0)  # asked here, outside any graph capture

    def _check_filled(self, layer: LinearLayer, t: torch.Tensor, suffix: str) -> None:
        bad = ~(t > 0)  # NaN (never loaded), zero or negative
        if not bool(bad.any()):
            return
        shard = next(iter(self.parts))
        if not isinstance(layer, RowParallelLinear) and t.dim() >= 1 and suffix != "input_scale":
            b = self.scheme.block[0] if self.scheme.block else 1
            row = int(bad.nonzero()[0, 0]) * b
            shard = [sh for sh in self.parts if layer.shard_rows(sh)[0] <= row][-1]
        elif suffix == "input_scale":
            shard = list(self.parts)[int(bad.nonzero()[0, 0])]
        nan = bool(torch.isnan(t).any())
        what = "lacks" if nan else "has a zero or negative"
        raise WeightLoadError(
            f"the checkpoint {what} {self._where(shard, suffix).removeprefix('checkpoint tensor ')}; "
            "re-download the model or fix its quantization_config"
        )

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [N, K] -> [N, out] through the FP8 kernels (CUDA only: the CPU computes dequantized). As
        apply_pending, x may be a PendingNorm or PendingSiluMul, which the activation quant computes."""
        from turnout_fp8 import kernels

        s = self.scheme
        return kernels.fp8_linear(x, layer.weight, self.weight_scale, s.block, self.input_scale, bias)

    apply_pending = apply


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """q [N, K] e4m3 and its float32 scale ([N], or [ceil(N / bn), ceil(K / bk)]) -> float32 q * scale."""
    if block is None:
        return q.float() * scale[:, None]
    bn, bk = block
    n, k = q.shape
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return q.float() * full
