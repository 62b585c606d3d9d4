"""EngineConfig: defaults < config file (TOML/YAML) < environment (TURNOUT_<FIELD>) < CLI flags/kwargs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import tomllib
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from turnout import envs
from turnout.errors import ConfigError

ENV_PREFIX = envs.PREFIX


class EngineConfig(BaseModel):
    """Every engine setting, with its default. Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # model and tokenizer
    model: str | None = Field(None, description="HF-style folder; None = embedded SmolLM2-135M-Instruct")
    tokenizer: str | None = Field(None, description="tokenizer folder; None = the model folder")
    skip_tokenizer_init: bool = Field(
        False, description="load no tokenizer: prompts must be token ids, outputs carry token ids and no text"
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto",
        description="auto = on GPU the checkpoint's dtype (bfloat16 for a float32 one); on CPU bfloat16 "
        "for a bfloat16 checkpoint (the embedded model) where the CPU has native bf16 (AVX512-BF16 or "
        "AMX), else float32",
    )
    # limits
    max_model_len: int | None = Field(None, ge=1, description="None = the model's max_position_embeddings")
    max_num_seqs: int | None = Field(
        None,
        ge=1,
        description="requests running at once at most; None = fit to the device (turnout explain says)",
    )
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="token budget of one step; None = fit to the device (turnout explain says)"
    )
    # KV cache
    block_size: int | None = Field(
        None, ge=1, description="tokens per KV-cache block; None = the chosen attention backend's preference"
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="share of GPU memory to use")
    cpu_kv_cache_bytes: int = Field(1 << 30, ge=1 << 20, description="KV-cache bytes on CPU")
    num_gpu_blocks_override: int | None = Field(None, ge=1, description="force this many KV blocks")
    enable_prefix_caching: bool = Field(True, description="reuse KV blocks of identical prefixes")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = Field(
        "auto",
        description="KV-cache element type (vLLM's names): auto = the model dtype; fp8 or fp8_e4m3 = "
        "float8_e4m3fn with per-layer k/v scales (1.0 where the checkpoint gives none), half of bf16's bytes",
    )
    # selection
    attention_backend: str = Field(
        "auto",
        description="attention backend name, auto, or one per phase: 'decode+mixed' or a table "
        "{decode = ..., mixed = ...} (decode steps to the first, the others to the second)",
    )
    executor: str = Field("auto", description="executor name, or auto")
    moe_kernel: str = Field("auto", description="MoE models: expert kernel name (triton, torch), or auto")
    quantization: str | None = Field(
        None,
        description="weight quantization method (fp8: an FP8 checkpoint, or a bf16 one quantized at load); "
        "None = the checkpoint's quantization_config, if any",
    )
    tuned: Literal["on", "off"] = Field(
        "on", description="on = a matching `turnout tune` record adds a measured tier above the priorities"
    )
    tune: Literal["off", "auto"] = Field(
        "off", description="auto = tune once before serving where no record matches (turnout tune)"
    )
    tune_workload: str = Field(
        "throughput", description="the workload profile records are read for: throughput, latency, prefix"
    )
    tune_budget: float = Field(120, gt=0, description="seconds that tune = auto may spend")
    # parallelism
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    data_parallel_size: int = Field(1, ge=1)
    async_scheduling: bool | None = Field(
        None,
        description="schedule step N+1 while step N runs on the device; None = on with CUDA where the "
        "executor supports it",
    )
    enable_expert_parallel: bool = Field(
        False, description="MoE models: partition the experts over the tp x dp ranks (all-to-all dispatch)"
    )
    data_parallel_rank: int = Field(
        0, ge=0, description="this replica's index; the data-parallel front sets it"
    )
    data_parallel_master_port: int | None = Field(
        None, ge=1, le=65535, description="rendezvous port of replicas that share expert parallelism"
    )
    rpc_timeout: float = Field(
        300, gt=0, description="seconds to wait for a worker's answer before giving up"
    )
    # graphs
    cudagraph_mode: str = Field("FULL_AND_PIECEWISE", description="a graph policy name (turnout plugins)")
    cudagraph_capture_sizes: list[int] | None = Field(None, description="None = vLLM's default sizes")
    enforce_eager: bool = Field(False, description="never capture graphs")
    seed: int = Field(0, description="global seed for unseeded sampling")
    # requests
    structured_outputs_backend: str = Field(
        "auto", description="the grammar engine for structured outputs; auto = the installed one (xgrammar)"
    )
    max_logprobs: int = Field(20, ge=0, description="the most logprobs / prompt_logprobs a request may ask")

    _sources: dict[str, str] = PrivateAttr(
        default_factory=dict
    )  # field -> "file", "env", "flag" or "argument"

    @field_validator("cudagraph_capture_sizes")
    @classmethod
    def _sizes(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or min(v) < 1):
            raise ValueError("must be a non-empty list of positive integers")
        return sorted(set(v)) if v else v

    @field_validator("attention_backend", mode="before")
    @classmethod
    def _per_phase(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        if set(v) != {"decode", "mixed"}:
            raise ValueError("a per-phase table needs exactly the keys decode and mixed")
        return f"{v['decode']}+{v['mixed']}"

    @field_validator("tuned", "tune", mode="before")
    @classmethod
    def _switch(cls, v: Any) -> Any:
        """YAML reads a bare off / on (a config file's, or TURNOUT_TUNED=off) as a bool."""
        return {False: "off", True: "on"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("data_parallel_rank")
    @classmethod
    def _dp_rank(cls, v: int, info: ValidationInfo) -> int:
        if v >= (size := info.data.get("data_parallel_size", 1)):
            raise ValueError(f"must be below data_parallel_size {size}")
        return v

    @property
    def world_size(self) -> int:
        """Ranks of one engine replica: tensor_parallel_size x pipeline_parallel_size (data parallelism
        runs data_parallel_size such replicas)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        """Ranks a MoE model's experts are partitioned over: tp x dp with enable_expert_parallel, else 1."""
        return self.tensor_parallel_size * self.data_parallel_size if self.enable_expert_parallel else 1

    @property
    def expert_parallel_spans_dp(self) -> bool:
        """The replicas share one process group and step together, each joining every all-to-all."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    def source(self, name: str) -> str:
        """Where the value of field `name` came from: default, file, env, flag (CLI) or argument (API)."""
        return self._sources.get(name, "default")

    def with_sources(self, sources: dict[str, str]) -> EngineConfig:
        """This config, its fields' sources (name -> default, file, env, flag or argument) updated from
        `sources`, as source() then reports them; returns self."""
        self._sources = {**self._sources, **sources}
        return self

    @classmethod
    def load(
        cls, config_file: str | Path | None = None, *, origin: str = "argument", **overrides: Any
    ) -> EngineConfig:
        """Merge the four sources; any unknown key or bad value raises ConfigError naming its source.
        `origin` names where the overrides came from ("flag" from the CLI), as source() reports it."""
        merged: dict[str, Any] = {}
        sources: dict[str, str] = {}
        kinds: dict[str, str] = {}
        layers = [
            (_read_file(Path(config_file)) if config_file else {}, f"config file {config_file}", "file"),
            (_read_env(), "environment", "env"),
            ({k: v for k, v in overrides.items() if v is not None}, "arguments", origin),
        ]
        for values, source, kind in layers:
            for key, value in values.items():
                if key not in cls.model_fields:
                    raise ConfigError(
                        f"unknown key '{key}' in {source}; valid keys: {', '.join(cls.model_fields)}"
                    )
                merged[key], sources[key], kinds[key] = value, source, kind
        try:
            return cls(**merged).with_sources(kinds)
        except ValidationError as e:
            raise ConfigError(_describe(e, sources)) from None


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} not found; pass an existing .toml or .yaml file")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError(f"config file {path}: unknown extension; use .toml, .yaml or .yml")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"config file {path} does not parse: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table of key = value settings")
    return {k.replace("-", "_"): v for k, v in data.items()}


def _read_env() -> dict[str, Any]:
    """TURNOUT_<FIELD>=value; values are parsed as YAML scalars/lists (so 'true', '2', '[1, 2]' work).
    Switches declared in turnout.envs or by a plugin's turnout_env_vars are not fields; each one set is
    parsed here, so a bad value fails at start-up even where no component reads it."""
    out = {}
    switches = envs.registry() if any(k.startswith(ENV_PREFIX) for k in os.environ) else {}
    for key, raw in os.environ.items():
        if key in switches:
            _ = switches[key].value  # raises ConfigError naming the switch
        elif key.startswith(ENV_PREFIX):
            field = key[len(ENV_PREFIX) :].lower()
            out[field] = yaml.safe_load(raw) if raw else None
    return out


def _describe(err: ValidationError, sources: dict[str, str]) -> str:
    e = err.errors()[0]
    key = ".".join(str(p) for p in e["loc"]) or "?"
    top = str(e["loc"][0]) if e["loc"] else key
    field = EngineConfig.model_fields.get(top)
    accepted = ""
    if field is not None:
        accepted = f"; expected {_type_name(field.annotation)}"
        if field.description:
            accepted += f" ({field.description})"
    where = sources.get(top, "arguments")
    return f"bad value {e.get('input')!r} for '{key}' in {where}: {e['msg']}{accepted}"


def _type_name(annotation: Any) -> str:
    return str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
