"""Tensor/pipeline/expert-parallel state of this process. Uniproc leaves the defaults: rank 0 of 1."""

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
    # data-parallel replicas in this process group: more than 1 only where expert parallelism spans them
    dp_rank: int = 0
    dp_size: int = 1
    # expert parallelism: the tp x dp ranks of a stage, ep_rank = dp_rank * tp + tp_rank (1 rank without it)
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: Any = None

    @property
    def is_first_pp(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp(self) -> bool:
        return self.pp_rank == self.pp_size - 1


_state = ParallelState()


def init_parallel_groups(
    rank: int, world_size: int, tp_size: int, dp_size: int = 1, expert_parallel: bool = False
) -> ParallelState:
    """After init_process_group: rank = (dp_rank * pp + pp_rank) * tp + tp_rank; one TP group per replica and
    stage, one PP group per replica and TP rank, and with expert_parallel one EP group per stage over every
    replica's TP ranks. Every rank creates every group, in the same order, as torch.distributed requires."""
    per_dp = world_size // dp_size
    tp, pp = tp_size, per_dp // tp_size
    dp_rank, local = divmod(rank, per_dp)
    pp_rank, tp_rank = divmod(local, tp)
    at = lambda d, p, t: d * per_dp + p * tp + t  # the global rank of (replica, stage, TP rank)
    dps, pps, tps = range(dp_size), range(pp), range(tp)
    state = ParallelState(tp_rank, tp, pp_rank, pp, dist.group.WORLD, None, dp_rank, dp_size)
    if dp_size > 1 or pp > 1:
        tp_groups = [dist.new_group([at(d, p, t) for t in tps]) for d in dps for p in pps]
        state.tp_group = tp_groups[dp_rank * pp + pp_rank]
    if pp > 1:
        pp_groups = [dist.new_group([at(d, p, t) for p in pps]) for d in dps for t in tps]
        state.pp_group = pp_groups[dp_rank * tp + tp_rank]
    if expert_parallel:
        state.ep_rank, state.ep_size = dp_rank * tp + tp_rank, dp_size * tp
        if dp_size == 1:
            state.ep_group = state.tp_group
        elif pp == 1:
            state.ep_group = dist.group.WORLD
        else:
            ep_groups = [dist.new_group([at(d, p, t) for d in dps for t in tps]) for p in pps]
            state.ep_group = ep_groups[pp_rank]
    return state


def get_parallel_state() -> ParallelState:
    """This process's ParallelState: ranks, sizes and groups of tensor, pipeline and expert parallelism,
    as the rank bootstrap set it (the defaults, rank 0 of 1, under uniproc)."""
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


def ep_exchange_counts(send: torch.Tensor) -> torch.Tensor:
    """send [ep] int64, the rows this rank sends to each EP rank -> the rows each EP rank sends here."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=_state.ep_group)
    return recv


def ep_all_to_all(x: torch.Tensor, recv_splits: list[int], send_splits: list[int]) -> torch.Tensor:
    """x holds send_splits[r] rows for EP rank r, in rank order; returns recv_splits[r] rows from each rank r,
    in rank order. all_to_all_single with uneven splits runs on gloo (CPU) as on NCCL."""
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=_state.ep_group)
    return out
