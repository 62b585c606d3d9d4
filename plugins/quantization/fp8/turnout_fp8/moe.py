"""Fused MoE experts stored in FP8: their parameters, their loading across tensor- and expert-parallel
shards, and what follows loading: on CUDA they stay FP8 and turnout_fp8.moe_kernels computes them
(dequantizing each weight tile in the kernel) where it takes their scales; otherwise, and on the CPU, they
are dequantized to the compute dtype and the layer's MoE kernel computes them (Fp8Method.notes says
which)."""

from __future__ import annotations

import math

import torch
from torch import nn

from turnout.layers import FusedMoE, expert_outputs_triton
from turnout.quantization import ConfigError, MoEMethod, WeightLoadError
from turnout_fp8.method import dequantize
from turnout_fp8.scheme import Scheme

FP8 = torch.float8_e4m3fn


def kernel_fits(block: tuple[int, int] | None, rows_per_part: int) -> bool:
    """Whether the grouped GEMM takes these expert scales: per-row scales always; blocks where bk is a power
    of two of at least 16 (a K tile must lie in one block column) and each of w13's two parts (gate, up:
    rows_per_part rows) starts on a block row."""
    if block is None:
        return True
    bn, bk = block
    return bk >= 16 and bk & (bk - 1) == 0 and rows_per_part % bn == 0


def _param(data: torch.Tensor, loader) -> nn.Parameter:
    p = nn.Parameter(data, requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


class Fp8MoEMethod(MoEMethod):
    """One FusedMoE layer's experts in FP8. E: the experts this rank holds; I: this rank's share of
    moe_intermediate_size; shards 0, 1, 2: gate_proj, up_proj (w13's first and second I rows), down_proj
    (w2). Parameters: w13_weight [E, 2I, H] and w2_weight [E, H, I] e4m3; the weight scales, float32,
    block: w13_weight_scale_inv [E, 2, ceil(I / bn), ceil(H / bk)] and w2_weight_scale_inv
    [E, ceil(H / bn), ceil(I / bk)], tensor and channel: w13_weight_scale [E, 2I] and w2_weight_scale [E, H]
    (one a row; a tensor's scale fills its part's rows); static activations: w13_input_scale [E, 2] and
    w2_input_scale [E, 1], checked and dropped, as the experts compute in the compute dtype. Scales start as
    NaN, so one the checkpoint never filled is found after loading."""

    def __init__(self, scheme: Scheme, prefix: str, projections: list[str], cuda: bool = False) -> None:
        self.scheme, self.prefix, self.projections, self.cuda = scheme, prefix, projections, cuda

    def _name(self, expert: int, shard: int, suffix: str) -> str:
        return f"{self.prefix}.{expert}.{self.projections[shard]}.{suffix}"

    # ---- parameters and loading ----
    def create_weights(self, layer: FusedMoE) -> None:
        """The FP8 expert weights, their scales and (static activations) their input scales."""
        s = self.scheme
        self.dtype = layer.w13_weight.dtype  # the compute dtype the layer was built in
        e, h, i = layer.w2_weight.shape
        dev = layer.w13_weight.device
        layer.w13_weight = _param(torch.empty(e, 2 * i, h, dtype=FP8, device=dev), self._weight_loader(layer))
        layer.w2_weight = _param(torch.empty(e, h, i, dtype=FP8, device=dev), self._weight_loader(layer))
        if s.block:
            self._check_blocks(layer, i)
            bn, bk = s.block
            w13 = (e, 2, math.ceil(i / bn), math.ceil(h / bk))
            w2: tuple[int, ...] = (e, math.ceil(h / bn), math.ceil(i / bk))
        else:
            w13, w2 = (e, 2 * i), (e, h)
        for kind, shape in (("w13", w13), ("w2", w2)):
            scale = torch.full(shape, math.nan, device=dev)
            layer.register_parameter(f"{kind}_{s.scale_name}", _param(scale, self._scale_loader(layer)))
        if s.activation == "static":
            for kind, parts in (("w13", 2), ("w2", 1)):
                scale = torch.full((e, parts), math.nan, device=dev)
                layer.register_parameter(
                    f"{kind}_input_scale", _param(scale, self._input_scale_loader(layer))
                )

    def _check_blocks(self, layer: FusedMoE, i: int) -> None:
        """Under TP each rank's rows of w13 and columns of w2 must start and end on a block."""
        bn, bk = self.scheme.block  # type: ignore[misc]
        if layer.tp_size > 1 and (i % bn or i % bk):
            raise ConfigError(
                f"quantization_config's block size [{bn}, {bk}] does not divide {self.prefix}'s {i} "
                f"intermediate rows a rank (moe_intermediate_size {i * layer.tp_size} over {layer.tp_size} "
                "TP ranks); use another TP size or enable_expert_parallel"
            )

    def _expect(self, loaded: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
        if tuple(loaded.shape) != shape:
            raise WeightLoadError(
                f"checkpoint tensor {name} has shape {tuple(loaded.shape)}, expected {shape} for its "
                "quantization_config; the checkpoint does not match its config.json"
            )

    def _weight_loader(self, layer: FusedMoE):
        def load(param: nn.Parameter, loaded: torch.Tensor, expert: int, shard: int) -> bool:
            if loaded.dtype != FP8:
                raise WeightLoadError(
                    f"checkpoint tensor {self._name(expert, shard, 'weight')} is "
                    f"{str(loaded.dtype).removeprefix('torch.')}, but quantization_config says FP8 "
                    "(float8_e4m3fn); the checkpoint does not match it"
                )
            return layer.weight_loader(param, loaded, expert, shard)

        return load

    def _scale_loader(self, layer: FusedMoE):
        s = self.scheme

        def load(param: nn.Parameter, loaded: torch.Tensor, expert: int, shard: int) -> bool:
            if expert not in layer.local_experts:
                return False
            name, dst = (
                self._name(expert, shard, s.scale_name),
                param.data[expert - layer.local_experts.start],
            )
            h, i = layer.w2_weight.shape[1:]
            rows, cols = (i * layer.tp_size, h) if shard < 2 else (h, i * layer.tp_size)  # the checkpoint's
            loaded = loaded.float()
            if s.block:
                bn, bk = s.block
                self._expect(loaded, (math.ceil(rows / bn), math.ceil(cols / bk)), name)
                if shard < 2:  # this rank's rows
                    dst[shard].copy_(loaded.narrow(0, layer.tp_rank * i // bn, dst.shape[1]))
                else:  # this rank's columns
                    dst.copy_(loaded.narrow(1, layer.tp_rank * i // bk, dst.shape[1]))
                return True
            part = dst if shard == 2 else dst.narrow(0, shard * i, i)
            if s.weight == "tensor":
                if loaded.numel() != 1:
                    self._expect(loaded, (1,), name)
                part.fill_(loaded.reshape(()).item())
                return True
            if loaded.dim() == 2 and loaded.shape[1] == 1:
                loaded = loaded[:, 0]
            self._expect(loaded, (rows,), name)
            part.copy_(loaded if shard == 2 else loaded.narrow(0, layer.tp_rank * i, i))
            return True

        return load

    def _input_scale_loader(self, layer: FusedMoE):
        def load(param: nn.Parameter, loaded: torch.Tensor, expert: int, shard: int) -> bool:
            if expert not in layer.local_experts:
                return False
            if loaded.numel() != 1:
                self._expect(loaded, (1,), self._name(expert, shard, "input_scale"))
            param.data[expert - layer.local_experts.start, shard % 2] = loaded.reshape(()).float()
            return True

        return load

    # ---- after loading ----
    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        """Every scale filled and positive. On CUDA, where the grouped GEMM takes the scales (kernel_fits),
        the weights stay FP8 and the scales move into the kernel's layout (w13: [E, 2I] per row or
        [E, 2I / bn, ceil(H / bk)] per block; w2: [E, H] or [E, ceil(H / bn), ceil(I / bk)]); otherwise
        w13_weight and w2_weight become q * scale in the compute dtype, expert by expert, and the layer
        computes as an unquantized one. The parameters holding scales are dropped either way."""
        s = self.scheme
        w13_scale = getattr(layer, f"w13_{s.scale_name}").data
        w2_scale = getattr(layer, f"w2_{s.scale_name}").data
        self._check_filled(layer, w13_scale, "w13", s.scale_name)
        self._check_filled(layer, w2_scale, "w2", s.scale_name)
        names = [f"w13_{s.scale_name}", f"w2_{s.scale_name}"]
        if s.activation == "static":
            self._check_filled(layer, layer.w13_input_scale.data, "w13", "input_scale")
            self._check_filled(layer, layer.w2_input_scale.data, "w2", "input_scale")
            names += ["w13_input_scale", "w2_input_scale"]
        i = layer.w2_weight.shape[2]
        if self.cuda and kernel_fits(s.block, i):
            e = w13_scale.shape[0]
            self.w13_scale = (
                w13_scale.reshape(e, -1, w13_scale.shape[-1]) if s.block else w13_scale
            ).contiguous()
            self.w2_scale = w2_scale.contiguous()
            for name in names:
                delattr(layer, name)
            return
        w13 = torch.empty(layer.w13_weight.shape, dtype=self.dtype, device=w13_scale.device)
        w2 = torch.empty(layer.w2_weight.shape, dtype=self.dtype, device=w2_scale.device)
        for j in range(w13.shape[0]):
            for part in (0, 1):
                q = layer.w13_weight.data[j, part * i : (part + 1) * i]
                sc = w13_scale[j, part] if s.block else w13_scale[j, part * i : (part + 1) * i]
                w13[j, part * i : (part + 1) * i] = dequantize(q, sc, s.block)
            w2[j] = dequantize(layer.w2_weight.data[j], w2_scale[j], s.block)
        for name in names:
            delattr(layer, name)
        layer.w13_weight = nn.Parameter(w13, requires_grad=False)
        layer.w2_weight = nn.Parameter(w2, requires_grad=False)
        layer.quant_method = None

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts of topk_ids on x through the Triton grouped GEMM on the FP8 weights (CUDA)."""
        scales = (self.w13_scale, self.w2_scale, self.scheme.block)
        return expert_outputs_triton(x, layer.w13_weight, layer.w2_weight, topk_ids, scales)

    def _check_filled(self, layer: FusedMoE, t: torch.Tensor, kind: str, suffix: str) -> None:
        bad = ~(t > 0)  # NaN (never loaded), zero or negative
        if not bool(bad.any()):
            return
        where = bad.nonzero()[0].tolist()  # [expert, part (block and input scales) or row, ...]
        per_row = not self.scheme.block and suffix != "input_scale"
        shard = 2 if kind == "w2" else where[1] // layer.w2_weight.shape[2] if per_row else where[1]
        what = "lacks" if bool(torch.isnan(t).any()) else "has a zero or negative"
        raise WeightLoadError(
            f"the checkpoint {what} {self._name(layer.local_experts.start + where[0], shard, suffix)}; "
            "re-download the model or fix its quantization_config"
        )
