"""turnout tune: build every valid candidate configuration, measure each on a short fixed workload on
this machine, and write the figures as a tuning record.

The search goes axis by axis from the static default (TUNABLE's order). Within an axis the current best
and its alternatives run side by side: each engine runs once when built and once more after all are built
(warm-ups, never scored), then round-robin for `rounds` rounds; the axis's best replaces the current one
only where decide's rule (margin and noise) says it beats it. The current best's engine is kept from one
axis to the next."""

from __future__ import annotations

import gc
import itertools
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch
from tqdm.auto import tqdm

from turnout.attention.backend import KV_CACHE_ALIASES, KV_CACHE_DTYPES
from turnout.attention.per_phase import pair_block_size, split_name
from turnout.config import EngineConfig
from turnout.errors import ConfigError, SelectionError, TurnoutError
from turnout.loader.weights import kept_bytes, reuse_weights
from turnout.models.info import ModelInfo
from turnout.platform import current_platform
from turnout.plugins import get_plugin_manager
from turnout.selection import (
    Selection,
    attention_candidates,
    attention_context,
    graph_candidates,
    ranked,
    select_all,
)
from turnout.tuning.key import tuning_key
from turnout.tuning.record import TUNABLE, Measured, TuningRecord, find_record, save
from turnout.tuning.rule import MARGIN, beats, decide, rank, user_settings
from turnout.tuning.workload import Load, load_for

logger = logging.getLogger("turnout")
BLOCK_SIZES = {"cuda": (16, 128), "cpu": (16, 32)}  # tried besides the backends' preferred sizes
SETTLE_SEED = -1  # the unscored round once an axis's engines are built (seed 0 warms each one up as built)
SHORT = {
    "kv_cache_dtype": "kv",
    "cudagraph_mode": "graph",
    "max_num_batched_tokens": "tokens",
    "block_size": "block",
    "async_scheduling": "async",
    "max_num_seqs": "seqs",
}


def static_default(sel: Selection, config: EngineConfig) -> dict[str, Any]:
    """The TUNABLE settings selection picks for config without records: names chosen, values fitted."""
    fitted = sel.apply(config)
    return {
        "kv_cache_dtype": sel.kv_cache_dtype,
        "attention_backend": sel.attention.chosen.name,
        "cudagraph_mode": sel.graph.chosen.name,
        "max_num_batched_tokens": fitted.max_num_batched_tokens,
        "block_size": fitted.block_size,
        "async_scheduling": sel.async_scheduling,
        "max_num_seqs": fitted.max_num_seqs,
    }


def label(settings: dict[str, Any], default: dict[str, Any]) -> str:
    """The attention backend, then every other field that differs from default: "naive block=32"."""
    show = lambda v: ("on" if v else "off") if isinstance(v, bool) else str(v)
    rest = [f"{SHORT[k]}={show(v)}" for k, v in settings.items() if k in SHORT and v != default.get(k)]
    return " ".join([str(settings["attention_backend"]), *rest])


@dataclass
class Running:
    """A candidate engine kept alive through its axis's rounds."""

    settings: dict[str, Any]
    label: str
    llm: Any
    run_s: float  # its latest run's seconds: what one measured run will take
    runs: list[float]  # this axis's scored figures
    spent: float = 0.0  # seconds its build and runs took
    cost: int = -1  # its entry in Search.costs; -1 once that holds what it took
    failed: str = ""  # why a measured run raised; its runs are then not recorded


class Search:
    """The candidates of each axis, the engines that measure them, the budget and what was skipped."""

    def __init__(
        self,
        base: EngineConfig,
        info: ModelInfo,
        load: Load,
        rounds: int,
        budget: float,
        progress: bool,
        t0: float | None = None,
        kv_cache_dtypes: tuple[str, ...] = (),
    ) -> None:
        """budget: seconds from t0 (perf_counter; default now) for everything tuning does; kv_cache_dtypes:
        the KV cache dtypes the user allows tuning to measure (none: the cache dtype is not searched)."""
        self.t0 = time.perf_counter() if t0 is None else t0
        self.kv_cache_dtypes = kv_cache_dtypes
        self.base, self.info, self.load, self.rounds, self.budget = base, info, load, rounds, budget
        self.pm, self.platform = get_plugin_manager(), current_platform()
        self.sel = select_all(base, info, self.pm, self.platform)
        self.default = static_default(self.sel, base)
        self.backends = self._valid_backends()
        self.measured: dict[str, Measured] = {}  # by label, in the order first measured
        self.skipped: list[str] = []
        self.costs: list[float] = []  # seconds per candidate built: build, warm-ups and rounds (estimated
        # from its first run until its rounds are done)
        self.engine_bytes: list[int] = []  # device memory each candidate's engine took (CUDA)
        self.kept: Running | None = None  # the current best's engine, measured again on the next axis
        fmt = "{desc}: {n_fmt}/{total_fmt} runs [{elapsed}<{remaining}]{postfix}"
        self.bar = tqdm(total=0, desc="tune", bar_format=fmt, disable=not progress)

    # ---- candidates ----
    def config_for(self, settings: dict[str, Any]) -> EngineConfig:
        """The candidate's config: the user's, records off, settings applied, a KV cache for one round."""
        blocks = self.base.num_gpu_blocks_override or self.load.num_blocks(settings["block_size"])
        return self.base.model_copy(update={**settings, "num_gpu_blocks_override": blocks})

    def options(self, axis: str, cur: dict[str, Any], fixed: dict[str, Any]) -> list[dict[str, Any]]:
        """cur first, then every alternative on axis; each differs from cur on axis (and, for attention,
        on block_size where the user left it to the backend)."""
        if axis == "kv_cache_dtype":  # only the dtypes the user listed
            alts = [{**cur, axis: d} for d in self.kv_cache_dtypes]
        elif axis == "attention_backend":
            alts = [self._with_backend(cur, n, fixed) for n in self.backend_names(cur["attention_backend"])]
        elif axis == "cudagraph_mode":
            alts = self._graph_options(cur)
        elif axis == "max_num_batched_tokens":
            alts = [{**cur, axis: t} for t in (cur[axis] // 2, cur[axis] * 2) if t >= 1]
        elif axis == "max_num_seqs":  # half and twice, where the load runs more requests than either admits
            n = cur[axis]
            alts = [{**cur, axis: m} for m in (n // 2, n * 2) if m >= 1 and min(m, n) < self.load.num_prompts]
        elif axis == "block_size":
            sizes = [
                *BLOCK_SIZES.get(self.platform.device_type, ()),
                *self._preferred(cur["attention_backend"]),
            ]
            alts = [{**cur, axis: b} for b in sizes]
        else:  # async_scheduling: on and off, where the executor can run it at all
            alts = [{**cur, axis: not cur[axis]}] if self.sel.executor_spec.supports_async_scheduling else []
        return [dict(s) for s in {_frozen(s): s for s in [cur, *alts]}.values()]

    def backend_names(self, lead: str) -> list[str]:
        """The valid backends and every ordered pair of two of them (decode+mixed), in the order a budget
        reaches them: lead (the baseline's backend, or its decode half), then the pairs that keep lead for
        decode steps, then the other backends by rank, then their pairs. Decode sets TPOT and most of a
        throughput run, and prefill kernels differ most (on an H200 at the 8B shape, triton+flash_attn cut
        a 16k-token TTFT by 9%, where flash_attn alone lost 17% of TPOT)."""
        lead = (split_name(lead) or (lead,))[0]
        singles = sorted(self.backends, key=lambda n: n != lead)  # stable: the rest stay by rank
        pairs = [f"{a}+{b}" for a, b in itertools.permutations(singles, 2)]
        return [singles[0], *(p for p in pairs if p.startswith(f"{singles[0]}+")), *singles[1:],
                *(p for p in pairs if not p.startswith(f"{singles[0]}+"))]  # fmt: skip

    def _valid_backends(self) -> dict[str, Any]:
        """name -> backend, of every backend valid for this model here (at any block size), by rank."""
        arch, kv = self.sel.model_architecture, self.base.kv_cache_dtype
        ctx = attention_context(self.info, arch, self.platform, self.sel.dtype, None, kv)
        out: dict[str, Any] = {}
        for c in ranked(attention_candidates(self.pm, ctx)):
            if c.valid:
                out.setdefault(c.name, c.obj)  # a name two plugins register: the one selection would pick
        return out

    def _preferred(self, backend: str) -> list[int]:
        names = split_name(backend) or (backend,)
        return [self.backends[n].preferred_block_size for n in names if n in self.backends]

    def _with_backend(self, cur: dict[str, Any], name: str, fixed: dict[str, Any]) -> dict[str, Any]:
        """cur on backend name, at the block size it prefers (a pair: pair_block_size) unless user-set."""
        block = fixed.get("block_size")
        halves = [self.backends.get(n) for n in split_name(name) or (name,)]
        if not block and None not in halves:
            block = pair_block_size(*halves)[0] if len(halves) == 2 else halves[0].preferred_block_size
        return {**cur, "attention_backend": name, "block_size": block or cur["block_size"]}

    def _graph_options(self, cur: dict[str, Any]) -> list[dict[str, Any]]:
        """One option per graph mode as it runs here, cur's first: modes that downgrade to one are one."""
        seen, out = set(), []
        valid = ranked(c for c in graph_candidates(self.pm) if c.valid)
        for s in [cur, *({**cur, "cudagraph_mode": c.name} for c in valid)]:
            try:
                mode = select_all(self.config_for(s), self.info, self.pm, self.platform).effective_graph.name
            except (SelectionError, ConfigError) as e:
                self.skip(s, str(e))
                continue
            if mode not in seen:
                seen.add(mode)
                out.append(s)
        return out

    # ---- measuring ----
    def axis(self, name: str, options: list[dict[str, Any]]) -> dict[str, Any]:
        """Measure options round-robin (options[0], the current best, is the baseline); return the one that
        beats the baseline past the margin and the noise, else the baseline."""
        current = options[0]
        if len(options) < 2:
            return current
        est = self.estimate()
        builds = 1 if self.kept is not None and self.kept.settings == current else 2
        if est is not None and self.left() < builds * est:
            for s in options[1:]:
                self.skip(s, f"over budget ({self.left():.0f} s left, ~{est:.1f} s a candidate)")
            return current
        self.bar.set_description_str(f"tune {name}")
        engines, chosen = self.start(options), current
        try:
            if len(engines) > 1:  # the baseline alone compares with nothing
                self.measure(engines)
            chosen = self.record(engines, current)
        finally:
            self.kept = next((e for e in engines if e.settings == chosen and not e.failed), None)
            self.stop([e for e in engines if e is not self.kept])
        return chosen

    def record(self, engines: list[Running], current: dict[str, Any]) -> dict[str, Any]:
        """Add the axis's runs to measured; the settings that beat current past the margin and the noise,
        else current."""
        done = [Measured(e.label, e.settings, e.runs) for e in engines if e.runs and not e.failed]
        for m in done:
            self.measured.setdefault(m.label, Measured(m.label, m.settings, [])).runs.extend(m.runs)
        if not done or done[0].settings != current:
            return current
        best = rank(done, self.load.higher_is_better)[0]
        return best.settings if beats(best, done[0], MARGIN, self.load.higher_is_better)[0] else current

    def start(self, options: list[dict[str, Any]]) -> list[Running]:
        """An engine per option that is valid, builds and fits the budget; none if the baseline cannot."""
        engines: list[Running] = []
        if (kept := self.kept) is not None and kept.settings == options[0]:
            kept.runs, kept.cost, engines = [], -1, [kept]
            self.bar.total += self.rounds
        elif kept is not None:  # not this axis's baseline: its memory goes back first
            self.stop([kept])
        self.kept = None
        for i, s in enumerate(options[len(engines) :], len(engines)):
            if engines and (why := self.unfit(engines)):
                self.skip(s, why)
                continue
            if (e := self.build(s)) is None and i == 0:
                if not self.measured:  # the static default itself: nothing else can be compared
                    raise TurnoutError(f"the default configuration does not run here: {self.skipped[-1]}")
                return []
            if e is not None:
                engines.append(e)
                self.bar.total += self.rounds
                self.bar.refresh()
        return engines

    def build(self, settings: dict[str, Any]) -> Running | None:
        """The candidate's engine after one warm-up run; None (and why, in skipped) if it cannot run."""
        from turnout.llm import LLM

        cfg, llm = self.config_for(settings), None
        t, free, kept = time.perf_counter(), self.free_bytes(), kept_bytes()
        try:
            select_all(cfg, self.info, self.pm, self.platform)  # why not, before any weights load
            llm = LLM(config=cfg)
            t_run = time.perf_counter()
            self.load.run(llm, self.load.requests(0))
        except (SelectionError, ConfigError) as e:
            return self.skip(settings, str(e))
        except Exception as e:  # a candidate that fails to build or run is a finding, not the end of tuning
            if llm is not None:
                llm.shutdown()
            return self.skip(settings, f"failed: {type(e).__name__}: {e}".splitlines()[0])
        run_s = time.perf_counter() - t_run
        self.costs.append(time.perf_counter() - t + (1 + self.rounds) * run_s)
        if free is not None:  # the weights are shared (reuse_weights): no one engine's memory
            self.engine_bytes.append(free - self.free_bytes() - (kept_bytes() - kept))
        return Running(
            settings, self.label(settings), llm, run_s, [], time.perf_counter() - t, len(self.costs) - 1
        )

    def measure(self, engines: list[Running]) -> None:
        """One unscored round once every engine is built (another's build disturbs what ran before it),
        then rounds rounds; round r sends seed r's requests to every engine, starting one further along
        each round so no candidate always runs first. A candidate's cost becomes what it took."""
        for r in range(self.rounds + 1):
            reqs = self.load.requests(r or SETTLE_SEED)
            for e in engines[r % len(engines) :] + engines[: r % len(engines)]:
                self.bar.set_postfix_str(e.label)
                try:
                    if not e.failed:
                        t = time.perf_counter()
                        figure = self.load.run(e.llm, reqs)
                        e.run_s = time.perf_counter() - t
                        e.spent += e.run_s
                        e.runs += [figure] if r else []
                except Exception as ex:  # as in build: one candidate's failure is recorded, not raised
                    e.failed = f"failed: {type(ex).__name__}: {ex}".splitlines()[0]
                    self.skip(e.settings, e.failed)
                self.bar.update(1 if r else 0)
        for e in engines:
            if e.cost >= 0:
                self.costs[e.cost], e.cost = e.spent, -1

    def stop(self, engines: list[Running]) -> None:
        """Shut the axis's engines down and give their memory back before the next axis builds its own."""
        for e in engines:
            e.llm.shutdown()
            e.llm = None
        gc.collect()
        if self.platform.is_cuda:
            torch.cuda.empty_cache()

    # ---- budget ----
    def left(self) -> float:
        """Seconds of the budget left."""
        return self.budget - (time.perf_counter() - self.t0)

    def estimate(self) -> float | None:
        """Seconds one more candidate may take: as long as the slowest built so far after the first (which
        alone read the weights: the others share them). Builds differ (a backend's first kernels compile),
        and a mean would let the budget overrun by the difference."""
        return max(self.costs[1:] or self.costs) if self.costs else None

    def unfit(self, engines: list[Running]) -> str:
        """Why another candidate does not fit beside engines ("" where it does): the rounds of the engines
        already built and its own estimate must fit the time left; on CUDA, an engine as large as the
        largest so far must fit the free memory."""
        pending = sum((1 + self.rounds) * e.run_s for e in engines)  # the unscored round and the rounds
        if self.left() - pending - (self.estimate() or 0.0) <= 0:
            return f"over budget ({self.left():.0f} s left, ~{self.estimate():.1f} s a candidate)"
        free = self.free_bytes()
        if free is not None and self.engine_bytes and free < 1.2 * max(self.engine_bytes):
            need = max(self.engine_bytes) / 2**30
            return f"no device memory for another engine ({free / 2**30:.1f} GiB free, ~{need:.1f} GiB each)"
        return ""

    def free_bytes(self) -> int | None:
        """Free device memory on CUDA (None elsewhere), after the allocator's cached blocks are released."""
        if not self.platform.is_cuda:
            return None
        gc.collect()
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0]

    def label(self, settings: dict[str, Any]) -> str:
        """settings named against the static default."""
        return label(settings, self.default)

    def skip(self, settings: dict[str, Any], why: str) -> None:
        """List the candidate as skipped, with why; returns None, for build's `return self.skip(...)`."""
        self.skipped.append(f"{self.label(settings)}: {why}")

    def close(self) -> None:
        """Shut the kept engine down and close the progress bar."""
        if self.kept is not None:
            self.stop([self.kept])
            self.kept = None
        self.bar.close()


def _frozen(settings: dict[str, Any]) -> tuple:
    return tuple(sorted(settings.items()))


def tune(
    config: EngineConfig,
    workload: str = "throughput",
    budget: float = 120,
    progress: bool = True,
    *,
    rounds: int = 2,
    load: Load | None = None,
    axes: tuple[str, ...] = TUNABLE,
    directory: Any = None,
    kv_cache_dtypes: tuple[str, ...] = (),
) -> TuningRecord:
    """Measure config's candidates on workload within budget seconds; write the record and return it.
    Fields the user set are not searched. The KV cache dtype is searched only among kv_cache_dtypes (two or
    more kv_cache_dtype names, config's kv_cache_dtype left unset): the cache's precision is the user's to
    trade, never tuning's alone. load, axes and directory override the workload's sizes, the axes searched
    and the records' folder (tests)."""
    from turnout.engine.llm_engine import resolve_model_dir

    if rounds < 2:
        raise ConfigError(f"rounds {rounds}: every candidate runs at least twice, to measure its noise")
    kv_cache_dtypes = check_kv_cache_dtypes(kv_cache_dtypes, config)
    t0, model_dir = time.perf_counter(), resolve_model_dir(config)
    info = ModelInfo.from_dir(model_dir)
    base = config.model_copy(update={"tuned": "off", "tune": "off"})
    platform = current_platform()
    load = load or _load(workload, config, model_dir, info, platform)
    search = Search(base, info, load, rounds, budget, progress, t0, kv_cache_dtypes)
    fixed = user_settings(config)
    try:
        with reuse_weights():  # the candidate engines in this process share one copy of the weights
            current = search.default
            for axis in axes:
                if axis in fixed:
                    search.skipped.append(f"{axis}: set by the user ({fixed[axis]}), not searched")
                    continue
                if axis == "kv_cache_dtype" and not kv_cache_dtypes:
                    search.skipped.append(
                        f"{axis}: not searched (turnout tune --kv-cache-dtype auto,fp8 measures those listed)"
                    )
                    continue
                current = search.axis(axis, search.options(axis, current, fixed))
    finally:
        search.close()
    key = tuning_key(config, info, platform, search.pm, workload)
    record = TuningRecord(
        key, workload, load.metric, load.higher_is_better, search.default, list(search.measured.values()),
        MARGIN, round(time.perf_counter() - t0, 1), search.skipped,
        datetime.now(timezone.utc).isoformat(timespec="microseconds"), requests=load.describe(),
    )  # fmt: skip
    save(record, directory)
    return record


def check_kv_cache_dtypes(dtypes: tuple[str, ...], config: EngineConfig) -> tuple[str, ...]:
    """The KV cache dtypes tuning may measure, each once (aliases as their name: fp8_e4m3 is fp8); a
    ConfigError where one is not a kv_cache_dtype name, fewer than two remain, or config sets
    kv_cache_dtype too."""
    if not dtypes:
        return ()
    if unknown := [d for d in dtypes if d not in KV_CACHE_DTYPES]:
        raise ConfigError(
            f"kv_cache_dtype candidate {unknown[0]!r} is not one of {', '.join(KV_CACHE_DTYPES)}; "
            "list two or more, e.g. auto,fp8"
        )
    out = tuple(dict.fromkeys(KV_CACHE_ALIASES.get(d, d) for d in dtypes))
    if len(out) < 2:
        raise ConfigError(
            f"kv_cache_dtype candidates {','.join(dtypes)} name one dtype; list two or more to measure them "
            "(e.g. auto,fp8), or give one as kv_cache_dtype to run it"
        )
    if config.kv_cache_dtype != "auto":
        raise ConfigError(
            f"kv_cache_dtype = {config.kv_cache_dtype} is set and candidates {','.join(dtypes)} are listed; "
            "give one or the other"
        )
    return out


def _load(workload: str, config: EngineConfig, model_dir: str, info: ModelInfo, platform: Any) -> Load:
    """The workload named, sized for platform; a JSONL file's text prompts use the model's tokenizer, and
    its token ids need none."""
    tokenizer, problem = None, ""
    if workload.endswith(".jsonl"):
        from turnout.engine.llm_engine import load_tokenizer

        tokenizer, problem = load_tokenizer(config, model_dir)
    return load_for(workload, platform, info.hf_config.get("vocab_size", 10000), tokenizer, problem)


def tune_if_unseen(config: EngineConfig) -> TuningRecord | None:
    """tune = "auto": tune once, within tune_budget, where no record matches config's key; the new record,
    or None where one matched (or tuning is off)."""
    from turnout.engine.llm_engine import resolve_model_dir

    if config.tune != "auto":
        return None
    if config.tuned == "off":
        logger.warning("tune = auto is ignored: tuned = off, so a record would not be read")
        return None
    pm, platform = get_plugin_manager(), current_platform()
    info = ModelInfo.from_dir(resolve_model_dir(config))
    lookup = find_record(tuning_key(config, info, platform, pm, config.tune_workload))
    if lookup.record is not None:
        logger.info("tune = auto: tuning record %s matches this setup; not tuning again", lookup.record.path)
        return None
    logger.info(
        "tune = auto: no tuning record matches (%s); tuning %s for up to %.0f s before serving",
        "; ".join(lookup.reasons), config.tune_workload, config.tune_budget,
    )  # fmt: skip
    record = tune(config, config.tune_workload, config.tune_budget, progress=False)
    why = decide(record, user_settings(config)).why
    logger.info("tune = auto: tuned in %.0f s, record %s; %s", record.tune_s, record.path, why)
    return record
