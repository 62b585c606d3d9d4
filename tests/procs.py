"""Process liveness for the executor tests: is a pid still running (zombies count as gone)?"""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
