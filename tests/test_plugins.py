"""Plugin discovery through real entry points, failure recording, the allow-list, in-process plugins."""

from __future__ import annotations

import importlib
import sys

import pytest

from turnout import hookimpl
from turnout.plugins import PORTING, PluginManager

from fake_dist import make_dist, naive_backend_source

IN_REPO = {"cpu", "graphs", "llama", "qwen3", "uniproc"}


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    """Put a folder of fake distributions on sys.path; entry points are read fresh from it."""
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    for mod in ("turnout_fake_ok", "turnout_fake_broken", "turnout_fake_old"):
        sys.modules.pop(mod, None)


def test_in_repo_plugins_load():
    pm = PluginManager()
    pm.load_entry_points()
    loaded = {i.name: i for i in pm.listing()}
    assert IN_REPO <= set(loaded)
    assert loaded["cpu"].hooks == ["turnout_attention_backends"]
    assert loaded["llama"].hooks == ["turnout_model_architectures"]
    assert loaded["uniproc"].hooks == ["turnout_executors"]
    assert loaded["graphs"].hooks == ["turnout_graph_policies"]
    assert all(i.status == "loaded" for n, i in loaded.items() if n in IN_REPO)


def test_fake_distribution_loads_and_broken_one_is_recorded(on_path):
    make_dist(on_path, "turnout-fake-ok", "turnout_fake_ok", naive_backend_source())
    make_dist(on_path, "turnout-fake-broken", "turnout_fake_broken", "import no_such_module_xyz\n")
    pm = PluginManager()
    pm.load_entry_points()
    info = {i.name: i for i in pm.listing()}
    ok, broken = info["turnout_fake_ok"], info["turnout_fake_broken"]
    assert (ok.status, ok.distribution, ok.version, ok.hooks) == (
        "loaded", "turnout-fake-ok", "1.2.3", ["turnout_attention_backends"]
    )  # fmt: skip
    assert broken.status == "failed" and "no_such_module_xyz" in broken.error
    assert broken.distribution == "turnout-fake-broken"
    assert IN_REPO <= {n for n, i in info.items() if i.status == "loaded"}  # loading went on


def test_a_plugin_for_another_api_is_listed_incompatible_not_imported(on_path):
    """Its requirement on turnout says which plugin API it was written for; outside it, the module is never
    imported (it would raise here), and the listing names the versions and the migration note."""
    import turnout

    raises = "raise RuntimeError('imported')\n"
    make_dist(on_path, "turnout-fake-old", "turnout_fake_old", raises, requires="turnout<0.3")
    make_dist(
        on_path, "turnout-fake-ok", "turnout_fake_ok", naive_backend_source(), requires="turnout>=0.3,<0.4"
    )
    pm = PluginManager()
    pm.load_entry_points()
    info = {i.name: i for i in pm.listing()}
    old = info["turnout_fake_old"]
    assert old.status == "incompatible" and "turnout_fake_old" not in sys.modules
    assert old.error == (
        f"needs turnout<0.3, and this is turnout {turnout.__version__} (plugin API {turnout.PLUGIN_API}); "
        f"what changed, and how to port it: {PORTING}"
    )
    assert info["turnout_fake_ok"].status == "loaded"


def test_allow_list(on_path, monkeypatch):
    make_dist(on_path, "turnout-fake-ok", "turnout_fake_ok", naive_backend_source())
    monkeypatch.setenv("TURNOUT_PLUGINS", "cpu, turnout_fake_ok, nosuchplugin")
    pm = PluginManager()
    pm.load_entry_points()
    assert {i.name for i in pm.listing()} == {"cpu", "turnout_fake_ok"}
    assert pm.unmatched_allow == ["nosuchplugin"]
    monkeypatch.setenv("TURNOUT_PLUGINS", "")
    pm = PluginManager()
    pm.load_entry_points()
    assert pm.listing() == []


class _RaisingPlugin:
    @hookimpl
    def turnout_executors(self):
        raise RuntimeError("boom")


def test_in_process_plugin_and_raising_hook(register_plugin, plugin_manager):
    register_plugin(_RaisingPlugin(), "raiser")
    assert "raiser" in {i.name for i in plugin_manager.listing()}
    results = {r.plugin: r for r in plugin_manager.call_each("turnout_executors")}
    assert "boom" in results["raiser"].error
    assert results["uniproc"].error is None and results["uniproc"].value[0].name == "uniproc"


def test_threads_that_ask_at_once_all_get_every_plugin():
    """The server answers /v1/explain in worker threads; the first requests may meet the manager's load."""
    import threading

    from turnout import plugins

    expected = {i.name for i in plugins.get_plugin_manager().listing()}
    for _ in range(5):
        plugins.reset_plugin_manager()
        start, seen = threading.Barrier(4), []

        def ask(start: threading.Barrier = start, seen: list[set[str]] = seen) -> None:
            start.wait()
            seen.append({i.name for i in plugins.get_plugin_manager().listing()})

        threads = [threading.Thread(target=ask) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert seen == [expected] * 4, [expected - s for s in seen]
