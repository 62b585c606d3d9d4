"""`LLM(...)` in a script that configures no logging shows turnout's start-up lines on stderr, as vLLM
does; where the application configures logging, they go to its handlers once, not twice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import logging, sys
from turnout import LLM
LLM(sys.argv[1], cpu_kv_cache_bytes=1 << 22, block_size=8)
print("--- basicConfig", file=sys.stderr, flush=True)
logging.basicConfig(level=logging.INFO, format="app %(name)s: %(message)s")
LLM(sys.argv[1], cpu_kv_cache_bytes=1 << 22, block_size=8)
"""
LINES = ("selected attention ", "loaded LlamaForCausalLM", "KV cache: ")


def _stderr(model: Path, **env: str) -> str:
    env = {**os.environ, "TURNOUT_TUNED": "off", **env}
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model)], capture_output=True, text=True, env=env, timeout=120
    )
    assert res.returncode == 0, res.stderr
    return res.stderr


def test_a_script_shows_the_start_up_lines_once(tiny_llama: Path) -> None:
    own, app = _stderr(tiny_llama).split("--- basicConfig")
    for line in LINES:
        assert own.count(f"INFO turnout: {line}") == 1, own  # no logging set up: turnout's own handler
        assert app.count(line) == 1 and f"app turnout: {line}" in app, app  # the application's, only


def test_turnout_log_level_is_honoured(tiny_llama: Path) -> None:
    own = _stderr(tiny_llama, TURNOUT_LOG_LEVEL="WARNING").split("--- basicConfig")[0]
    assert not any(line in own for line in LINES), own
