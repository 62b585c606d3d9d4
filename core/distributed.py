"""Tensor/pipeline-parallel state of this process. Uniproc leaves the defaults: rank 0 of 1."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None
    pp_group: Any = None

    @property
    def is_first_pp(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp(self) -> bool:
        return self.pp_rank == self.pp_size - 1


_state = ParallelState()


def init_parallel_groups(rank: int, world_size: int, tp_size: int) -> ParallelState:
    """After init_process_group: rank = pp_rank * tp + tp_rank; one TP group per stage, one PP group per TP
    rank. Every rank creates every group, in the same order, as torch.distributed requires."""
    tp, pp = tp_size, world_size // tp_size
    pp_rank, tp_rank = divmod(rank, tp)
    if pp == 1:
        return ParallelState(tp_rank, tp, 0, 1, dist.group.WORLD, None)
    tp_groups = [dist.new_group(list(range(p * tp, (p + 1) * tp))) for p in range(pp)]
    pp_groups = [dist.new_group(list(range(t, world_size, tp))) for t in range(tp)]
    return ParallelState(tp_rank, tp, pp_rank, pp, tp_groups[pp_rank], pp_groups[tp_rank])


def get_parallel_state() -> ParallelState:
    return _state


def set_parallel_state(state: ParallelState) -> None:
    global _state
    _state = state


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _state.tp_size > 1:
        dist.all_reduce(x, group=_state.tp_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate the shards of every TP rank along dim."""
    if _state.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=_state.tp_group)
    return torch.cat(parts, dim=dim)


def _pp_peer(offset: int) -> int:
    """Global rank of the stage `offset` away from this one, at this TP rank."""
    return dist.get_global_rank(_state.pp_group, _state.pp_rank + offset)


def pp_send(x: torch.Tensor) -> dist.Work:
    """Start sending x to the next stage; keep x alive until the returned work's wait()."""
    return dist.isend(x, dst=_pp_peer(1), group=_state.pp_group)


def pp_recv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Receive a tensor of this shape from the previous stage (sends between a pair arrive in order)."""
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, src=_pp_peer(-1), group=_state.pp_group)
    return x
