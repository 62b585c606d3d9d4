"""Every environment switch, in one registry: name, parser, default and one line of doc each.

The core's switches are declared here; a plugin declares its own through the `turnout_env_vars` hook.
Any other TURNOUT_<NAME> variable is an EngineConfig field (turnout.config), so a typo fails loudly.
A switch is read when the component that uses it starts (a backend's construction, selection, a
functools.cache'd accessor), never per step: `.value` parses the environment each time it is called.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from turnout.errors import ConfigError

T = TypeVar("T")
PREFIX = "TURNOUT_"


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One environment switch: its full name (TURNOUT_...), the parser of its text, the default where it is
    unset, and one line of doc, quoted in the error for a value that does not parse."""

    name: str
    parse: Callable[[str], T]
    default: T
    doc: str

    @property
    def value(self) -> T:
        """The parsed value of the variable now, or the default where it is unset."""
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        try:
            return self.parse(raw)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{self.name}={raw!r} does not parse ({e}); {self.doc}") from None


def flag(raw: str) -> bool:
    """On unless "0"."""
    return raw.strip() != "0"


def path(raw: str) -> Path | None:
    """A path, ~ expanded; empty means unset."""
    return Path(raw).expanduser() if raw else None


def names(raw: str) -> frozenset[str]:
    """A comma-separated list; empty means none."""
    return frozenset(n.strip() for n in raw.split(",") if n.strip())


def tile_map(raw: str) -> dict[tuple[int, int], tuple[int, int]]:
    """Shapes and tiles as NxK=a,b separated by ";" -> {(N, K): (a, b)}; empty means none."""
    out = {}
    for item in filter(None, (i.strip() for i in raw.split(";"))):
        shape, tile = item.split("=")
        n, k = (int(v) for v in shape.split("x"))
        a, b = (int(v) for v in tile.split(","))
        if min(a, b) < 1 or a & (a - 1) or b & (b - 1):
            raise ValueError(f"{item}: both tile values must be powers of two")
        out[(n, k)] = (a, b)
    return out


PLUGINS = EnvVar(
    "TURNOUT_PLUGINS", names, None, "plugin entry-point names to load: unset loads all, empty loads none"
)
DEVICE = EnvVar("TURNOUT_DEVICE", str.lower, "", "cpu: run on the CPU even where CUDA exists")
LOG_LEVEL = EnvVar("TURNOUT_LOG_LEVEL", str.upper, "INFO", "the CLI's log level (DEBUG, INFO, WARNING, ...)")
CACHE_DIR = EnvVar(
    "TURNOUT_CACHE_DIR", path, None, "where the converted default model is kept (unset: ~/.cache/turnout)"
)
FUSED_KERNELS = EnvVar(
    "TURNOUT_FUSED_KERNELS", flag, True, "0: the torch path instead of the fused CUDA kernels between GEMMs"
)
TRITON_GEMV = EnvVar("TURNOUT_TRITON_GEMV", flag, True, "0: every matmul goes to F.linear, no Triton GEMV")
GEMV_MAX_K = EnvVar(
    "TURNOUT_GEMV_MAX_K",
    int,
    3072,
    "the longest weight row (in features) a decode matmul sends to the Triton GEMV; longer ones: F.linear",
)


GEMV_TILES = EnvVar(
    "TURNOUT_GEMV_TILES",
    tile_map,
    {},
    "the Triton GEMV's (BLOCK_N, num_warps) per weight shape, e.g. 4096x1024=4,4;1024x3072=8,8 "
    "(the gemv records' captured-step sweeps found them); unset shapes keep gemv.tiles()'s choice",
)
PDL = EnvVar(
    "TURNOUT_PDL",
    flag,
    True,
    "0: launch the Triton kernels one after another, without programmatic dependent launch",
)
CONFORMANCE_ERRORS = EnvVar(
    "TURNOUT_CONFORMANCE_ERRORS", path, None, "a file the attention conformance tests append each error to"
)
API_KEY = EnvVar("TURNOUT_API_KEY", str, "", "turnout serve: the API key where --api-key is not given")
ENABLE_MULTIPROCESSING = EnvVar(
    "TURNOUT_ENABLE_MULTIPROCESSING",
    flag,
    True,
    "0: `turnout serve` steps the engine core in a thread of the server's process, not a process of its own",
)
_SOURCES: list[Callable[[], Iterable[EnvVar[Any]]]] = []  # add_source's, in order
CORE: tuple[EnvVar[Any], ...] = (
    PLUGINS,
    DEVICE,
    LOG_LEVEL,
    CACHE_DIR,
    FUSED_KERNELS,
    TRITON_GEMV,
    GEMV_MAX_K,
    GEMV_TILES,
    PDL,
    CONFORMANCE_ERRORS,
    API_KEY,
    ENABLE_MULTIPROCESSING,
)


def add_source(source: Callable[[], Iterable[EnvVar[Any]]]) -> None:
    """Have registry() also hold every switch source() returns each time it is called; added once.

    The layer that knows other declarers registers them here, so this module imports nothing of turnout's
    but its errors: turnout.plugins adds the switches of its loaded plugins' `turnout_env_vars` hooks."""
    if source not in _SOURCES:
        _SOURCES.append(source)


def registry() -> dict[str, EnvVar[Any]]:
    """Every declared switch by name: the core's, then each added source's in the order added (the loaded
    plugins', through turnout.plugins; a hook that raised adds none)."""
    found = {v.name: v for v in CORE}
    for source in _SOURCES:
        found.update({v.name: v for v in source()})
    return found


def environment() -> dict[str, str]:
    """This process's TURNOUT_* variables, for ranks started where the environment is not inherited."""
    return {k: v for k, v in os.environ.items() if k.startswith(PREFIX)}
