"""Plugin discovery: every `turnout` entry point, import failures recorded, not fatal.

A plugin written for another plugin API is listed as "incompatible", with the reason and the changelog
section on porting it (`PORTING`), and offers nothing to selection:
- one whose distribution's requirement on turnout (`dependencies = ["turnout>=0.2,<0.3"]`) this turnout
  does not meet is not imported;
- one that pins nothing, or a version this turnout meets, is imported, and each component its hooks return
  is compared with its kind's contract by shape (`turnout.plugin_shapes`), without running it: a component
  that does not fit makes the plugin incompatible. Asking for one of its components by name is refused
  naming the plugin and why (`PluginManager.why_withheld`).

TURNOUT_PLUGINS is an allow-list of entry-point names: unset loads all, empty loads none.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any

import pluggy
from packaging.requirements import InvalidRequirement, Requirement

from turnout import envs, hookspecs
from turnout.version import PLUGIN_API, __version__

logger = logging.getLogger("turnout")
ENTRY_POINT_GROUP = "turnout"
# The changelog's section on porting a plugin to this plugin API, named by every "incompatible" reason.
PORTING = "docs/changelog.md, 'Plugin API 3 (turnout 0.3.0)' > 'Porting a plugin from API 2 (turnout 0.2)'"
# What each hook's results are checked with: (hook, component) -> what keeps it from fitting its kind's
# contract, one phrase naming it, or None. The package installs turnout.plugin_shapes.misfit
# (set_shape_check), which this layer cannot import: the contracts sit above it.
ShapeCheck = Callable[[str, Any], "str | None"]
_shape_check: ShapeCheck = lambda hook, item: None  # noqa: E731


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
        self.withheld: dict[str, dict[str, list[str]]] = {}  # incompatible plugin -> hook -> names offered

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
                self.withhold_misfits(ep.name)
            except Exception as e:  # a broken plugin must not break the engine
                if self.pm.has_plugin(ep.name):
                    self.pm.unregister(name=ep.name)
                err = f"{type(e).__name__}: {e}".splitlines()[0]
                logger.warning("plugin %s (%s) failed to load: %s", ep.name, dist, err)
                self.infos[ep.name] = PluginInfo(ep.name, dist, version, [], "failed", err)
        self.unmatched_allow = sorted(allow - seen) if allow is not None else []
        for name in self.unmatched_allow:
            logger.warning("TURNOUT_PLUGINS names '%s', but no installed plugin has that name", name)

    def register(
        self, plugin: ModuleType | object, name: str, dist: str = "(in-process)", version: str = ""
    ) -> None:
        """Register plugin under name as it is: an in-process plugin (a test's fake) is not checked by
        shape; installed ones are, as they load (withhold_misfits)."""
        self.pm.register(plugin, name=name)
        hooks = sorted(h.name for h in self.pm.get_hookcallers(plugin) or [])
        self.infos[name] = PluginInfo(name, dist, version, hooks)

    def withhold_misfits(self, name: str) -> None:
        """Check each component plugin `name`'s hooks return against its kind's contract; where one does not
        fit, unregister the plugin again, listed "incompatible", and keep what it offered by name."""
        offered, misfit = self._offers(name)
        if misfit is None:
            return
        info = self.infos[name]
        api = f"written for another plugin API than {PLUGIN_API}"
        why = f"{api}: {misfit}; what changed, and how to port it: {PORTING}"
        logger.warning("plugin %s (%s) is not loaded: %s", name, info.distribution, why)
        self.pm.unregister(name=name)
        self.infos[name] = PluginInfo(name, info.distribution, info.version, info.hooks, "incompatible", why)
        self.withheld[name] = offered

    def _offers(self, name: str) -> tuple[dict[str, list[str]], str | None]:
        """hook -> the names of the components plugin `name` returns, and the first one's misfit. A hook that
        raises offers nothing here (selection reports it)."""
        from turnout.platform import current_platform

        offered: dict[str, list[str]] = {}
        misfit = None
        for hook in self.infos[name].hooks:
            for impl in getattr(self.pm.hook, hook).get_hookimpls():
                if impl.plugin_name != name:
                    continue
                args = {"platform": current_platform()} if "platform" in impl.argnames else {}
                try:
                    items = list(impl.function(**args) or [])
                except Exception:
                    continue
                for item in items:
                    offered.setdefault(hook, []).append(str(getattr(item, "name", item)))
                    misfit = misfit or _shape_check(hook, item)
        return offered, misfit

    def unregister(self, name: str) -> None:
        if self.pm.has_plugin(name):
            self.pm.unregister(name=name)
        self.infos.pop(name, None)
        self.withheld.pop(name, None)

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

    def withheld_offers(self, hook: str) -> list[tuple[str, str, str]]:
        """(name, plugin, why) for each component an incompatible plugin's `hook` returned: none is offered
        to selection, and `why` names the plugin, what does not fit and the changelog section."""
        return [
            (n, p, f"plugin {p} is incompatible: {self.infos[p].error}")
            for p, hooks in self.withheld.items()
            for n in hooks.get(hook, [])
        ]

    def why_withheld(self, hook: str, name: str) -> str | None:
        """Why no plugin offers a component called `name` through `hook` where an incompatible one does;
        None where none does."""
        return next((why for n, _, why in self.withheld_offers(hook) if n == name), None)


def api_mismatch(dist: md.Distribution | None) -> str | None:
    """Why a plugin's distribution was written for another plugin API: its requirement on turnout, where
    this turnout's version does not meet it; None where it does, or where it names none."""
    for line in (dist.requires or []) if dist is not None else []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.name == "turnout" and (not req.marker or req.marker.evaluate()) and req.specifier:
            if not req.specifier.contains(__version__, prereleases=True):
                this = f"turnout {__version__} (plugin API {PLUGIN_API})"
                port = f"what changed, and how to port it: {PORTING}"
                return f"needs turnout{req.specifier}, and this is {this}; {port}"
    return None


def set_shape_check(check: ShapeCheck) -> None:
    """Check every component a plugin's hooks return with check(hook, component) from now on; the package
    installs turnout.plugin_shapes.misfit."""
    global _shape_check
    _shape_check = check


_manager: PluginManager | None = None
_loading = threading.RLock()  # other threads wait for the whole load; a plugin's import may ask again


def get_plugin_manager() -> PluginManager:
    """The process-wide manager, loaded from entry points on first use; safe to call from any thread."""
    global _manager
    with _loading:
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
    with _loading:
        _manager = None
