from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_tiny_model  # noqa: E402


def _import_triton_for_the_interpreter() -> None:
    """Off CUDA, import triton under TRITON_INTERPRET=1 before any test can: triton builds its own library's
    jit functions (tl.sum, ...) for the interpreter or not on its first import, once, and a kernel built
    for the interpreter later fails in them otherwise. The variable is then left to the tests that set it."""
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    except ImportError:  # the test extra installs triton; tests that need it skip without
        pass
    finally:
        if prev is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = prev


if not torch.cuda.is_available():
    _import_triton_for_the_interpreter()


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
    if not torch.cuda.is_available():  # before triton's first import, which reads it
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")

    def use(*builders) -> None:
        if not torch.cuda.is_available():
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        for b in builders:
            b.cache_clear()
            request.addfinalizer(b.cache_clear)

    return use


@pytest.fixture(scope="session")
def hermes_smol(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded SmolLM2-135M-Instruct with a tool-aware (Hermes-style) chat template: its own has no
    tools. The weights are links to the embedded model's."""
    from turnout.loader.default_model import default_model_path

    src, dst = default_model_path(), tmp_path_factory.mktemp("hermes_smol")
    for f in src.iterdir():
        if f.name != "chat_template.jinja":
            (dst / f.name).symlink_to(f)
    (dst / "chat_template.jinja").write_text(
        (Path(__file__).parent / "data/hermes_chat_template.jinja").read_text()
    )
    return dst


@pytest.fixture(scope="session")
def agent_server(tmp_path_factory: pytest.TempPathFactory, hermes_smol: Path):
    """`turnout serve` on hermes_smol with the hermes tool-call parser, served as "agent"."""
    from test_server import KEY, Server

    args = ["--max-model-len", "1024", "--cpu-kv-cache-bytes", str(96 << 20), "--api-key", KEY]
    args += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--served-model-name", "agent"]
    server = Server(tmp_path_factory.mktemp("agent_server"), str(hermes_smol), *args)
    try:
        yield server
    finally:
        server.stop()
