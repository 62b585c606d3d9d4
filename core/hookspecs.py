"""Every turnout hook spec. Plugins implement them with `@turnout.hookimpl`.

Lifecycle: the specs are called at engine start-up, during selection (and again in a worker process where
the driver's selection does not travel), never per step. The core calls each plugin's implementation
separately, so every candidate is tagged with the plugin that offered it, and one plugin raising does not
hide the others: it becomes one invalid candidate whose reason is the exception. Selection
(`turnout.selection`) then picks among all plugins' candidates and keeps the reason for every rejection;
`turnout explain` prints them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from turnout.attention import AttentionBackend
    from turnout.envs import EnvVar
    from turnout.executor.base import ExecutorSpec
    from turnout.graphs import GraphPolicy
    from turnout.models import ModelArchitecture
    from turnout.platform import Platform
    from turnout.quantization import QuantizationMethod
    from turnout.structured_outputs import StructuredOutputBackend
    from turnout.tool_parsers.abstract_tool_parser import ToolParser

PROJECT = "turnout"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def turnout_attention_backends(platform: Platform) -> list[AttentionBackend]:
    """Return the attention backends this plugin offers.

    :param platform: the hardware probed once at start-up (device type and count, compute capability,
        dtypes with hardware support).

    Return every backend the plugin has, even one whose kernel library is missing or that cannot serve this
    platform: its `check(ctx)` turns that into reasons, so users see why it is not chosen. Import the kernel
    library lazily (in `import_error()`), never at module import. A backend declares the per-layer features
    its forward serves in `attention_features`. An empty list offers nothing.

    Combine: all plugins' lists are concatenated. A backend named by `attention_backend` must be valid, or
    start-up fails with its reasons; under "auto" the valid backend with the highest priority wins (see
    `Priority`), ties by name, then by plugin name.
    """


@hookspec
def turnout_model_architectures() -> list[ModelArchitecture]:
    """Return the model architectures this plugin provides.

    Each `ModelArchitecture(name, "package.module:Class", priority)` maps an HF `architectures` name of a
    checkpoint's config.json to a class, imported only when chosen. The class must implement
    `turnout.models.CausalLM`: built as `Class(hf_config)` under the engine's default dtype and device, with
    `forward(input_ids, positions, intermediate)`, `compute_logits(hidden)` and `load_weights(weights)`
    returning the names it loaded, and its attention through the core `Attention` layer. A class whose
    layers use per-layer attention features (a sliding window, a logit soft-cap, scales that differ)
    declares them (`attention_features`), so that only backends that serve them are valid. An empty list
    provides nothing.

    Combine: concatenated; the architectures whose name matches the checkpoint's are valid, and among them
    the highest priority wins, ties by plugin name, so a third party at a higher priority replaces a
    bundled class.
    """


@hookspec
def turnout_executors() -> list[ExecutorSpec]:
    """Return the executors (how worker ranks are started and driven) this plugin offers.

    Each `ExecutorSpec` names a class implementing `turnout.executor.Executor`, imported only when chosen,
    and a `check(ctx)` that returns every reason it cannot run `ctx` (world size, platform, whether the user
    named it), empty if it can. An executor whose ranks run in processes of their own declares
    `in_process=False`: only those serve data parallelism on CUDA. Such executors build their ranks with
    `turnout.executor`'s rank bootstrap (`plan_ranks`, `RankWorker`) and add only their transport.
    An empty list offers nothing.

    Combine: concatenated; an executor named by `executor` must be valid, otherwise the valid one with the
    highest priority wins, ties by name, then by plugin name.
    """


@hookspec
def turnout_graph_policies() -> list[GraphPolicy]:
    """Return the CUDA-graph policies this plugin offers, selected by name through `cudagraph_mode`.

    A policy maps a batch (token count, uniform decode or not) to a runtime mode; override
    `GraphPolicy.runtime_mode` for size-dependent rules. An empty list offers nothing.

    Combine: concatenated; names must be unique, and a later duplicate is rejected with a reason. The chosen
    policy is then downgraded to what the chosen attention backend can replay.
    """


@hookspec
def turnout_quantization_methods(platform: Platform) -> list[QuantizationMethod]:
    """Return the quantization methods this plugin offers (`turnout.quantization.QuantizationMethod`).

    :param platform: the hardware probed once at start-up.

    A method declares the checkpoint formats it reads (`checkpoint_formats`, by
    `quantization_config.quant_method`), whether it quantizes an unquantized checkpoint at load
    (`online`), the devices and compute capability it needs, and the layers it replaces (`replaces`).
    Its `check(ctx)` returns every reason it cannot serve a `QuantizationContext`; its
    `linear_method(ctx, names)` gives each linear layer's `LinearMethod` (parameters, loading across
    tensor-parallel shards, the GEMM); where it replaces "moe", `moe_method(ctx, prefix, projections)` each
    FusedMoE's `MoEMethod`; `notes(ctx)` says how each layer kind computes, for `turnout explain`. Return
    every method the plugin has, even one this platform cannot run: `check` turns that into reasons.
    An empty list offers nothing.

    Combine: concatenated. A checkpoint with a `quantization_config` takes the valid method of the highest
    priority (ties by name, then plugin) among those that read its format, and is refused at start-up where
    none is valid; `quantization = NAME` (vLLM's `--quantization`) must name a valid method, and on an
    unquantized checkpoint selects an online one. Neither set: the weights load as they are.
    """


@hookspec
def turnout_env_vars() -> list[EnvVar]:
    """Return the environment switches this plugin reads, each a `turnout.EnvVar(name, parse, default, doc)`.

    A TURNOUT_<NAME> variable that no plugin declares (and the core does not, in `turnout.envs`) is taken
    for an EngineConfig field, so an undeclared switch of yours fails as an unknown config key. Read a
    switch's `.value` when your component starts, never per step. An empty list declares nothing.

    Combine: concatenated with the core's switches into one registry (`turnout.envs.registry()`).
    """


@hookspec
def turnout_tool_parsers() -> list[type[ToolParser]]:
    """Return the tool-call parsers this plugin offers: `turnout.tool_parsers.ToolParser` subclasses, each
    with a unique `name`, chosen by `turnout serve --tool-call-parser NAME`.

    A parser turns a chat completion's text into OpenAI `tool_calls` (`parse`), and does the same as the
    text streams in (`feed`, then `finish`); concatenating the streamed pieces must give what `parse` gives
    for the whole text. An empty list offers nothing.

    Combine: concatenated; names must be unique, and a later duplicate is rejected with a warning.
    """


@hookspec
def turnout_structured_output_backends() -> list[type[StructuredOutputBackend]]:
    """Return the grammar engines this plugin offers for structured outputs (JSON schema, regex, choice,
    EBNF grammar): `turnout.structured_outputs.StructuredOutputBackend` subclasses with a unique `name`.

    A backend compiles a request's constraint once (`compile`, cached by the engine) into a grammar whose
    matchers fill a token bitmask on the host and accept each sampled token. Report a missing library from
    `import_error()`, importing it lazily. An empty list offers nothing.

    Combine: concatenated; `structured_outputs_backend` names one (it must be usable), "auto" takes the
    usable backend of the highest `priority`, ties by name.
    """
