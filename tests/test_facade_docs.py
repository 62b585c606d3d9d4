"""Every public name of the facades a plugin imports has a docstring: each class and function in their
`__all__`, and each public method and property those classes define in turnout (inherited ones included,
where a turnout base class defines them). A docstring a turnout base class gives an override counts."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

FACADES = (
    "turnout",
    "turnout.attention",
    "turnout.models",
    "turnout.layers",
    "turnout.graphs",
    "turnout.executor",
    "turnout.structured_outputs",
    "turnout.tool_parsers",
    "turnout.quantization",
)
# Names without a docstring today, as module:qualname; each owner adds its docstrings, then deletes the
# entry here (the test fails on an entry that has one, so this list only shrinks).
KNOWN_MISSING: set[str] = set()


def _ours(obj: object) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] == "turnout"


def _class_doc(cls: type) -> str | None:
    doc = cls.__dict__.get("__doc__")
    if dataclasses.is_dataclass(cls) and doc and doc.startswith(f"{cls.__name__}("):
        return None  # the signature dataclasses writes where a class has no docstring
    return doc


def _function(attr: object) -> object | None:
    """The function behind a method, property or class/static method; None for data."""
    for inner in ("fget", "__func__", "func"):
        attr = getattr(attr, inner, attr)
    return attr if inspect.isfunction(attr) else None


def _method_doc(cls: type, name: str) -> str | None:
    """The first docstring of `name` in cls's turnout classes, most derived first."""
    for klass in cls.__mro__:
        if _ours(klass) and name in vars(klass) and (fn := _function(vars(klass)[name])):
            if fn.__doc__:
                return fn.__doc__
    return None


def _undocumented_methods(cls: type) -> set[str]:
    missing = set()
    for name in dir(cls):
        owner = next((k for k in cls.__mro__ if name in vars(k)), None)
        if name.startswith("_") or owner is None or not _ours(owner) or not _function(vars(owner)[name]):
            continue
        if not _method_doc(cls, name):
            missing.add(f"{owner.__module__}:{owner.__qualname__}.{name}")
    return missing


def _public(module: object) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [n for n, v in vars(module).items() if not n.startswith("_") and _ours(v)]


def undocumented(facade: str) -> set[str]:
    """module:qualname of each class, function, method and property the facade exports without a docstring."""
    module = importlib.import_module(facade)
    missing = set() if hasattr(module, "__all__") else {f"{facade}:__all__"}
    for name in _public(module):
        obj = getattr(module, name)
        if inspect.isclass(obj) and _ours(obj):
            if not _class_doc(obj):
                missing.add(f"{obj.__module__}:{obj.__qualname__}")
            missing |= _undocumented_methods(obj)
        elif inspect.isfunction(obj) and _ours(obj) and not obj.__doc__:
            missing.add(f"{obj.__module__}:{obj.__qualname__}")
    return missing


def test_every_facade_name_has_a_docstring() -> None:
    found = set().union(*map(undocumented, FACADES))
    new = sorted(found - KNOWN_MISSING)
    assert not new, "add a docstring to each (module:name): " + ", ".join(new)
    done = sorted(KNOWN_MISSING - found)
    assert not done, "documented now: remove from KNOWN_MISSING in tests/test_facade_docs.py: " + ", ".join(
        done
    )


@pytest.mark.parametrize("facade", FACADES)
def test_facade_imports_and_names_what_it_exports(facade: str) -> None:
    module = importlib.import_module(facade)
    assert all(hasattr(module, n) for n in _public(module)), facade


def test_the_guide_tables_every_attention_metadata_field() -> None:
    from turnout.attention import AttentionMetadata

    guide = (Path(__file__).parents[1] / "docs/writing-a-plugin.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \|", guide, re.M))
    fields = {f.name for f in dataclasses.fields(AttentionMetadata)}
    props = {n for n, v in vars(AttentionMetadata).items() if isinstance(v, property)}
    assert fields | props <= rows, sorted((fields | props) - rows)
    assert "`preferred_block_size`" in guide
