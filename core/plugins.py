"""Plugin discovery: every `turnout` entry point, import failures recorded, not fatal.

A plugin declares the plugin API it was written for by its distribution's requirement on turnout
(`dependencies = ["turnout>=0.2,<0.3"]`). One whose requirement this turnout does not meet is not imported:
it is listed as "incompatible", with the reason and where the migration note is.

TURNOUT_PLUGINS is an allow-list of entry-point names: unset loads all, empty loads none.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any

import pluggy
from packaging.requirements import InvalidRequirement, Requirement

from turnout import envs, hookspecs

logger = logging.getLogger("turnout")
ENTRY_POINT_GROUP = "turnout"


@dataclass
class PluginInfo:
    name: str
    distribution: str
    version: str
    hooks: list[str] = field(default_factory=list)
    status: str = "loaded"  # or "failed", or "incompatible" (written for another plugin API)
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class HookResult:
    plugin: str
    value: Any = None
    error: str | None = None


class PluginManager:
    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self.unmatched_allow: list[str] = []

    def load_entry_points(self) -> None:
        allow = envs.PLUGINS.value
        seen = set()
        for ep in md.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in seen:
                continue
            seen.add(ep.name)
            if allow is not None and ep.name not in allow:
                continue
            dist = ep.dist.name if ep.dist else "?"
            version = ep.dist.version if ep.dist else "?"
            if (why := api_mismatch(ep.dist)) is not None:
                logger.warning("plugin %s (%s) is not loaded: %s", ep.name, dist, why)
                self.infos[ep.name] = PluginInfo(ep.name, dist, version, [], "incompatible", why)
                continue
            try:
                self.register(ep.load(), ep.name, dist, version)
            except Exception as e:  # a broken plugin must not break the engine
                err = f"{type(e).__name__}: {e}".splitlines()[0]
                logger.warning("plugin %s (%s) failed to load: %s", ep.name, dist, err)
                self.infos[ep.name] = PluginInfo(ep.name, dist, version, [], "failed", err)
        self.unmatched_allow = sorted(allow - seen) if allow is not None else []
        for name in self.unmatched_allow:
            logger.warning("TURNOUT_PLUGINS names '%s', but no installed plugin has that name", name)

    def register(
        self, plugin: ModuleType | object, name: str, dist: str = "(in-process)", version: str = ""
    ) -> None:
        self.pm.register(plugin, name=name)
        hooks = sorted(h.name for h in self.pm.get_hookcallers(plugin) or [])
        self.infos[name] = PluginInfo(name, dist, version, hooks)

    def unregister(self, name: str) -> None:
        self.pm.unregister(name=name)
        self.infos.pop(name, None)

    def call_each(self, hook: str, **kwargs: Any) -> list[HookResult]:
        """Call every implementation of `hook` separately, so each result knows its plugin."""
        results = []
        for impl in getattr(self.pm.hook, hook).get_hookimpls():  # registration order
            fn: Callable[..., Any] = impl.function
            args = {k: kwargs[k] for k in impl.argnames}
            try:
                results.append(HookResult(impl.plugin_name, fn(**args)))
            except Exception as e:
                err = f"{hook} raised {type(e).__name__}: {e}".splitlines()[0]
                logger.warning("plugin %s: %s", impl.plugin_name, err)
                results.append(HookResult(impl.plugin_name, error=err))
        return results

    def listing(self) -> list[PluginInfo]:
        return sorted(self.infos.values(), key=lambda i: i.name)


def api_mismatch(dist: md.Distribution | None) -> str | None:
    """Why a plugin's distribution was written for another plugin API: its requirement on turnout, where
    this turnout's version does not meet it; None where it does, or where it names none."""
    from turnout import PLUGIN_API, __version__

    for line in (dist.requires or []) if dist is not None else []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.name == "turnout" and (not req.marker or req.marker.evaluate()) and req.specifier:
            if not req.specifier.contains(__version__, prereleases=True):
                this = f"turnout {__version__} (plugin API {PLUGIN_API})"
                note = f"what changed, and how to port it: docs/changelog.md, 'Plugin API {PLUGIN_API}'"
                return f"needs turnout{req.specifier}, and this is {this}; {note}"
    return None


_manager: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide manager, loaded from entry points on first use."""
    global _manager
    if _manager is None:
        _manager = PluginManager()
        _manager.load_entry_points()
    return _manager


def declared_env_vars() -> list[envs.EnvVar[Any]]:
    """Every switch the loaded plugins declare through `turnout_env_vars`, in plugin order; a hook that
    raised declares none. Added to turnout.envs.registry() when this module is imported."""
    return [v for res in get_plugin_manager().call_each("turnout_env_vars") for v in res.value or []]


envs.add_source(declared_env_vars)


def reset_plugin_manager() -> None:
    global _manager
    _manager = None
