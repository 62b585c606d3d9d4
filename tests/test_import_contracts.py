"""The import contracts `make lint` runs (lint-imports) cover every core module and every plugin package."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).parents[1]
# and `turnout` itself
FACADES = {"attention", "executor", "graphs", "layers", "models", "structured_outputs", "tool_parsers"}
LINTER = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
CONTRACTS = {c["id"]: c for c in LINTER["contracts"]}


def _plugin_packages() -> set[str]:
    projects = [*ROOT.glob("plugins/*/*/pyproject.toml"), *ROOT.glob("examples/*/pyproject.toml")]
    return {pkg for p in projects for pkg in _packages(p)}


def _packages(pyproject: Path) -> list[str]:
    tool = tomllib.loads(pyproject.read_text()).get("tool", {}).get("setuptools", {})
    return tool.get("packages") or [d.name for d in pyproject.parent.glob("turnout_*") if d.is_dir()]


def _core_modules() -> set[str]:
    core = ROOT / "core"
    mods = {p.stem for p in core.glob("*.py") if p.stem != "__init__"}
    return mods | {p.parent.name for p in core.glob("*/__init__.py")}


def test_every_core_module_but_the_facades_is_forbidden_to_plugins():
    forbidden = set(CONTRACTS["facades"]["forbidden_modules"])
    assert {f"turnout.{f}.*" for f in FACADES} <= forbidden  # a facade's submodules are internal
    internal = {f"turnout.{m}" for m in _core_modules() - FACADES}
    assert internal - forbidden == set(), "a core module plugins may import without being a facade"
    assert FACADES <= _core_modules()


def test_every_plugin_package_is_checked():
    plugins = _plugin_packages()
    assert {"turnout_cpu", "turnout_qwen3", "turnout_ray", "turnout_example_backend"} <= plugins
    assert set(LINTER["root_packages"]) == plugins | {"turnout"}
    assert set(CONTRACTS["facades"]["source_modules"]) == plugins
    assert set(CONTRACTS["independence"]["modules"]) == plugins
