"""The import contracts `make lint` runs (lint-imports) cover every core module and every plugin package."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).parents[1]
# and `turnout` itself
FACADES = {"attention", "executor", "graphs", "layers", "models", "quantization", "structured_outputs"}
FACADES |= {"tool_parsers"}
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
    assert set(LINTER["root_packages"]) == plugins | {"turnout", "benchmarks"}
    assert set(CONTRACTS["facades"]["source_modules"]) == plugins
    assert set(CONTRACTS["independence"]["modules"]) == plugins


def test_every_core_module_has_a_layer():
    """A new core module is placed in the layers contract (docs/architecture.md), not left unchecked."""
    layers = [m.strip() for row in CONTRACTS["layers"]["layers"] for m in row.replace("|", ":").split(":")]
    files = [p for p in (ROOT / "core").rglob("*.py") if p.name != "__init__.py" or p.parent != ROOT / "core"]
    unplaced = {
        name
        for name in map(_module_name, files)
        if not any(name == m or name.startswith(m + ".") for m in layers)
        and not any(m.startswith(name + ".") for m in layers)  # a package placed by its submodules
    }
    assert unplaced == set()


# ---- the benchmarks: turnout's facades only, and nothing shipped imports them ----


def test_the_benchmarks_are_a_package_held_to_the_facades():
    """Every script in benchmarks/ is in the graph lint-imports checks (the folder is a package), and may
    import what a plugin may, and turnout.bench, the benchmarks' own facade, but none of its submodules."""
    contract = CONTRACTS["benchmarks"]
    assert (ROOT / "benchmarks" / "__init__.py").is_file() and contract["source_modules"] == ["benchmarks"]
    plugins_may_not = set(CONTRACTS["facades"]["forbidden_modules"])
    assert set(contract["forbidden_modules"]) == plugins_may_not - {"turnout.bench"} | {"turnout.bench.*"}
    assert set(CONTRACTS["shipped"]["source_modules"]) == _plugin_packages() | {"turnout"}
    assert CONTRACTS["shipped"]["forbidden_modules"] == ["benchmarks"]


def _lint_probe(tmp_path: Path, source: str) -> subprocess.CompletedProcess:
    """lint-imports with this repository's benchmarks contract over turnout and a benchmarks package whose
    one module holds source."""
    (tmp_path / "benchmarks").mkdir(exist_ok=True)
    (tmp_path / "benchmarks" / "__init__.py").write_text("")
    (tmp_path / "benchmarks" / "probe.py").write_text(source)
    toml = [
        "[tool.importlinter]",
        'root_packages = ["turnout", "benchmarks"]',
        "[[tool.importlinter.contracts]]",
    ]
    toml += [f"{key} = {json.dumps(value)}" for key, value in CONTRACTS["benchmarks"].items()]
    (tmp_path / "pyproject.toml").write_text("\n".join(toml) + "\n")
    lint = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([str(lint), "--no-cache"], cwd=tmp_path, env=env, capture_output=True, text=True)


def test_a_benchmark_reaching_into_turnout_breaks_the_contract(tmp_path):
    reaching = "\n".join(
        [
            "import turnout.platform",
            "from turnout.bench.records import check",
            "from turnout.engine import llm_engine",
        ]
    )
    broken = _lint_probe(tmp_path, reaching)
    assert broken.returncode == 1, broken.stdout
    for target in (
        "turnout.platform (l.1)",
        "turnout.bench.records (l.2)",
        "turnout.engine.llm_engine (l.3)",
    ):
        assert f"benchmarks.probe -> {target}" in broken.stdout
    facades = "\n".join(
        [
            "from turnout import LLM",
            "from turnout.attention import AttentionBackend",
            "from turnout.bench import stages",
        ]
    )
    kept = _lint_probe(tmp_path, facades)
    assert kept.returncode == 0 and "1 kept, 0 broken" in kept.stdout, kept.stdout


# ---- no private helper crosses a module boundary ----


def _module_name(path: Path) -> str:
    parts = ["turnout", *path.relative_to(ROOT / "core").with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    rel = ROOT / "core" / Path(*name.split(".")[1:])
    return name == "turnout" or rel.with_suffix(".py").is_file() or (rel / "__init__.py").is_file()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_uses(source: str, module: str) -> list[str]:
    """`from turnout.x import _name` and `x._name` on a turnout module bound by an import, where x is not
    this module itself: each as "line N: what"."""
    tree, hits, modules = ast.parse(source), [], {}  # local name -> the turnout module it is bound to
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] == "turnout"
        ):
            for a in node.names:
                if _private(a.name) and node.module != module:
                    hits.append(f"line {node.lineno}: from {node.module} import {a.name}")
                if _is_module(f"{node.module}.{a.name}"):
                    modules[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "turnout":
                    modules[a.asname or "turnout"] = a.name if a.asname else "turnout"
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        chain, base = [], node.value
        while isinstance(base, ast.Attribute):
            chain.insert(0, base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in modules:
            target = ".".join([modules[base.id], *chain])
            if _is_module(target) and target != module:
                hits.append(f"line {node.lineno}: {target}.{node.attr}")
    return hits


def test_the_private_use_finder_finds_both_forms():
    src = (
        "import turnout.cli\nfrom turnout import envs\nfrom turnout.loader import weights as w\n"
        "from turnout.cli import _config, main\n"
        "turnout.cli._table(); envs._SOURCES; w._x; envs.registry(); main._private; self._own\n"
    )
    assert sorted(_private_uses(src, "turnout.bench.cli")) == [
        "line 4: from turnout.cli import _config",
        "line 5: turnout.cli._table",
        "line 5: turnout.envs._SOURCES",
        "line 5: turnout.loader.weights._x",
    ]
    assert _private_uses("from turnout.cli import _table\n", "turnout.cli") == []  # its own


def test_no_core_module_uses_another_modules_private_names():
    """A helper two modules share is public, with a docstring, in the module that owns it (the engine flags:
    turnout.engine_args), not a `_name` reached into from outside."""
    hits = [
        f"core/{p.relative_to(ROOT / 'core')}: {hit}"
        for p in sorted((ROOT / "core").rglob("*.py"))
        for hit in _private_uses(p.read_text(), _module_name(p))
    ]
    assert hits == []


# ---- no cycle among the core's modules, type-only and function-level imports included ----

# The calls upwards at call time that the layers contract lists in its ignore_imports: the importer names the
# module only inside functions. The cycle each closes is the design's (with tune = "auto", LLM runs the
# tuner, which builds LLMs of its own); every other import counts.
CALL_TIME_UPWARDS = {("turnout.llm", "turnout.tuning.tuner")}


def _core_graph():
    import grimp

    return grimp.build_graph("turnout", exclude_type_checking_imports=False, cache_dir=None)


def _cycles(graph) -> list[str]:
    """Each import that closes a cycle, as that cycle: "a -> b -> ... -> a"."""
    return [
        " -> ".join([a, *chain])
        for a in sorted(graph.modules)
        for b in sorted(graph.find_modules_directly_imported_by(a))
        if (chain := graph.find_shortest_chain(importer=b, imported=a))
    ]


def _function_level_only(importer: str, imported: str) -> bool:
    """Whether every import of `imported` in `importer`'s source sits inside a function."""
    path = ROOT / "core" / Path(*importer.split(".")[1:])
    tree = ast.parse((path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text())
    inner = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
        for n in ast.walk(f)
    }
    found = [n for n in ast.walk(tree) if imported in _imported_modules(n)]
    return bool(found) and all(id(n) in inner for n in found)


def _imported_modules(node: ast.AST) -> list[str]:
    if isinstance(node, ast.ImportFrom):
        return [node.module or ""]
    return [a.name for a in node.names] if isinstance(node, ast.Import) else []


def test_the_cycle_finder_finds_a_type_only_cycle():
    import grimp

    graph = grimp.ImportGraph()
    graph.add_import(importer="turnout.a", imported="turnout.b")
    graph.add_import(importer="turnout.b", imported="turnout.a")
    assert _cycles(graph) == ["turnout.a -> turnout.b -> turnout.a", "turnout.b -> turnout.a -> turnout.b"]
    assert _function_level_only("turnout.llm", "turnout.tuning.tuner")
    assert not _function_level_only("turnout.llm", "turnout.config")


def test_the_call_time_upwards_are_function_level_and_listed():
    listed = set(CONTRACTS["layers"]["ignore_imports"])
    for importer, imported in CALL_TIME_UPWARDS:
        assert f"{importer} -> {imported}" in listed
        assert _function_level_only(importer, imported), f"{importer} imports {imported} at module level"


def test_no_cycle_among_core_modules():
    """No module of the core reaches itself through its imports, those under TYPE_CHECKING and those inside
    functions included; a package's __init__ is a module of its own. The listed calls upwards aside."""
    graph = _core_graph()
    for importer, imported in CALL_TIME_UPWARDS:
        graph.remove_import(importer=importer, imported=imported)
    cycles = _cycles(graph)
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)
