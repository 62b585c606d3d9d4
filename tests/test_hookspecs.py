"""Every hook spec must be exercised by some test, and every spec must be typed and documented."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from turnout import hookspecs

SPECS = sorted(
    name for name, fn in vars(hookspecs).items() if name.startswith("turnout_") and inspect.isfunction(fn)
)
TEST_TEXT = {
    p.name: p.read_text() for p in Path(__file__).parent.glob("test_*.py") if p.name != Path(__file__).name
}


def test_the_plugin_kinds_and_env_switches():
    assert SPECS == [
        "turnout_attention_backends",
        "turnout_env_vars",
        "turnout_executors",
        "turnout_graph_policies",
        "turnout_model_architectures",
        "turnout_quantization_methods",
        "turnout_structured_output_backends",
        "turnout_tool_parsers",
    ]


@pytest.mark.parametrize("spec", SPECS)
def test_spec_is_typed_documented_and_prefixed(spec: str):
    """pytest's standard: typed; the docstring says what to return, what empty means, how results combine,
    and has a :param: line per argument."""
    fn = getattr(hookspecs, spec)
    sig = inspect.signature(fn)
    doc = inspect.getdoc(fn) or ""
    assert sig.return_annotation is not inspect.Signature.empty, f"{spec} has no return type"
    assert all(p.annotation is not inspect.Parameter.empty for p in sig.parameters.values())
    assert doc.startswith("Return "), f"{spec}'s docstring must open with what to return"
    assert "An empty list" in doc, f"{spec}'s docstring must say what an empty result means"
    assert "Combine:" in doc, f"{spec}'s docstring must say how results combine"
    for name in sig.parameters:
        assert f":param {name}:" in doc, f"{spec}'s docstring has no :param {name}:"


def test_model_spec_names_the_class_contract():
    doc = inspect.getdoc(hookspecs.turnout_model_architectures) or ""
    assert "CausalLM" in doc and "load_weights" in doc and "compute_logits" in doc


@pytest.mark.parametrize("spec", SPECS)
def test_spec_has_a_test(spec: str):
    """A test file must implement the hook (def <spec>) or call it by name through the plugin manager."""
    pattern = re.compile(rf"def {spec}\(|[\"']{spec}[\"']")
    users = [name for name, text in TEST_TEXT.items() if pattern.search(text)]
    assert users, f"hook spec {spec} is not exercised by any test: add one"
