"""The MoE kernel selector, for a checkpoint with experts: the core's own kernels (layers/moe.py), checked
like attention backends; a plugin cannot add one."""

from __future__ import annotations

from typing import Any

import torch

from turnout.config import EngineConfig
from turnout.errors import ConfigError
from turnout.layers.moe import MoEContext, describe_placement, moe_kernels, num_experts
from turnout.models.info import ModelInfo
from turnout.platform import Platform
from turnout.selection.choice import Candidate, Choice, choose


def moe_candidates(ctx: MoEContext) -> list[Candidate]:
    """The core's MoE kernels (layers/moe.py), checked like attention backends; a plugin cannot add one."""
    cands = []
    for k in moe_kernels(ctx):
        try:
            why = k.check(ctx)
        except Exception as e:
            why = [f"check() raised {type(e).__name__}: {e}"]
        cands.append(Candidate("moe", k.name, "turnout", int(k.priority), why, k))
    return cands


def select_moe(
    config: EngineConfig, info: ModelInfo, platform: Platform, dtype: torch.dtype
) -> Choice | None:
    """config.moe_kernel for a checkpoint with experts; None for one without, where a MoE setting is an
    error, as are more expert-parallel ranks than experts."""
    n, ep = num_experts(info.hf_config), config.expert_parallel_size
    if not n:
        for key, unset in (("enable_expert_parallel", False), ("moe_kernel", "auto")):
            if getattr(config, key) != unset:
                raise ConfigError(f"{key} is set, but {info.architecture} has no experts; unset it")
        return None
    if ep > n:
        raise ConfigError(
            f"{n} experts do not split over {ep} expert-parallel ranks (tp x dp); use fewer ranks"
        )
    return choose("moe", moe_candidates(MoEContext(platform, dtype)), config.moe_kernel)


def expert_placement(config: EngineConfig, info: ModelInfo) -> dict[str, Any]:
    """The experts each rank holds, for explain (layers.moe.describe_placement)."""
    tp, dp, ep = config.tensor_parallel_size, config.data_parallel_size, config.enable_expert_parallel
    return describe_placement(info.hf_config, tp, dp, ep)
