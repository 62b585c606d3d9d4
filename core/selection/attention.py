"""The attention selector: every plugin's backends checked against the checkpoint's heads and the chosen
model's per-layer features; one backend, or one per phase (decode steps, mixed steps)."""

from __future__ import annotations

import torch

from turnout.attention.backend import AttentionContext
from turnout.attention.per_phase import PerPhaseBackend, split_name
from turnout.config import EngineConfig
from turnout.errors import SelectionError
from turnout.models.info import ModelInfo
from turnout.models.registry import ModelArchitecture
from turnout.platform import Platform
from turnout.plugins import PluginManager
from turnout.selection.choice import Candidate, Choice, choose, plugin_candidates, ranked


def attention_context(
    info: ModelInfo,
    arch: ModelArchitecture,
    platform: Platform,
    dtype: torch.dtype,
    block_size: int | None,
    kv_cache_dtype: str = "auto",
) -> AttentionContext:
    """What the attention backends are checked against: the checkpoint's heads (under multi-head latent
    attention one latent KV head, and kv_lora_rank), the per-layer features the chosen model class declares
    for it, and the KV cache dtype the config asks for."""
    features = arch.layer_features(info.hf_config)
    heads = (info.head_size, info.num_heads, info.num_kv_heads)
    return AttentionContext(
        platform, dtype, *heads, block_size, features, kv_cache_dtype, kv_lora_rank=info.kv_lora_rank
    )


def attention_candidates(pm: PluginManager, ctx: AttentionContext) -> list[Candidate]:
    """Every plugin's attention backends for ctx's platform, each with the reasons its check(ctx) gives."""
    check = lambda _, b: b.check(ctx)
    return plugin_candidates(pm, "turnout_attention_backends", "attention", check, platform=ctx.platform)


def choose_attention(candidates: list[Candidate], requested: str, ctx: AttentionContext) -> Choice:
    """One backend (a name or "auto"), or one per phase ("decode+mixed"): each half must be valid alone,
    and the two must share one KV cache (attention.per_phase). Under "auto" the backend ranked first by
    priority serves decode steps, and the one ranked first by mixed priority the other steps, where the two
    differ and can share one KV cache."""
    pair = split_name(requested)
    if pair is None:
        choice = choose("attention", candidates, requested)
        return _auto_phases(choice, candidates, ctx) if requested == "auto" else choice
    halves = [choose("attention", candidates, name).chosen for name in pair]
    backend = PerPhaseBackend(halves[0].obj, halves[1].obj)
    if why := backend.check(ctx):
        raise SelectionError(f"attention backend '{requested}' cannot be used: {'; '.join(why)}")
    return _phase_choice(requested, candidates, halves, backend)


def select_attention(
    pm: PluginManager,
    config: EngineConfig,
    info: ModelInfo,
    model: ModelArchitecture,
    platform: Platform,
    dtype: torch.dtype,
) -> Choice:
    """config.attention_backend among the backends that can serve info's heads and model's layers and read
    a cache of config.kv_cache_dtype: the cache dtype is never changed to find a backend."""
    ctx = attention_context(info, model, platform, dtype, config.block_size, config.kv_cache_dtype)
    if ctx.kv_lora_rank and config.kv_cache_dtype != "auto":
        raise SelectionError(
            f"kv_cache_dtype {config.kv_cache_dtype} unsupported for {model.name}: its multi-head latent "
            "attention cache holds the latent vector in the model dtype only; set kv_cache_dtype = auto"
        )
    try:
        return choose_attention(attention_candidates(pm, ctx), config.attention_backend, ctx)
    except SelectionError as e:
        if config.kv_cache_dtype == "auto" or "kv_cache_dtype" not in str(e):
            raise
        keep = str(dtype).removeprefix("torch.")
        raise SelectionError(f"{e}; or set kv_cache_dtype = auto (a {keep} KV cache)") from None


def _auto_phases(choice: Choice, candidates: list[Candidate], ctx: AttentionContext) -> Choice:
    """choice's backend for decode steps; for the others the valid backend of the highest mixed priority
    that can share its KV cache (itself: one backend). choice.note names those passed over, and why."""
    decode, passed = choice.chosen, []
    for mixed in ranked((c for c in candidates if c.valid), "mixed"):
        if mixed.name == decode.name:
            break
        backend = PerPhaseBackend(decode.obj, mixed.obj)
        if not (why := backend.check(ctx)):
            choice = _phase_choice("auto", candidates, [decode, mixed], backend)
            break
        passed.append(f"{mixed.name} ranks higher for mixed steps but cannot serve them: {'; '.join(why)}")
    choice.note = "; ".join(passed)
    return choice


def _phase_choice(
    requested: str, candidates: list[Candidate], halves: list[Candidate], backend: PerPhaseBackend
) -> Choice:
    """The Choice of the pair: a candidate for backend, chosen, beside every other; phases names each half."""
    for c in candidates:
        c.chosen = False
    plugins = "+".join(dict.fromkeys(h.plugin for h in halves))
    chosen = Candidate("attention", backend.name, plugins, backend.priority, [], backend, chosen=True)
    return Choice(
        "attention", requested, [*candidates, chosen], chosen, dict(zip(("decode", "mixed"), halves))
    )
