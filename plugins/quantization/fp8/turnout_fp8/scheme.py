"""What an FP8 checkpoint's quantization_config says: one Scheme, or a ConfigError naming the field."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from turnout.quantization import ConfigError, QuantizationContext


@dataclass(frozen=True)
class Scheme:
    """weight: "tensor" (one scale a tensor), "channel" (one a row), "block" (one a bn x bk tile) or "none"
    (a checkpoint that quantizes only its KV cache: no layer is replaced);
    activation: "token" (dynamic, one scale a row), "group" (dynamic, one a 1 x bk group) or "static" (the
    checkpoint's input_scale); scale_name: the checkpoint's name of the weight scale; ignore: the modules
    left unquantized (names, or "re:" patterns); online: the checkpoint is not quantized, the weights are
    quantized at load (per channel); kv_cache: the checkpoint holds static per-tensor FP8 KV cache scales
    (compressed-tensors' kv_cache_scheme), one k_scale and one v_scale a layer."""

    weight: str
    activation: str
    scale_name: str = "weight_scale"
    block: tuple[int, int] | None = None
    ignore: tuple[str, ...] = ()
    online: bool = False
    kv_cache: bool = False

    def ignores(self, name: str) -> bool:
        """Whether module `name` (a checkpoint name, e.g. model.layers.0.mlp.gate_proj) stays unquantized."""
        for ig in self.ignore:
            if ig.startswith("re:"):
                if re.fullmatch(ig[3:], name):
                    return True
            elif name == ig or name.endswith("." + ig) or name.startswith(ig + "."):
                return True
        return False


ONLINE = Scheme("channel", "token", online=True)


def parse(ctx: QuantizationContext) -> Scheme:
    """The checkpoint's scheme (ONLINE for an unquantized one); ConfigError with one line where the
    quantization_config is malformed or asks for something FP8 here does not serve."""
    qc = ctx.quant_config
    if qc is None:
        return ONLINE
    if ctx.quant_method == "fp8":
        return _hf_fp8(qc)
    if ctx.quant_method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ConfigError(f"quant_method '{ctx.quant_method}' is not an FP8 format")


def _hf_fp8(qc: dict[str, Any]) -> Scheme:
    where = "quantization_config"
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"{where}.fmt is {qc['fmt']!r}; only e4m3 FP8 weights are served")
    act = qc.get("activation_scheme", "dynamic")
    if act not in ("dynamic", "static"):
        raise ConfigError(f"{where}.activation_scheme is {act!r}; expected 'dynamic' or 'static'")
    ignore = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
    block = qc.get("weight_block_size")
    if block is None:
        return Scheme("tensor", "token" if act == "dynamic" else "static", ignore=ignore)
    block = _block(block, f"{where}.weight_block_size")
    if act != "dynamic":
        raise ConfigError(f"{where}: block-scaled weights need activation_scheme 'dynamic', not {act!r}")
    return Scheme("block", "group", "weight_scale_inv", block, ignore)


def _block(value: Any, where: str) -> tuple[int, int]:
    ok = isinstance(value, (list, tuple)) and len(value) == 2
    if not ok or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        raise ConfigError(f"{where} is {value!r}; expected two positive integers, e.g. [128, 128]")
    return int(value[0]), int(value[1])


def _compressed_tensors(qc: dict[str, Any]) -> Scheme:
    where = "quantization_config"
    kv_cache = _kv_cache_scheme(qc.get("kv_cache_scheme"), f"{where}.kv_cache_scheme")
    groups = qc.get("config_groups")
    if kv_cache and not groups:  # the KV cache alone is quantized; the weights are as they are
        return Scheme("none", "none", kv_cache=True)
    fmt = qc.get("format", "float-quantized")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ConfigError(f"{where}.format is {fmt!r}; FP8 here reads 'float-quantized' checkpoints")
    if not isinstance(groups, dict) or len(groups) != 1:
        n = len(groups) if isinstance(groups, dict) else 0
        raise ConfigError(f"{where}.config_groups has {n} groups; FP8 here serves exactly one")
    ((name, group),) = groups.items()
    where = f"{where}.config_groups.{name}"
    if "Linear" not in (group.get("targets") or []):
        raise ConfigError(f"{where}.targets is {group.get('targets')!r}; FP8 here quantizes 'Linear' layers")
    w = group.get("weights") or {}
    _fp8_args(w, f"{where}.weights")
    strategy = w.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise ConfigError(f"{where}.weights.strategy is {strategy!r}; expected tensor, channel or block")
    a = group.get("input_activations")
    if a is None:
        raise ConfigError(f"{where}.input_activations is null: weight-only FP8 is not served")
    _fp8_args(a, f"{where}.input_activations")
    block = (
        _block(w.get("block_structure"), f"{where}.weights.block_structure") if strategy == "block" else None
    )
    act = {(True, "token"): "token", (True, "group"): "group", (False, "tensor"): "static"}.get(
        (bool(a.get("dynamic")), a.get("strategy"))
    )
    if act is None or (strategy == "block") != (act == "group"):
        raise ConfigError(
            f"{where}: weights {strategy} with input_activations {a.get('strategy')} "
            f"(dynamic={bool(a.get('dynamic'))}) is not an FP8 scheme served here"
        )
    if act == "group" and block and a.get("group_size") not in (None, block[1]):
        raise ConfigError(f"{where}.input_activations.group_size must equal block_structure's {block[1]}")
    return Scheme(strategy, act, "weight_scale", block, tuple(qc.get("ignore") or ()), kv_cache=kv_cache)


def _kv_cache_scheme(kv: Any, where: str) -> bool:
    """Whether the checkpoint holds FP8 KV cache scales: a kv_cache_scheme of 8-bit float, symmetric,
    static, one scale a tensor (vLLM's per-tensor FP8 KV cache); None or {} holds none."""
    if not kv:
        return False
    if not isinstance(kv, dict):
        raise ConfigError(f"{where} is {kv!r}; expected an object such as compressed-tensors writes")
    _fp8_args(kv, where)
    if kv.get("dynamic"):
        raise ConfigError(f"{where}.dynamic is true; the FP8 KV cache here reads static checkpoint scales")
    if kv.get("strategy", "tensor") != "tensor":
        raise ConfigError(
            f"{where}.strategy is {kv.get('strategy')!r}; the FP8 KV cache here reads one k_scale and one "
            "v_scale a layer (strategy 'tensor')"
        )
    return True


def _fp8_args(args: dict[str, Any], where: str) -> None:
    if args.get("num_bits") != 8 or args.get("type") != "float":
        raise ConfigError(
            f"{where} is {args.get('num_bits')}-bit {args.get('type')}; this method serves 8-bit float (FP8)"
        )
    if args.get("symmetric") is False:
        raise ConfigError(f"{where}.symmetric is false; FP8 here serves symmetric scales only")
