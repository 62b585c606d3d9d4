"""Checkpoint files: which ones a model folder holds, their tensors, and loading them into a model."""

import json
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from turnout.errors import WeightLoadError, one_line

_kept: dict[Hashable, dict[str, torch.Tensor]] | None = None  # by checkpoint key, while reuse_weights is on


def _index_shards(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise WeightLoadError(
            f"unreadable weight index {index}: {one_line(e)}; re-download it or remove it"
        ) from None
    shards = [index.parent / name for name in sorted(set(weight_map.values()))]
    for shard in shards:
        if not shard.is_file():
            raise WeightLoadError(f"shard {shard} named in {index.name} is missing; re-download the model")
    return shards


def weight_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise WeightLoadError(
            f"model directory {model_dir} does not exist; pass a folder holding *.safetensors"
        )
    if (single := model_dir / "model.safetensors").is_file():
        return [single]
    if (index := model_dir / "model.safetensors.index.json").is_file():
        return _index_shards(index)
    if files := sorted(model_dir.glob("*.safetensors")):
        return files
    raise WeightLoadError(
        f"no weight files (*.safetensors) in {model_dir}; download or convert the model into it"
    )


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors; a GGUF's cached folder takes them from its GGUF, dequantized as read."""
    from turnout.loader.gguf import gguf_weights

    if (tensors := gguf_weights(model_dir)) is not None:
        yield from tensors
        return
    for path in weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise WeightLoadError(
                f"corrupt weight file {path}: {one_line(e)}; re-download or re-convert it"
            ) from None


@contextmanager
def reuse_weights() -> Iterator[None]:
    """Within this block, a model loaded in this process under a key already loaded here takes that
    model's parameter tensors instead of reading its files again, so its engines share one copy of the
    weights (inference never writes them). turnout tune's candidates differ in attention, graphs and
    scheduling alone. Nested blocks share the outer one's weights; leaving the outermost drops them."""
    global _kept
    outer = _kept
    _kept = {} if outer is None else outer
    try:
        yield
    finally:
        _kept = outer


def kept_bytes() -> int:
    """Bytes of the weights reuse_weights holds now (0 outside it): shared, not any one engine's."""
    tensors = {t.data_ptr(): t for params in (_kept or {}).values() for t in params.values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def load_checkpoint(model: nn.Module, model_dir: str | Path, key: Hashable) -> set[str]:
    """Fill model's parameters from the checkpoint in model_dir through its load_weights; returns the
    names loaded. key names everything the loaded tensors depend on (the files, the model class, dtype,
    device, parallel rank): within reuse_weights a model whose key was loaded before takes those tensors."""
    if _kept is not None and (params := _kept.get(key)) is not None:
        for name, p in model.named_parameters(remove_duplicate=False):
            if name in params:
                p.data = params[name]
        return set(params)
    loaded = model.load_weights(iter_safetensors(model_dir))  # type: ignore[operator]
    if _kept is not None:
        named = model.named_parameters(remove_duplicate=False)
        _kept[key] = {n: p.data for n, p in named if n in loaded}
    return loaded
