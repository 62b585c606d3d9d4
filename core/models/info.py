"""What the core needs to know of a checkpoint before choosing anything: read from config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from turnout.errors import TurnoutError
from turnout.platform import Platform

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    hf_config: dict[str, Any]

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelInfo:
        path = Path(path)
        cfg = path / "config.json"
        if not cfg.is_file():
            raise TurnoutError(f"model folder {path} has no config.json; pass an HF-style model folder")
        try:
            return cls(path, json.loads(cfg.read_text()))
        except json.JSONDecodeError as e:
            raise TurnoutError(
                f"{cfg} is not valid JSON ({e}); re-download or re-convert the model"
            ) from None

    @property
    def architecture(self) -> str:
        archs = self.hf_config.get("architectures") or ["?"]
        return archs[0]

    @property
    def num_heads(self) -> int:
        return self.hf_config["num_attention_heads"]

    @property
    def num_kv_heads(self) -> int:
        return self.hf_config.get("num_key_value_heads") or self.num_heads

    @property
    def head_size(self) -> int:
        return self.hf_config.get("head_dim") or self.hf_config["hidden_size"] // self.num_heads

    @property
    def num_layers(self) -> int:
        return self.hf_config["num_hidden_layers"]

    @property
    def max_position_embeddings(self) -> int:
        return self.hf_config.get("max_position_embeddings", 2048)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.hf_config.get("eos_token_id")
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def resolve_dtype(self, requested: str, platform: Platform) -> torch.dtype:
        """auto: the checkpoint's dtype. On CUDA a float32 checkpoint runs in bfloat16; on CPU a bfloat16
        checkpoint runs in bfloat16 only where the CPU has native bf16 arithmetic, else in float32."""
        if requested != "auto":
            return _DTYPES[requested]
        saved = _DTYPES.get(str(self.hf_config.get("torch_dtype") or self.hf_config.get("dtype")))
        if platform.is_cuda:
            return saved if saved in (torch.float16, torch.bfloat16) else torch.bfloat16
        return torch.bfloat16 if saved == torch.bfloat16 and platform.native_bf16 else torch.float32
