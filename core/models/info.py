"""What the core needs to know of a checkpoint before choosing anything: read from config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from turnout.errors import ConfigError, TurnoutError
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
    def kv_lora_rank(self) -> int | None:
        """Multi-head latent attention's latent size (config.json's kv_lora_rank); None for other models."""
        return self.hf_config.get("kv_lora_rank") or None

    @property
    def num_kv_heads(self) -> int:
        """The KV heads the cache holds: one latent head under multi-head latent attention."""
        if self.kv_lora_rank:
            return 1
        return self.hf_config.get("num_key_value_heads") or self.num_heads

    @property
    def head_size(self) -> int:
        """The Attention layers' key head size. Multi-head latent attention (config.json sets kv_lora_rank)
        attends in absorbed form over its cached latent vector: kv_lora_rank + qk_rope_head_dim."""
        c = self.hf_config
        if self.kv_lora_rank:
            return c["kv_lora_rank"] + c["qk_rope_head_dim"]
        return c.get("head_dim") or c["hidden_size"] // self.num_heads

    @property
    def num_layers(self) -> int:
        return self.hf_config["num_hidden_layers"]

    @property
    def max_position_embeddings(self) -> int:
        """The positions the model serves: config.json's max_position_embeddings, times the factor of
        dynamic NTK rope scaling (which RotaryEmbedding's tables cover)."""
        trained = self.hf_config.get("max_position_embeddings", 2048)
        rope = self.hf_config.get("rope_scaling") or self.hf_config.get("rope_parameters") or {}
        if (rope.get("rope_type") or rope.get("type")) == "dynamic" and rope.get("factor"):
            return max(trained, int(trained * rope["factor"]))
        return trained

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.hf_config.get("eos_token_id")
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def parallel_problems(self, tp: int, pp: int) -> list[str]:
        """Why this model cannot run with tensor_parallel_size tp and pipeline_parallel_size pp; empty if
        it can. TP splits attention heads and the MLP's intermediate size evenly over its ranks; KV heads
        split evenly or are replicated (tp a multiple of them). The vocabulary is padded per rank, so it
        need not divide. PP gives every stage at least one layer."""
        cfg, why = self.hf_config, []
        divisors = lambda n: ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
        if self.num_heads % tp:
            why.append(
                f"tensor_parallel_size {tp} does not divide the model's {self.num_heads} attention heads "
                f"(use one of {divisors(self.num_heads)})"
            )
        elif self.num_kv_heads % tp and tp % self.num_kv_heads:
            why.append(
                f"tensor_parallel_size {tp} neither divides nor is a multiple of the model's "
                f"{self.num_kv_heads} KV heads"
            )
        if (inter := cfg.get("intermediate_size")) and inter % tp:
            why.append(f"tensor_parallel_size {tp} does not divide the MLP's intermediate size {inter}")
        if pp > self.num_layers:
            why.append(
                f"pipeline_parallel_size {pp} exceeds the model's {self.num_layers} layers; "
                "every stage needs at least one layer"
            )
        return why

    def check_parallel(self, tp: int, pp: int) -> None:
        if why := self.parallel_problems(tp, pp):
            raise ConfigError(f"model {self.path}: {'; '.join(why)}")

    def resolve_dtype(self, requested: str, platform: Platform) -> torch.dtype:
        """auto: the checkpoint's dtype. On CUDA a float32 checkpoint runs in bfloat16; on CPU a bfloat16
        checkpoint runs in bfloat16 only where the CPU has native bf16 arithmetic, else in float32."""
        if requested != "auto":
            return _DTYPES[requested]
        saved = _DTYPES.get(str(self.hf_config.get("torch_dtype") or self.hf_config.get("dtype")))
        if platform.is_cuda:
            return saved if saved in (torch.float16, torch.bfloat16) else torch.bfloat16
        return torch.bfloat16 if saved == torch.bfloat16 and platform.native_bf16 else torch.float32
