"""The environment-switch registry: the core's switches, plugin-declared ones, and config's use of both."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from turnout import EnvVar, envs, hookimpl
from turnout.config import EngineConfig
from turnout.errors import ConfigError

ROOT = Path(__file__).parents[1]


class _Switches:
    @hookimpl
    def turnout_env_vars(self):
        return [EnvVar("TURNOUT_MYPLUGIN_TILES", int, 64, "tile width of my kernels")]


def test_a_plugin_declared_switch_is_not_a_config_key(register_plugin, plugin_manager, monkeypatch):
    monkeypatch.setenv("TURNOUT_MYPLUGIN_TILES", "128")
    with pytest.raises(ConfigError, match="unknown key 'myplugin_tiles' in environment"):
        EngineConfig.load()  # undeclared: taken for a config key, a typo fails loudly
    register_plugin(_Switches(), "myplugin")
    assert EngineConfig.load().max_num_seqs is None  # declared: a switch, not a field
    var = envs.registry()["TURNOUT_MYPLUGIN_TILES"]
    assert var.value == 128
    monkeypatch.delenv("TURNOUT_MYPLUGIN_TILES")
    assert var.value == 64


def test_registry_holds_core_and_bundled_plugins_switches(plugin_manager):
    reg = envs.registry()
    assert {v.name for v in envs.CORE} <= set(reg)
    declared = {r.plugin for r in plugin_manager.call_each("turnout_env_vars") if r.value}
    assert {"ray", "flash_attn", "flashinfer", "triton"} <= declared
    assert "RAY_ADDRESS" in reg and "TURNOUT_FLASH_ATTN" in reg
    assert all(v.doc and "\n" not in v.doc for v in reg.values())


def test_values_parse_with_defaults_and_one_line_errors(monkeypatch):
    monkeypatch.delenv("TURNOUT_PLUGINS", raising=False)
    assert envs.PLUGINS.value is None
    monkeypatch.setenv("TURNOUT_PLUGINS", " cpu, llama ,")
    assert envs.PLUGINS.value == {"cpu", "llama"}
    monkeypatch.setenv("TURNOUT_TRITON_GEMV", "0")
    assert envs.TRITON_GEMV.value is False
    monkeypatch.setenv("TURNOUT_CACHE_DIR", "")
    assert envs.CACHE_DIR.value is None
    bad = EnvVar("TURNOUT_SOME_INT", int, 1, "an integer count")
    monkeypatch.setenv("TURNOUT_SOME_INT", "many")
    with pytest.raises(ConfigError, match=r"^TURNOUT_SOME_INT='many' does not parse .*; an integer count$"):
        _ = bad.value


def test_a_bad_switch_fails_config_on_any_device(monkeypatch):
    """A switch only a CUDA kernel reads is still parsed when the config loads: on the CPU too, a bad value
    is one ConfigError naming it, not ignored."""
    monkeypatch.setenv("TURNOUT_GEMV_TILES", "4096x1024=3,4")
    with pytest.raises(ConfigError, match=r"^TURNOUT_GEMV_TILES='4096x1024=3,4' does not parse"):
        EngineConfig.load()
    monkeypatch.setenv("TURNOUT_GEMV_TILES", "4096x1024=4,4")
    assert EngineConfig.load().max_num_seqs is None
    monkeypatch.setenv("TURNOUT_TRITON_SPLIT_KEYS", "48")  # a plugin's switch: split boundaries of 32 keys
    with pytest.raises(ConfigError, match=r"^TURNOUT_TRITON_SPLIT_KEYS='48' does not parse \(want a posi"):
        EngineConfig.load()


def _sources() -> list[Path]:
    return [p for d in ("core", "plugins") for p in (ROOT / d).rglob("*.py")]


def test_every_turnout_switch_in_the_code_is_declared(plugin_manager):
    """A TURNOUT_ name in core/ or plugins/ is an EngineConfig field or a declared switch."""
    fields = {"TURNOUT_" + f.upper() for f in EngineConfig.model_fields}
    known = fields | set(envs.registry())
    used = {m for p in _sources() for m in re.findall(r"\bTURNOUT_[A-Z][A-Z0-9_]*\b", p.read_text())}
    assert used - known == set()


def test_the_core_reads_turnout_switches_only_through_the_registry():
    readers = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "core").rglob("*.py")
        if re.search(r"environ(\.get)?[\[(]\s*[\"']TURNOUT_", p.read_text())
    }
    assert readers == set()
