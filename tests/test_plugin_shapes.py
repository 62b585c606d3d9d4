"""Plugins checked by shape at load: a component of another plugin API's shape makes its plugin
"incompatible" (named with the changelog section), pinned or not, and it never reaches an engine.

For every kind, one installed plugin (pinning no version, as `dependencies = ["turnout"]` does) returns a
component of this plugin API's shape, which loads, and one of another shape, which does not. Where the
contract changed (API 3: the attention backend in three parts; API 2: the executor's sampling) the other
shape is the earlier API's; where it did not (models, graph policies) or the kind came with API 2 (tool
parsers, structured outputs, quantization), it is the shape vLLM gives the same component, as a plugin
ported from vLLM would have it.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from turnout import PLUGIN_API, hookspecs, plugin_shapes, plugins
from turnout.plugin_shapes import CONTRACTS, read_class

from fake_dist import make_dist, naive_backend_source

ROOT = Path(__file__).parents[1]
HEAD = "import torch\nimport turnout\n"

OTHER = {  # kind: (hook, component name, module source, class module source or None)
    "attention": (
        "turnout_attention_backends",
        "hidden_sdpa",
        HEAD + "from turnout.attention import AttentionBackend\n\n"
        "class HiddenSDPABackend(AttentionBackend):  # plugin API 2's: one class that attends\n"
        "    name = 'hidden_sdpa'\n"
        "    priority = 100  # above every bundled backend: 'auto' would take it, were it offered\n"
        "    device_types = ('cpu', 'cuda')\n"
        "    dtypes = (torch.float32, torch.bfloat16)\n\n"
        "    def build_metadata(self, meta):\n"
        "        return None\n\n"
        "    def forward(self, q, k, v, kv_cache, meta, layer=None):\n"
        "        raise RuntimeError('hidden_sdpa ran')\n\n"
        "@turnout.hookimpl\n"
        "def turnout_attention_backends(platform):\n"
        "    return [HiddenSDPABackend()]\n",
        None,
    ),
    "model": (
        "turnout_model_architectures",
        "OldForCausalLM",
        "import turnout\nfrom turnout.models import ModelArchitecture\n\n"
        "@turnout.hookimpl\n"
        "def turnout_model_architectures():\n"
        "    target = 'turnout_fake_model_other_cls:OldForCausalLM'\n"
        "    return [ModelArchitecture('OldForCausalLM', target, 100)]\n",
        "from torch import nn\n\n"
        "class OldForCausalLM(nn.Module):  # vLLM 0.x's: caches passed in, logits given sampling metadata\n"
        "    def forward(self, input_ids, positions, kv_caches, attn_metadata): ...\n"
        "    def compute_logits(self, hidden_states, sampling_metadata): ...\n"
        "    def load_weights(self, weights): ...\n",
    ),
    "executor": (
        "turnout_executors",
        "old_exec",
        "import turnout\nfrom turnout.executor import ExecutorSpec\n\n"
        "@turnout.hookimpl\n"
        "def turnout_executors():\n"
        "    return [ExecutorSpec('old_exec', 'turnout_fake_executor_other_cls:OldExecutor', 100)]\n",
        "from turnout.executor import Executor\n\n"
        "class OldExecutor(Executor):  # plugin API 1's: no grammar in sampling or in step\n"
        "    def __init__(self, config, selection): ...\n"
        "    def execute_model(self, scheduler_output): ...\n"
        "    def sample_tokens(self): ...\n"
        "    def collective_rpc(self, method, args=(), kwargs=None): ...\n"
        "    def step(self, scheduler_output):\n"
        "        self.execute_model(scheduler_output)\n"
        "        return self.sample_tokens()\n",
    ),
    "graph": (
        "turnout_graph_policies",
        "OLD_GRAPHS",
        "import turnout\nfrom turnout.graphs import GraphPolicy, RuntimeMode\n\n"
        "class DescriptorPolicy(GraphPolicy):  # vLLM's dispatch: one batch descriptor\n"
        "    def runtime_mode(self, batch_descriptor):\n"
        "        return self.decode\n\n"
        "@turnout.hookimpl\n"
        "def turnout_graph_policies():\n"
        "    return [DescriptorPolicy('OLD_GRAPHS', RuntimeMode.FULL, RuntimeMode.NONE, 100)]\n",
        None,
    ),
    "tool_parser": (
        "turnout_tool_parsers",
        "old_json",
        "import turnout\nfrom turnout.tool_parsers import ToolParser\n\n"
        "class OldJsonParser(ToolParser):  # vLLM's: extract_tool_calls[_streaming]\n"
        "    name = 'old_json'\n"
        "    def extract_tool_calls(self, model_output, request): ...\n"
        "    def extract_tool_calls_streaming(self, previous_text, current_text, request): ...\n\n"
        "@turnout.hookimpl\n"
        "def turnout_tool_parsers():\n"
        "    return [OldJsonParser]\n",
        None,
    ),
    "structured_outputs": (
        "turnout_structured_output_backends",
        "old_grammar",
        "import turnout\nfrom turnout.structured_outputs import StructuredOutputBackend\n\n"
        "class OldGrammarBackend(StructuredOutputBackend):  # vLLM's: compile_grammar and co.\n"
        "    name = 'old_grammar'\n"
        "    priority = 100\n"
        "    def compile_grammar(self, request_type, grammar_spec): ...\n"
        "    def allocate_token_bitmask(self, max_num_seqs): ...\n\n"
        "@turnout.hookimpl\n"
        "def turnout_structured_output_backends():\n"
        "    return [OldGrammarBackend]\n",
        None,
    ),
    "quantization": (
        "turnout_quantization_methods",
        "old_quant",
        "import turnout\nfrom turnout.quantization import QuantizationMethod\n\n"
        "class OldQuant(QuantizationMethod):  # vLLM's QuantizationConfig: get_quant_method\n"
        "    name = 'old_quant'\n"
        "    online = True\n"
        "    def get_quant_method(self, layer, prefix): ...\n\n"
        "@turnout.hookimpl\n"
        "def turnout_quantization_methods(platform):\n"
        "    return [OldQuant()]\n",
        None,
    ),
}
MISFIT = {  # kind: what the listing says does not fit
    "attention": "attention backend 'hidden_sdpa': HiddenSDPABackend defines forward() and no impl_cls: "
    "plugin API 3 moved a layer's forward to an AttentionImpl",
    "model": "model architecture 'OldForCausalLM': OldForCausalLM.compute_logits(hidden_states, "
    "sampling_metadata) cannot take the call compute_logits(hidden); OldForCausalLM.forward(input_ids, "
    "positions, kv_caches, attn_metadata) cannot take the call forward(input_ids, positions)",
    "executor": "executor 'old_exec': OldExecutor.sample_tokens() cannot take the call "
    "sample_tokens(grammar_output); OldExecutor.step(scheduler_output) cannot take the call "
    "step(scheduler_output, grammar)",
    "graph": "graph policy 'OLD_GRAPHS': DescriptorPolicy.runtime_mode(batch_descriptor) cannot take the "
    "call runtime_mode(num_tokens, uniform_decode)",
    "tool_parser": "tool-call parser 'old_json': OldJsonParser does not implement feed(); OldJsonParser does "
    "not implement finish()",
    "structured_outputs": "structured-output backend 'old_grammar': OldGrammarBackend does not implement "
    "compile(); OldGrammarBackend does not implement matcher()",
    "quantization": "quantization method 'old_quant': OldQuant does not implement linear_method()",
}
CURRENT = {  # kind: (component name, module source, class module source or None), of this API's shape
    "attention": ("naive", naive_backend_source(), None),
    "model": (
        "NewForCausalLM",
        "import turnout\nfrom turnout.models import ModelArchitecture\n\n"
        "@turnout.hookimpl\n"
        "def turnout_model_architectures():\n"
        "    return [ModelArchitecture('NewForCausalLM', 'turnout_fake_model_api2_cls:NewForCausalLM')]\n",
        "from turnout.models import DecoderForCausalLM\n\n"
        "class NewForCausalLM(DecoderForCausalLM):\n"
        "    pass\n",
    ),
    "executor": (
        "new_exec",
        "import turnout\nfrom turnout.executor import ExecutorSpec\n\n"
        "@turnout.hookimpl\n"
        "def turnout_executors():\n"
        "    return [ExecutorSpec('new_exec', 'turnout_fake_executor_api2_cls:NewExecutor', -100)]\n",
        "from turnout.executor import Executor\n\n"
        "class NewExecutor(Executor):\n"
        "    def execute_model(self, scheduler_output): ...\n"
        "    def sample_tokens(self, grammar_output=None): ...\n"
        "    def collective_rpc(self, method, args=(), kwargs=None): ...\n",
    ),
    "graph": (
        "FULL_UP_TO_64",
        "import turnout\nfrom turnout.graphs import GraphPolicy, RuntimeMode\n\n"
        "class UpTo64(GraphPolicy):\n"
        "    def runtime_mode(self, num_tokens, uniform_decode):\n"
        "        return self.decode if num_tokens <= 64 else RuntimeMode.NONE\n\n"
        "@turnout.hookimpl\n"
        "def turnout_graph_policies():\n"
        "    return [UpTo64('FULL_UP_TO_64', RuntimeMode.FULL, RuntimeMode.FULL)]\n",
        None,
    ),
    "tool_parser": (
        "new_json",
        "import turnout\nfrom turnout.tool_parsers import DeltaMessage, ToolParser\n\n"
        "class NewJsonParser(ToolParser):\n"
        "    name = 'new_json'\n"
        "    def feed(self, delta):\n"
        "        return DeltaMessage(delta, [])\n"
        "    def finish(self):\n"
        "        return DeltaMessage('', [])\n\n"
        "@turnout.hookimpl\n"
        "def turnout_tool_parsers():\n"
        "    return [NewJsonParser]\n",
        None,
    ),
    "structured_outputs": (
        "new_grammar",
        "import turnout\nfrom turnout.structured_outputs import StructuredOutputBackend\n\n"
        "class NewGrammarBackend(StructuredOutputBackend):\n"
        "    name = 'new_grammar'\n"
        "    priority = -100\n"
        "    def compile(self, kind, spec): ...\n"
        "    def matcher(self, compiled): ...\n\n"
        "@turnout.hookimpl\n"
        "def turnout_structured_output_backends():\n"
        "    return [NewGrammarBackend]\n",
        None,
    ),
    "quantization": (
        "new_quant",
        "import turnout\nfrom turnout.quantization import QuantizationMethod\n\n"
        "class NewQuant(QuantizationMethod):\n"
        "    name = 'new_quant'\n"
        "    online = True\n"
        "    def linear_method(self, ctx, checkpoint_names):\n"
        "        return None\n\n"
        "@turnout.hookimpl\n"
        "def turnout_quantization_methods(platform):\n"
        "    return [NewQuant()]\n",
        None,
    ),
}
EXTRA = {  # more plugins of another shape: API 2's backend pinned to API 3, API 1's, and vLLM's split
    "turnout_fake_pinned": (
        "turnout>=0.3,<0.4",
        OTHER["attention"][2].replace("hidden_sdpa", "pinned_sdpa"),
        "attention backend 'pinned_sdpa': HiddenSDPABackend defines forward() and no impl_cls: plugin API 3 "
        "moved a layer's forward to an AttentionImpl",
    ),
    "turnout_fake_api1": (
        "turnout",
        OTHER["attention"][2]
        .replace("hidden_sdpa", "api1_sdpa")
        .replace(
            "forward(self, q, k, v, kv_cache, meta, layer=None)",
            "forward(self, layer, q, k, v, kv_cache, meta)",
        ),
        "attention backend 'api1_sdpa': HiddenSDPABackend defines forward() and no impl_cls: plugin API 3 "
        "moved a layer's forward to an AttentionImpl",
    ),
    "turnout_fake_split": (
        "turnout",
        HEAD + "from turnout.attention import AttentionBackend\n\n"
        "class SplitBackend(AttentionBackend):  # vLLM's: a builder and a per-layer implementation\n"
        "    name = 'split'\n"
        "    device_types = ('cpu',)\n"
        "    dtypes = (torch.float32,)\n"
        "    def get_builder_cls(self): ...\n"
        "    def get_impl_cls(self): ...\n\n"
        "@turnout.hookimpl\n"
        "def turnout_attention_backends(platform):\n"
        "    return [SplitBackend()]\n",
        "attention backend 'split': declares no impl_cls",
    ),
}
BY_NAME = {  # kind: the command that names the other shape's component
    "attention": ["explain", "--attention-backend", "hidden_sdpa"],
    "model": ["explain"],  # on a checkpoint of architecture OldForCausalLM
    "executor": ["explain", "--executor", "old_exec"],
    "graph": ["explain", "--cudagraph-mode", "OLD_GRAPHS"],
    "tool_parser": ["serve", "--tool-call-parser", "old_json"],
    "structured_outputs": ["generate", "--structured-outputs-backend", "old_grammar", "--prompt", "w1"],
    "quantization": ["explain", "--quantization", "old_quant"],
}


def _write(root: Path, module: str, source: str, cls_source: str | None, requires: str = "turnout") -> None:
    make_dist(root, module.replace("_", "-"), module, source, requires=requires)
    if cls_source is not None:
        (root / f"{module}_cls.py").write_text(cls_source)


def _example_dist(root: Path, example: str) -> None:
    """An examples/ plugin as installed: its dist-info here, its package on sys.path."""
    project = (ROOT / "examples" / example / "pyproject.toml").read_text()
    ep = re.search(r"\[project\.entry-points\.turnout\]\n(\S+) = \"(\S+)\"", project)
    info = root / f"{example.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {example}\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text(f"[turnout]\n{ep[1]} = {ep[2]}\n")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Every fake plugin and the examples/ plugins installed; the process-wide manager loaded from them."""
    root = tmp_path_factory.mktemp("dists")
    for kind, (_, _, source, cls_source) in OTHER.items():
        _write(root, f"turnout_fake_{kind}_other", source, cls_source)
    for kind, (_, source, cls_source) in CURRENT.items():
        _write(root, f"turnout_fake_{kind}_api2", source, cls_source)
    for module, (requires, source, _) in EXTRA.items():
        _write(root, module, source, None, requires)
    examples = sorted(p.name for p in (ROOT / "examples").iterdir() if (p / "pyproject.toml").is_file())
    for example in examples:
        _example_dist(root, example)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TURNOUT_PLUGINS", raising=False)
        for path in [root, *(ROOT / "examples" / e for e in examples)]:
            mp.syspath_prepend(str(path))
        importlib.invalidate_caches()
        plugins.reset_plugin_manager()
        yield plugins.get_plugin_manager()
        plugins.reset_plugin_manager()
    for name in [m for m in sys.modules if m.startswith(("turnout_fake_", "turnout_example_"))]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def listing(installed):
    return {i.name: i for i in installed.listing()}


def test_every_kind_is_checked_and_covered_here():
    """Every hook that returns components (all but turnout_env_vars, which declares switches) has a contract
    to check them by, and every kind has, above, a plugin of another shape, one of API 2's and a command
    that names the former."""
    specs = {n for n, f in vars(hookspecs).items() if n.startswith("turnout_") and inspect.isfunction(f)}
    components = specs - {"turnout_env_vars"}
    assert set(CONTRACTS) == components
    assert {hook for hook, *_ in OTHER.values()} == components
    assert set(CURRENT) == set(MISFIT) == set(BY_NAME) == set(OTHER)


@pytest.mark.parametrize("kind", OTHER)
def test_another_apis_shape_is_incompatible_and_this_apis_loads(kind, installed, listing):
    hook, name, _, cls_source = OTHER[kind]
    other, current = listing[f"turnout_fake_{kind}_other"], listing[f"turnout_fake_{kind}_api2"]
    assert other.status == "incompatible"
    assert other.error == (
        f"written for another plugin API than {PLUGIN_API}: {MISFIT[kind]}; "
        f"what changed, and how to port it: {plugins.PORTING}"
    )
    assert current.status == "loaded" and current.hooks == [hook]
    offered = {item.name for r in installed.call_each(hook, platform=_platform()) for item in r.value or []}
    assert CURRENT[kind][0] in offered and name not in offered
    assert (name, other.name) in {(n, p) for n, p, _ in installed.withheld_offers(hook)}
    assert f"turnout_fake_{kind}_other_cls" not in sys.modules  # a target is read, never imported


@pytest.mark.parametrize("module", EXTRA)
def test_a_pinned_plugin_is_checked_too_and_a_missing_method_named(module, listing):
    assert listing[module].status == "incompatible"
    assert listing[module].error.startswith(
        f"written for another plugin API than {PLUGIN_API}: {EXTRA[module][2]};"
    )


def test_the_reasons_name_this_apis_porting_section_of_the_changelog():
    """PORTING names the changelog's newest "Plugin API N" section, for this API, and its porting part."""
    text = (ROOT / "docs/changelog.md").read_text()
    newest = re.search(r"^## (Plugin API (\d+) .*)$", text, re.M)
    porting = re.search(r"^### (Porting a plugin from API .*)$", text[newest.end() :], re.M)
    assert int(newest[2]) == PLUGIN_API
    assert plugins.PORTING == f"docs/changelog.md, '{newest[1]}' > '{porting[1]}'"


@pytest.mark.parametrize("kind", BY_NAME)
def test_naming_a_withheld_component_is_one_line_exit_2(kind, installed, tiny_llama, tmp_path, capsys):
    from turnout import cli

    model = tiny_llama
    if kind == "model":
        model = shutil.copytree(tiny_llama, tmp_path / "old")
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "architectures": ["OldForCausalLM"]}))
    capsys.readouterr()
    assert cli.main([*BY_NAME[kind], "--model", str(model)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("WARNING")]
    plugin = f"turnout_fake_{kind}_other"
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert f"plugin {plugin} is incompatible: written for another plugin API than {PLUGIN_API}" in err[0]
    assert MISFIT[kind] in err[0] and plugins.PORTING in err[0]


def test_no_withheld_component_reaches_a_running_engine(installed, tiny_llama, capsys):
    """Backend and executor of another shape outrank every bundled one: offered, "auto" would run them."""
    from turnout import cli

    argv = ["generate", "--model", str(tiny_llama), "--prompt", "w1 w2", "--max-tokens", "2", "--json"]
    capsys.readouterr()
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert "hidden_sdpa ran" not in capsys.readouterr().err
    assert "turnout_fake_executor_other_cls" not in sys.modules
    assert cli.main(["explain", "--json", "--model", str(tiny_llama)]) == 0
    kinds = json.loads(capsys.readouterr().out)["kinds"]
    assert (kinds["attention"]["chosen"], kinds["executor"]["chosen"]) == ("cpu", "uniproc")
    hidden = next(c for c in kinds["attention"]["candidates"] if c["name"] == "hidden_sdpa")
    assert not hidden["valid"] and hidden["reasons"][0].startswith("plugin turnout_fake_attention_other is")


def test_the_check_predicts_the_core_calls_failure(installed):
    """What the check reports is the error the core's own call raises: the model runner's making of a
    layer's impl from a backend of API 2's shape, and the engine's step call of an executor of API 1's
    shape."""
    backend = importlib.import_module("turnout_fake_attention_other").HiddenSDPABackend()
    with pytest.raises(AttributeError, match="impl_cls"):
        backend.make_impl("spec", "layer")
    namespace: dict = {}
    exec(OTHER["executor"][3], namespace)  # the class module, never imported as a module
    with pytest.raises(TypeError, match="takes 2 positional arguments but 3 were given"):
        namespace["OldExecutor"](None, None).step("scheduler_output", lambda: None)


def test_bundled_and_example_plugins_fit(installed, listing):
    """Every installed plugin of this repository and every examples/ plugin loads; each component fits."""
    ours = {i.name for i in listing.values() if not i.name.startswith("turnout_fake_")}
    assert {"cpu", "triton", "llama", "uniproc", "ray", "graphs", "tool_parsers", "xgrammar", "fp8"} <= ours
    assert {"example_backend", "example_model", "example_gemma2"} <= ours
    assert {n: listing[n].status for n in ours} == dict.fromkeys(ours, "loaded")
    for hook in CONTRACTS:
        for res in installed.call_each(hook, platform=_platform()):
            for item in res.value or []:
                assert plugin_shapes.misfit(hook, item) is None, (res.plugin, item)


def test_a_target_class_read_from_source_has_its_imported_signatures(installed):
    """Each bundled and example model and executor class, read without importing it, has the methods the
    imported class has, with the same signatures."""
    targets = [
        (hook, item.target)
        for hook in ("turnout_model_architectures", "turnout_executors")
        for res in installed.call_each(hook)
        for item in res.value
        if not res.plugin.startswith("turnout_fake_")
    ]
    assert len(targets) >= 10
    for hook, target in targets:
        module, _, name = target.partition(":")
        read = read_class(module, name)
        assert read is not None, target
        cls = getattr(importlib.import_module(module), name)
        for method in CONTRACTS[hook].target.methods:
            imported = inspect.getattr_static(cls, method, None)
            if imported is None or imported is read.get(method):  # absent both ways, or the same base's
                assert method not in read or imported is not None, (target, method)
                continue
            got, expected = (plugin_shapes.call_signature(a) for a in (read[method], imported))
            assert _names(got) == _names(expected), (target, method)


def _names(sig: inspect.Signature) -> list[tuple[str, object, bool]]:
    return [(p.name, p.kind, p.default is inspect.Parameter.empty) for p in sig.parameters.values()]


def _platform():
    from turnout.platform import current_platform

    return current_platform()
