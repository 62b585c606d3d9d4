"""Fake installed distributions: a dist-info with entry_points.txt plus a module, put on sys.path."""

from __future__ import annotations

from pathlib import Path

EXAMPLE = Path(__file__).parents[1] / "examples/turnout-example-backend/turnout_example_backend/__init__.py"


def make_dist(
    root: Path, dist: str, module: str, source: str, ep_name: str | None = None, requires: str | None = None
) -> Path:
    """Write `module.py` and `<dist>-1.2.3.dist-info` under root (with a Requires-Dist line where given);
    return root (to put on sys.path)."""
    (root / f"{module}.py").write_text(source)
    info = root / f"{dist.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir(parents=True)
    req = f"Requires-Dist: {requires}\n" if requires else ""
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n{req}")
    (info / "entry_points.txt").write_text(f"[turnout]\n{ep_name or module} = {module}\n")
    return root


def naive_backend_source(priority: int = -10) -> str:
    """The example third-party backend (examples/turnout-example-backend), at the given priority."""
    source = EXAMPLE.read_text()
    assert "priority = -10" in source
    return source.replace("priority = -10", f"priority = {priority}")
