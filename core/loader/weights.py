import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from turnout.errors import WeightLoadError


def one_line(err: BaseException) -> str:
    """The error's message on one line, runs of whitespace and newlines as single spaces."""
    return " ".join(str(err).split())


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
    for path in weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise WeightLoadError(
                f"corrupt weight file {path}: {one_line(e)}; re-download or re-convert it"
            ) from None
