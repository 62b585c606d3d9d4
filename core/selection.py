"""Selection, devpi/conda style: ask every plugin, collect every candidate, pick in the core, and keep
the reason for every rejection so `turnout explain` can show it."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from turnout.attention.backend import AttentionBackend, AttentionContext
from turnout.attention.per_phase import PerPhaseBackend, split_name
from turnout.config import EngineConfig
from turnout.defaults import fit_defaults
from turnout.errors import ConfigError, SelectionError
from turnout.executor.base import ExecutorContext, ExecutorSpec
from turnout.graphs.modes import GraphPolicy, RuntimeMode, downgrade
from turnout.layers.moe import (
    MoEContext,
    MoEKernel,
    describe_placement,
    graph_blocker,
    moe_kernels,
    num_experts,
)
from turnout.models.info import ModelInfo
from turnout.models.registry import ModelArchitecture
from turnout.platform import Platform, current_platform
from turnout.plugins import PluginManager, get_plugin_manager
from turnout.quantization import KNOWN_FORMATS, QuantizationContext

logger = logging.getLogger("turnout")

KIND_LABELS = {
    "attention": "attention backend",
    "model": "model architecture",
    "executor": "executor",
    "graph": "graph policy",
    "moe": "MoE kernel",
    "quantization": "quantization method",
}
CONFIG_KEYS = {  # what names the candidate to use
    "attention": "attention_backend",
    "model": "the checkpoint's architectures",
    "executor": "executor",
    "graph": "cudagraph_mode",
    "moe": "moe_kernel",
    "quantization": "quantization",
}


@dataclass
class Candidate:
    kind: str
    name: str
    plugin: str
    priority: int
    reasons: list[str]  # why it cannot serve; empty: valid
    obj: Any = None
    chosen: bool = False

    @property
    def valid(self) -> bool:
        return not self.reasons

    @property
    def rank(self) -> tuple[int, str, str]:
        """The sort key of the hookspecs' promise: highest priority first, ties by name, then by plugin."""
        return -self.priority, self.name, self.plugin

    @property
    def mixed_priority(self) -> int:
        """The rank for mixed and prefill steps: the backend's mixed_priority, else priority."""
        p = getattr(self.obj, "mixed_priority", None)
        return self.priority if p is None else int(p)

    @property
    def mixed_rank(self) -> tuple[int, str, str]:
        """rank, by mixed_priority."""
        return -self.mixed_priority, self.name, self.plugin

    def as_dict(self) -> dict[str, Any]:
        keys = ("name", "plugin", "priority", "valid", "reasons", "chosen")
        return {k: getattr(self, k) for k in keys}


class Loss(enum.Enum):
    """Why a valid candidate was not chosen."""

    NOT_REQUESTED = "not requested"  # the config named another
    PRIORITY = "lower priority"
    NAME = "same priority, its name sorts after"
    PLUGIN = "same name and priority, its plugin sorts after"


@dataclass
class Choice:
    kind: str
    requested: str
    candidates: list[Candidate]
    chosen: Candidate
    phases: dict[str, Candidate] = field(default_factory=dict)  # per-phase attention: phase -> its half
    note: str = ""  # the backends "auto" passed over for mixed steps, and why

    @property
    def obj(self) -> Any:
        return self.chosen.obj

    def loss(self, c: Candidate) -> Loss | None:
        """Why valid candidate c lost to the chosen one; None for the chosen, a per-phase half and invalid
        candidates."""
        w = self.chosen
        if c is w or not c.valid or c in self.phases.values():
            return None
        if c.name != self.requested and self.requested != "auto":
            return Loss.NOT_REQUESTED
        if c.priority != w.priority:
            return Loss.PRIORITY
        return Loss.NAME if c.name != w.name else Loss.PLUGIN

    def why_lost(self, c: Candidate) -> str:
        """loss(c) in words, e.g. "priority -5 < cpu 0"; empty where c did not lose."""
        w, loss = self.chosen, self.loss(c)
        if loss is None:
            phase = next((p for p, h in self.phases.items() if h is c), None)
            return f"serves the {phase} steps of {w.name}" if phase else ""
        if loss is Loss.NOT_REQUESTED:
            return f"not requested ({CONFIG_KEYS[self.kind]} = {self.requested})"
        if self.phases and self.requested == "auto":  # each phase went to the half ranked first for it
            d, m = self.phases["decode"], self.phases["mixed"]
            return (
                f"{_ranked_below('priority', c.priority, d, d.priority, c)} (decode steps); "
                f"{_ranked_below('mixed priority', c.mixed_priority, m, m.mixed_priority, c)} (mixed steps)"
            )
        return _ranked_below("priority", c.priority, w, w.priority, c)


def _ranked_below(label: str, value: int, winner: Candidate, best: int, c: Candidate) -> str:
    """Why c (value) ranks after winner (best) in words: "priority 5 < a 10", or the tie broken by name,
    then by plugin."""
    name = winner.name if winner.name != c.name else f"plugin {winner.plugin}"
    if value != best:
        return f"{label} {value} < {name} {best}"
    first = winner.name if winner.name != c.name else winner.plugin
    return f"{label} {value} = {name} {best}; '{first}' sorts first"


def choose(kind: str, candidates: list[Candidate], requested: str = "auto") -> Choice:
    """An explicit request must be valid; among the valid candidates it names, or among all valid ones
    under "auto", the highest priority wins, ties by name, then by plugin name."""
    label = KIND_LABELS[kind]
    valid = sorted((c for c in candidates if c.valid), key=lambda c: c.rank)
    options = ", ".join(dict.fromkeys(c.name for c in valid)) or "none"
    if requested != "auto":
        named = [c for c in candidates if c.name == requested]
        if not named:
            known = ", ".join(sorted({c.name for c in candidates})) or "none"
            raise SelectionError(f"unknown {label} '{requested}'; installed: {known}; valid here: {options}")
        if not any(c.valid for c in named):
            why = "; ".join(r for c in named for r in c.reasons)
            raise SelectionError(f"{label} '{requested}' cannot be used: {why}; valid here: {options}")
        valid = [c for c in valid if c.name == requested]
    if not valid:
        rejected = "; ".join(f"{c.name}: {', '.join(c.reasons)}" for c in candidates) or "none installed"
        raise SelectionError(f"no usable {label}: {rejected}; install or enable a plugin that provides one")
    valid[0].chosen = True
    return Choice(kind, requested, candidates, valid[0])


def _candidates(
    pm: PluginManager, hook: str, kind: str, reasons: Callable[[str, Any], list[str]], **kwargs: Any
) -> list[Candidate]:
    """Every item every plugin returns, as a candidate with reasons(plugin, item). A plugin whose hook
    raised becomes one invalid candidate named <plugin>; a check() that raises is a reason, not a crash. What
    an incompatible plugin offers is an invalid candidate without an object, its reason the plugin's."""
    cands = []
    for res in pm.call_each(hook, **kwargs):
        if res.error:
            cands.append(Candidate(kind, f"<{res.plugin}>", res.plugin, 0, [res.error]))
            continue
        for item in res.value or []:
            try:
                why = reasons(res.plugin, item)
            except Exception as e:
                why = [f"check() raised {type(e).__name__}: {e}"]
            cands.append(Candidate(kind, item.name, res.plugin, int(item.priority), why, item))
    return cands + [Candidate(kind, n, p, 0, [why]) for n, p, why in pm.withheld_offers(hook)]


def attention_context(
    info: ModelInfo, arch: ModelArchitecture, platform: Platform, dtype: torch.dtype, block_size: int | None
) -> AttentionContext:
    """What the attention backends are checked against: the checkpoint's heads, and the per-layer features
    the chosen model class declares for it."""
    features = arch.layer_features(info.hf_config)
    return AttentionContext(
        platform, dtype, info.head_size, info.num_heads, info.num_kv_heads, block_size, features
    )


def attention_candidates(pm: PluginManager, ctx: AttentionContext) -> list[Candidate]:
    check = lambda _, b: b.check(ctx)
    return _candidates(pm, "turnout_attention_backends", "attention", check, platform=ctx.platform)


def choose_attention(candidates: list[Candidate], requested: str, ctx: AttentionContext) -> Choice:
    """One backend (a name or "auto"), or one per phase ("decode+mixed"): each half must be valid alone,
    and the two must share one KV cache (attention.per_phase). Under "auto" the backend ranked first by
    priority serves decode steps, and the one ranked first by mixed priority the other steps, where the two
    differ and can share one KV cache."""
    pair = split_name(requested)
    if pair is None:
        choice = choose("attention", candidates, requested)
        return _auto_phases(choice, candidates, ctx) if requested == "auto" else choice
    halves = [choose("attention", candidates, name).chosen for name in pair]
    backend = PerPhaseBackend(halves[0].obj, halves[1].obj)
    if why := backend.check(ctx):
        raise SelectionError(f"attention backend '{requested}' cannot be used: {'; '.join(why)}")
    return _phase_choice(requested, candidates, halves, backend)


def _auto_phases(choice: Choice, candidates: list[Candidate], ctx: AttentionContext) -> Choice:
    """choice's backend for decode steps; for the others the valid backend of the highest mixed priority
    that can share its KV cache (itself: one backend). choice.note names those passed over, and why."""
    decode, passed = choice.chosen, []
    for mixed in sorted((c for c in candidates if c.valid), key=lambda c: c.mixed_rank):
        if mixed.name == decode.name:
            break
        backend = PerPhaseBackend(decode.obj, mixed.obj)
        if not (why := backend.check(ctx)):
            choice = _phase_choice("auto", candidates, [decode, mixed], backend)
            break
        passed.append(f"{mixed.name} ranks higher for mixed steps but cannot serve them: {'; '.join(why)}")
    choice.note = "; ".join(passed)
    return choice


def _phase_choice(
    requested: str, candidates: list[Candidate], halves: list[Candidate], backend: PerPhaseBackend
) -> Choice:
    for c in candidates:
        c.chosen = False
    plugins = "+".join(dict.fromkeys(h.plugin for h in halves))
    chosen = Candidate("attention", backend.name, plugins, backend.priority, [], backend, chosen=True)
    return Choice(
        "attention", requested, [*candidates, chosen], chosen, dict(zip(("decode", "mixed"), halves))
    )


def model_candidates(pm: PluginManager, architecture: str, config: EngineConfig) -> list[Candidate]:
    """Every plugin's architectures; valid: the checkpoint's name, and declaring the parallelism asked."""

    def check(_: str, a: ModelArchitecture) -> list[str]:
        if a.name != architecture:
            return [f"checkpoint is {architecture}"]
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        return a.problems(tp, pp, config.enable_expert_parallel)

    return _candidates(pm, "turnout_model_architectures", "model", check)


def executor_candidates(pm: PluginManager, ctx: ExecutorContext) -> list[Candidate]:
    def check(_: str, e: ExecutorSpec) -> list[str]:
        if ctx.own_processes and e.in_process:
            return [OWN_PROCESSES, *e.check(ctx)]
        return e.check(ctx)

    return _candidates(pm, "turnout_executors", "executor", check)


OWN_PROCESSES = (
    "runs the model in the engine's process, but data_parallel_size > 1 on CUDA needs each replica's "
    "ranks in processes of their own"
)


def choose_executor(pm: PluginManager, config: EngineConfig, platform: Platform) -> Choice:
    """Data parallelism on CUDA gives each replica its own GPUs through CUDA_VISIBLE_DEVICES while its
    processes start: only an executor whose ranks run outside the engine's process (in_process=False) can."""
    own = config.data_parallel_size > 1 and platform.is_cuda
    ctx = ExecutorContext(platform, config.world_size, config.executor != "auto", own)
    return choose("executor", executor_candidates(pm, ctx), config.executor)


def graph_candidates(pm: PluginManager) -> list[Candidate]:
    seen: dict[str, str] = {}  # policy name -> the plugin that registered it first

    def unique(plugin: str, p: GraphPolicy) -> list[str]:
        if p.name in seen:
            return [f"name already registered by plugin {seen[p.name]}"]
        seen[p.name] = plugin
        return []

    return _candidates(pm, "turnout_graph_policies", "graph", unique)


def moe_candidates(ctx: MoEContext) -> list[Candidate]:
    """The core's MoE kernels (layers/moe.py), checked like attention backends; a plugin cannot add one."""
    cands = []
    for k in moe_kernels(ctx):
        try:
            why = k.check(ctx)
        except Exception as e:
            why = [f"check() raised {type(e).__name__}: {e}"]
        cands.append(Candidate("moe", k.name, "turnout", int(k.priority), why, k))
    return cands


@dataclass
class Selection:
    """Everything chosen at start-up, and why. Each component is a Choice (its candidates, the chosen one
    and why the others lost): attention, model, executor, graph and, for MoE models, moe. The chosen
    objects sit behind accessors named for what they are: attention_backend, model_architecture,
    executor_spec, graph_policy (as requested), effective_graph (as it runs, after any downgrade) and
    moe_kernel."""

    platform: Platform
    model_info: ModelInfo
    dtype: torch.dtype
    attention: Choice
    model: Choice
    executor: Choice
    graph: Choice
    effective_graph: GraphPolicy
    graph_note: str | None = None
    notes: list[str] = field(default_factory=list)
    async_scheduling: bool = False  # as it runs: step N+1 is scheduled while step N is on the device
    async_scheduling_note: str = ""  # why it is on or off
    fitted: dict[str, tuple[Any, str]] = field(default_factory=dict)  # turnout.defaults: (value, why)
    moe: Choice | None = None  # MoE models only
    quantization: Choice | None = None  # a quantized checkpoint, or `quantization` set
    experts: dict[str, Any] | None = None  # MoE models: the experts each rank holds (describe_placement)
    measured: MeasuredTier | None = None  # the tuning record read, and its decision

    def apply(self, config: EngineConfig) -> EngineConfig:
        """config with every setting it left unset replaced by its fitted value."""
        return config.model_copy(update={k: v for k, (v, _) in self.fitted.items()})

    @property
    def attention_backend(self) -> AttentionBackend:
        """The chosen attention backend (a PerPhaseBackend where one serves each phase)."""
        return self.attention.obj

    @property
    def model_architecture(self) -> ModelArchitecture:
        """The chosen model architecture: its name, and the class it loads."""
        return self.model.obj

    @property
    def executor_spec(self) -> ExecutorSpec:
        """The chosen executor's spec: its name, what it supports, and the class it loads."""
        return self.executor.obj

    @property
    def graph_policy(self) -> GraphPolicy:
        """The graph policy as requested; effective_graph is the one that runs."""
        return self.graph.obj

    @property
    def quantization_method(self) -> Any:
        """The chosen turnout.quantization.QuantizationMethod, or None: the weights load as they are."""
        return self.quantization.obj if self.quantization else None

    @property
    def moe_kernel(self) -> MoEKernel | None:
        """The chosen MoE kernel, or None for a model without experts."""
        return self.moe.obj if self.moe else None

    @property
    def backend(self) -> AttentionBackend:
        """The older name of attention_backend."""
        return self.attention_backend

    @property
    def architecture(self) -> ModelArchitecture:
        """The older name of model_architecture."""
        return self.model_architecture

    @property
    def choices(self) -> list[Choice]:
        """Every component's Choice, in explain's order: attention, model, executor, graph, then moe and
        quantization where they apply."""
        extra = [c for c in (self.moe, self.quantization) if c is not None]
        return [self.attention, self.model, self.executor, self.graph, *extra]

    def summary(self) -> str:
        """One line: the chosen backend, model, executor and graph mode, each with its plugin."""
        a, m, e, g = (c.chosen for c in self.choices[:4])
        graph = g.name if g.name == self.effective_graph.name else f"{g.name} -> {self.effective_graph.name}"
        extra = [f"MoE kernel {self.moe.chosen.name}"] if self.moe else []
        extra += [f"quantization {self.quantization.chosen.name}"] if self.quantization else []
        return ", ".join([
            f"attention {a.name} ({a.plugin}), model {m.name} ({m.plugin}), executor {e.name} ({e.plugin})",
            f"graph mode {graph}, {self.platform.device_type} {str(self.dtype).removeprefix('torch.')}",
            *extra,
        ])  # fmt: skip


def select_all(
    config: EngineConfig, info: ModelInfo, pm: PluginManager | None = None, platform: Platform | None = None
) -> Selection:
    info.check_parallel(config.tensor_parallel_size, config.pipeline_parallel_size)  # before any process
    pm = pm or get_plugin_manager()
    platform = platform or current_platform()
    dtype = info.resolve_dtype(config.dtype, platform)
    measured = measured_tier(config, info, platform, pm)
    if measured.state == "used":
        logger.info("measured tier: %s", measured.describe())
    if measured.decision is not None and measured.decision.settings:
        config = config.model_copy(update=measured.decision.settings)
    moe = _choose_moe(config, info, platform, dtype)  # first: a dense model's MoE settings say so
    quantization = choose_quantization(pm, config, info, platform, dtype)
    model = _choose_model(pm, info.architecture, config)  # before attention: its layers' features
    actx = attention_context(info, model.obj, platform, dtype, config.block_size)
    attention = choose_attention(attention_candidates(pm, actx), config.attention_backend, actx)
    executor = choose_executor(pm, config, platform)
    graph = choose("graph", graph_candidates(pm), config.cudagraph_mode)
    backend: AttentionBackend = attention.obj
    effective, note = downgrade(
        graph.obj, backend.cudagraph_support, backend.name, platform.device_type, config.enforce_eager
    )
    if moe and effective.uses_graphs and (why := graph_blocker(moe.obj, config.expert_parallel_size)):
        effective, note = GraphPolicy("NONE", RuntimeMode.NONE, RuntimeMode.NONE), why
    if note:  # worth a warning only where graphs could have run; on CPU they never do (explain shows it)
        level = logging.WARNING if platform.is_cuda and not config.enforce_eager else logging.INFO
        level = level if platform.is_cuda else logging.DEBUG
        logger.log(level, "cudagraph_mode %s -> %s: %s", graph.chosen.name, effective.name, note)
    fitted = fit_defaults(config, platform, backend)
    async_on, async_note = resolve_async_scheduling(config.async_scheduling, executor.obj, platform)
    if config.async_scheduling is None:
        fitted["async_scheduling"] = (async_on, async_note)
    if measured.decision is not None:
        for key, value in measured.decision.settings.items():
            fitted[key] = (value, f"measured, {measured.source}")
    experts = None
    if moe is not None:
        tp, dp, ep = config.tensor_parallel_size, config.data_parallel_size, config.enable_expert_parallel
        experts = describe_placement(info.hf_config, tp, dp, ep)
    return Selection(
        platform, info, dtype, attention, model, executor, graph, effective, note,
        fitted=fitted, moe=moe, quantization=quantization, experts=experts, async_scheduling=async_on,
        async_scheduling_note=async_note,
        measured=measured,
    )  # fmt: skip


@dataclass
class MeasuredTier:
    """What the tuning records say for this config: the record used (if any), why others were not, and
    the decision against the static default."""

    state: str  # "off" (tuned = off), "none" (no matching record) or "used"
    reasons: list[str] = field(default_factory=list)  # why no record matched
    record: Any = None  # turnout.tuning.TuningRecord
    decision: Any = None  # turnout.tuning.Decision

    @property
    def source(self) -> str:
        path = getattr(self.record, "path", None)
        return f"record {path.name}" if path else "tuning record"

    def describe(self) -> str:
        """One line for explain and the start-up log."""
        if self.state == "off":
            return "off (tuned = off): tuning records are not read"
        if self.decision is None:
            return "no record used: " + "; ".join(self.reasons)
        return f"{self.decision.why} ({self.source})"


def measured_tier(
    config: EngineConfig, info: ModelInfo, platform: Platform, pm: PluginManager
) -> MeasuredTier:
    """The measured tier above the static priorities: a tuning record whose key matches this machine,
    model and workload decides the settings the user left unset; a user's setting always wins."""
    if config.tuned == "off":
        return MeasuredTier("off")
    from turnout import tuning  # at call time: the tuner builds engines, which select

    key = tuning.tuning_key(config, info, platform, pm, config.tune_workload)
    lookup = tuning.find_record(key)
    if lookup.record is None:
        return MeasuredTier("none", lookup.reasons)
    return MeasuredTier("used", [], lookup.record, tuning.decide(lookup.record, tuning.user_settings(config)))


def resolve_async_scheduling(
    requested: bool | None, spec: ExecutorSpec, platform: Platform
) -> tuple[bool, str]:
    """async_scheduling as it will run, and why. Unset, it is on with CUDA where the executor supports it
    (nano-vllm's bench on an H200: docs/performance.md), and off on the CPU, where the forward runs in the
    host thread and leaves nothing to overlap."""
    if not spec.supports_async_scheduling:
        if requested:
            raise ConfigError(
                f"async_scheduling is on, but executor {spec.name} does not support it (uniproc, for one "
                "rank, does); set async_scheduling false or leave it unset"
            )
        return False, f"off: executor {spec.name} does not support it"
    if requested is not None:
        return requested, "on: set by the user" if requested else "off: set by the user"
    if not platform.is_cuda:
        return False, f"off: on {platform.device_type} the forward runs in the host thread"
    return True, f"on: executor {spec.name} supports it, with CUDA (--no-async-scheduling)"


def worker_handoff(
    selection: Selection, config: EngineConfig, dumps: Callable[[Any], bytes] | None = None
) -> tuple[EngineConfig, bytes | None]:
    """What a worker process needs to rebuild the driver's choices: the config with every choice pinned by
    name, and the Selection pickled (None where it does not pickle; the worker then selects again)."""
    import pickle

    pinned = config.model_copy(
        update={
            "model": str(selection.model_info.path),
            "tuned": "off",  # the driver's measured choices travel pinned below
            "attention_backend": selection.attention.chosen.name,
            "executor": selection.executor.chosen.name,
            "cudagraph_mode": selection.graph.chosen.name,
            **({"moe_kernel": selection.moe.chosen.name} if selection.moe else {}),
            **({"quantization": selection.quantization.chosen.name} if selection.quantization else {}),
        }
    )
    try:
        return pinned, (dumps or pickle.dumps)(selection)
    except Exception as e:
        logger.info("selection does not pickle (%s); workers select again", e)
        return pinned, None


def selection_from_payload(config: EngineConfig, payload: bytes | None) -> Selection:
    """In a worker process: the driver's pickled Selection, or, where it did not travel, the same choices
    made again (the executor pins them by name in config)."""
    import pickle

    if payload is not None:
        try:
            return pickle.loads(payload)
        except Exception as e:
            logger.warning("selection did not unpickle (%s: %s); selecting again", type(e).__name__, e)
    assert config.model is not None
    return select_all(config, ModelInfo.from_dir(config.model))


def _choose_moe(
    config: EngineConfig, info: ModelInfo, platform: Platform, dtype: torch.dtype
) -> Choice | None:
    n, ep = num_experts(info.hf_config), config.expert_parallel_size
    if not n:
        for key, unset in (("enable_expert_parallel", False), ("moe_kernel", "auto")):
            if getattr(config, key) != unset:
                raise ConfigError(f"{key} is set, but {info.architecture} has no experts; unset it")
        return None
    if ep > n:
        raise ConfigError(
            f"{n} experts do not split over {ep} expert-parallel ranks (tp x dp); use fewer ranks"
        )
    return choose("moe", moe_candidates(MoEContext(platform, dtype)), config.moe_kernel)


def _choose_model(pm: PluginManager, architecture: str, config: EngineConfig) -> Choice:
    cands = model_candidates(pm, architecture, config)
    named = [c for c in cands if c.name == architecture]
    if named and not any(c.valid for c in named):  # provided, but not for these parallel settings
        raise SelectionError(f"model {architecture} ({named[0].plugin}): {'; '.join(named[0].reasons)}")
    if not named:
        installed = ", ".join(f"{c.name} ({c.plugin})" for c in cands if c.obj) or "none"
        raise SelectionError(
            f"model architecture '{architecture}' is not supported by any installed plugin; "
            f"installed: {installed}; install a model plugin that provides it (docs/writing-a-plugin.md)"
        )
    return choose("model", cands, architecture)


def quantization_context(
    config: EngineConfig, info: ModelInfo, platform: Platform, dtype: torch.dtype
) -> QuantizationContext:
    """What the quantization methods are checked against; a quantization_config that is not a table is
    refused here."""
    qc = info.hf_config.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise ConfigError(f"{info.path}/config.json: quantization_config is not an object; fix config.json")
    return QuantizationContext(
        platform, qc, config.quantization, dtype, info.hf_config, config.tensor_parallel_size
    )


def choose_quantization(
    pm: PluginManager, config: EngineConfig, info: ModelInfo, platform: Platform, dtype: torch.dtype
) -> Choice | None:
    """None where the checkpoint has no quantization_config and `quantization` is unset. Otherwise the
    checkpoint's format (or the online method `quantization` names) must have a valid method, or start-up
    stops with one line: a quantized checkpoint never loads as if it were not."""
    ctx = quantization_context(config, info, platform, dtype)
    if ctx.quant_config is None and ctx.requested is None:
        return None
    check = lambda _, m: m.check(ctx)
    cands = _candidates(pm, "turnout_quantization_methods", "quantization", check, platform=platform)
    fmt = ctx.quant_method
    if fmt is not None:
        readers = [c for c in cands if c.obj is not None and fmt in c.obj.checkpoint_formats]
        if not readers:
            serves = KNOWN_FORMATS.get(fmt)
            hint = f"install {serves}" if serves else "no known turnout plugin serves it; convert the model"
            installed = ", ".join(c.name for c in cands) or "none"
            raise SelectionError(
                f"checkpoint {info.path} is quantized with quant_method '{fmt}' (config.json "
                f"quantization_config), which no installed quantization method reads (installed: "
                f"{installed}); {hint}"
            )
        if ctx.requested is not None and not any(c.name == ctx.requested for c in readers):
            raise ConfigError(
                f"quantization = {ctx.requested}, but checkpoint {info.path} is quantized with quant_method "
                f"'{fmt}', which {', '.join(c.name for c in readers)} reads; unset quantization"
            )
        if not any(c.valid for c in readers):
            why = "; ".join(f"{c.name}: {', '.join(c.reasons)}" for c in readers)
            raise SelectionError(
                f"checkpoint {info.path} (quant_method '{fmt}') cannot be served here: {why}"
            )
    return choose("quantization", cands, ctx.requested or "auto")
