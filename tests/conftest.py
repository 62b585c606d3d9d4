from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_tiny_model  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", num_kv_heads=2)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", num_kv_heads=1)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", num_kv_heads=2)


@pytest.fixture
def plugin_manager():
    """A fresh process-wide plugin manager, loaded from the installed entry points."""
    from turnout import plugins

    plugins.reset_plugin_manager()
    pm = plugins.get_plugin_manager()
    yield pm
    plugins.reset_plugin_manager()


@pytest.fixture
def register_plugin(plugin_manager):
    """register_plugin(obj, name): an in-process plugin, unregistered after the test."""
    names = []

    def register(obj: object, name: str) -> None:
        plugin_manager.register(obj, name)
        names.append(name)

    yield register
    for name in names:
        if plugin_manager.pm.has_plugin(name):
            plugin_manager.unregister(name)


@pytest.fixture(autouse=True)
def _quiet_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="turnout")


@pytest.fixture
def triton_kernels(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest):
    """Call it with the functools.cache'd builders of the Triton kernels a test runs: off CUDA they build
    under TRITON_INTERPRET=1, and every builder is cleared before and after the test, so no kernel built
    for the interpreter outlives it. Skips where triton is not installed (the test extra installs it)."""
    pytest.importorskip("triton")

    def use(*builders) -> None:
        if not torch.cuda.is_available():
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        for b in builders:
            b.cache_clear()
            request.addfinalizer(b.cache_clear)

    return use
