"""One probe of the hardware: every selection decision reads this, nothing else looks at devices."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch

from turnout import envs


@dataclass(frozen=True)
class Platform:
    """The hardware here, probed once (current_platform): the device kind, name, count and compute
    capability, one device's memory, the dtypes it runs and whether bf16 is native."""

    device_type: str  # "cuda" or "cpu"
    device_name: str
    device_count: int
    capability: tuple[int, int] | None  # CUDA compute capability, None on CPU
    total_memory: int  # bytes of one device (system RAM on CPU)
    dtypes: tuple[torch.dtype, ...] = field(default=(torch.float32,))
    native_bf16: bool = False  # bf16 arithmetic in hardware (CUDA sm80+, or AVX512-BF16 / AMX on the CPU)

    @property
    def is_cuda(self) -> bool:
        """The devices are CUDA GPUs (else the CPU)."""
        return self.device_type == "cuda"

    def describe(self) -> str:
        """One line for logs and explain: "cuda:NVIDIA H200 sm90 x1, 140 GiB" or "cpu:cpu x1, 31 GiB"."""
        cap = f" sm{self.capability[0]}{self.capability[1]}" if self.capability else ""
        gib = self.total_memory / 2**30
        return f"{self.device_type}:{self.device_name}{cap} x{self.device_count}, {gib:.0f} GiB"


def _system_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def _cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@functools.cache
def current_platform() -> Platform:
    """Probe once. TURNOUT_DEVICE=cpu forces the CPU even where CUDA exists."""
    if torch.cuda.is_available() and envs.DEVICE.value != "cpu":
        props = torch.cuda.get_device_properties(0)
        cap = (props.major, props.minor)
        dtypes = (torch.float16, torch.float32) + ((torch.bfloat16,) if cap >= (8, 0) else ())
        count = torch.cuda.device_count()
        return Platform("cuda", props.name, count, cap, props.total_memory, dtypes, cap >= (8, 0))
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    return Platform("cpu", "cpu", 1, None, _system_memory(), dtypes, _cpu_has_bf16())
