"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step.

At batch 1 a step is ~240 kernels of a few microseconds each, so the gap between one kernel's end and
the next one's start is a large part of it. On Hopper and newer, a kernel launched with launch_pdl=True
may start while the kernel before it in the stream is still running: it can read what no earlier kernel
writes (a GEMV its weights) and then waits in gdc_wait() until the kernel before it has finished and its
writes are visible.

The invariant every kernel launched with `launch()`'s arguments keeps: every program calls gdc_wait()
(`PDL` constexpr) before it reads anything an earlier kernel wrote and before it writes anything. A kernel
then finishes only after the kernel before it has, so waiting for the one before is waiting for all
before. Kernels launched without these arguments wait for the whole stream as usual.

TURNOUT_PDL=0 turns it off; without CUDA, before Hopper, or with a Triton that lacks it, it is off.
"""

from __future__ import annotations

import functools

import torch

from turnout import envs


def supported() -> bool:
    """TURNOUT_PDL on, a Hopper or newer GPU, and a Triton with gdc_wait and launch_pdl."""
    if not (envs.PDL.value and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9):
        return False
    try:
        import triton.language.extra.cuda as tlc
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return hasattr(tlc, "gdc_wait") and "launch_pdl" in CUDAOptions.__dataclass_fields__


@functools.cache
def launch() -> dict:
    """Keyword arguments for every kernel launch (decided once; callers unpack, never change, the dict):
    the kernel's `PDL` constexpr, and Triton's launch_pdl."""
    return {"PDL": True, "launch_pdl": True} if supported() else {"PDL": False}
