"""One bench run: the model, the engine config, the peers, and the records they make. Peers run first, each
in its own process, so that turnout then has the GPU to itself."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from turnout.bench import peers, records, roofline, workloads
from turnout.bench.random_models import random_model
from turnout.errors import TurnoutError
from turnout.tuning.key import PROFILES

RUNS = ("first", "repeat")
NANO_VLLM_REQUESTS = ("num_prompts", "max_input_len", "max_output_len")  # the options of nano-vllm's requests
WORKLOAD_KEYS = {
    "throughput": NANO_VLLM_REQUESTS,
    "wide": ("num_prompts", "min_input_len", "max_input_len", "min_output_len", "max_output_len"),
    "latency": ("tpot_tokens", "ttft_lens"),
    "prefix": ("num_prompts", "prefix_len", "suffix_len", "output_len"),
    "structured": (*NANO_VLLM_REQUESTS, "json_schema", "structured_output_ratio"),
}
# a ratio's key -> the peer whose same run turnout's output tok/s is over (VS_HF: on the HF peers' subset)
VS_PEERS = {f"ratio_vs_{p.removeprefix('turnout-').replace('-', '_')}": p
            for p in ("vllm", "nano-vllm", *peers.VARIANTS)}  # fmt: skip
VS_HF = {"ratio_vs_peer": "hf-generate-batch", "ratio_vs_hf_generate": "hf-generate"}
CHILD_PEERS = ("wide",)  # workloads whose requests vLLM and nano-vllm run here, not their bench.py's


def rate(seconds: float, tokens: int) -> dict[str, float]:
    return {"output_tokens_per_s": tokens / seconds, "output_tokens": tokens, "seconds": seconds}


def ratio(a: float, b: float | None) -> float | None:
    return a / b if b else None


def metric(res: dict[str, dict], engine: str, run: str, key: str = "output_tokens_per_s") -> Any:
    """A peer's figure for one run, None where that peer did not run."""
    return res.get(engine, {}).get(run, {}).get(key)


def ratios(a: dict[str, float], b: dict[str, float] | None) -> dict[str, float] | None:
    """a[k] / b[k] for every key both have; None where there is none."""
    return {k: v / b[k] for k, v in a.items() if b and b.get(k)} or None


def vs_floor(tok_s: float | None, floor: dict[str, float] | None) -> dict[str, float]:
    """A run's floor (floor_s, floor_output_tokens_per_s) and its distance from it at tok_s output tokens a
    second: over_floor, its time over the floor's (1 = at the floor), and fraction_of_floor, the inverse;
    {} where either is unknown."""
    if not floor or not tok_s:
        return {}
    f = floor["floor_output_tokens_per_s"]
    return {**floor, "over_floor": f / tok_s, "fraction_of_floor": tok_s / f}


def vs_latency_floor(m: dict[str, Any], floors: dict[str, Any]) -> dict[str, Any]:
    """A latency run's floors and its times over them: tpot_over_floor, and ttft_over_floor by prompt."""
    if not floors:
        return {}
    out = dict(floors)
    if m.get("tpot_ms"):
        out["tpot_over_floor"] = m["tpot_ms"] / floors["tpot_floor_ms"]
    if by_len := ratios(m.get("ttft_ms") or {}, floors["ttft_floor_ms"]):
        out["ttft_over_floor"] = by_len
    return out


class Bench:
    def __init__(self, args: argparse.Namespace, peer_names: list[str]) -> None:
        from turnout.engine.llm_engine import resolve_model_dir
        from turnout.engine_args import engine_config_from_args
        from turnout.models.info import ModelInfo
        from turnout.platform import current_platform

        self.args, self.peers = args, peer_names
        self.schema = self.structured_schema() if args.workload == "structured" else None
        if args.cold_cache:
            os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="turnout-triton-")
            os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] = tempfile.mkdtemp(prefix="turnout-fa4-")
        cfg = engine_config_from_args(args)
        update: dict[str, Any] = {}
        if args.random_model:
            if cfg.model:
                raise TurnoutError("--model and --random-model both name a model; pass one")
            update["model"] = str(random_model(args.random_model))
        self.model_dir = resolve_model_dir(cfg.model_copy(update=update))
        info = ModelInfo.from_dir(self.model_dir)
        self.quantized = "quantization_config" in info.hf_config  # the checkpoint's own quantization
        self.ttft_lens: list[int] = []
        if args.workload == "latency":  # the TTFT prompts that fit with their one output token
            limit = cfg.max_model_len or info.max_position_embeddings
            self.ttft_lens = [n for n in args.ttft_lens if n < limit]
            if skipped := [n for n in args.ttft_lens if n >= limit]:
                lens = ", ".join(map(str, skipped))
                why = f"the prompt and one output token exceed max_model_len {limit}"
                print(f"note: TTFT skipped at {lens} tokens: {why}", file=sys.stderr, flush=True)
        if args.workload == "structured":  # every run a first run: no request hits blocks another cached
            update["enable_prefix_caching"] = False
        if cfg.max_model_len is None:  # nano-vllm's 4096, or what the latency workload's prompts need
            update["max_model_len"] = 4096
            if args.workload == "latency":
                need = max([4096, 33 + args.tpot_tokens, *(n + 1 for n in self.ttft_lens)])
                update["max_model_len"] = min(need, info.max_position_embeddings)
        if args.workload in PROFILES and cfg.source("tune_workload") == "default":
            update["tune_workload"] = args.workload  # the records `turnout tune` made for this workload
        self.cfg = cfg.model_copy(update=update)
        if "nano-vllm" in self.peers and info.architecture != "Qwen3ForCausalLM":
            raise TurnoutError(f"nano-vllm runs Qwen3 checkpoints only, not {info.architecture}")
        self.dtype = str(info.resolve_dtype(self.cfg.dtype, current_platform())).removeprefix("torch.")
        self.model = Path(self.cfg.model).name if self.cfg.model else "SmolLM2-135M-Instruct (embedded)"
        if args.random_model:
            self.model = f"random-{args.random_model}"
        nbytes = {"float32": 4, "float16": 2, "bfloat16": 2}[self.dtype]
        # the KV cache's values take the size of the dtype that the started engine resolves (start)
        self.checkpoint_shape = roofline.Shape.from_checkpoint(
            self.model_dir, nbytes, self.cfg.quantization == "fp8"
        )
        self.shape = self.checkpoint_shape
        self.prov = records.provenance()
        self.device = self.prov["device"]
        self.ceiling = roofline.ceiling_for(self.device)
        self.selection: dict[str, Any] = {}
        self.startup_s = 0.0
        self.failed: list[str] = []  # peers that did not run
        # the VARIANTS peers' configs (turnout-bf16's checkpoint, or why there is none) before anything runs
        self.variant_configs = {e: self.variant_config(e) for e in self.peers if e in peers.VARIANTS}

    # ---- records ----
    def record(self, engine: str, run: str, config: dict | None = None, **metrics: Any) -> dict[str, Any]:
        """A record of one run; turnout's (no config given) with this run's config and start-up time."""
        rec = {"workload": self.args.workload, "engine": engine, "model": self.model, **self.prov, "run": run}
        if config is None:
            kv = {"kv_bytes_per_token": self.shape.kv_bytes_per_token,
                  "standard_kv_bytes_per_token": self.shape.standard_kv_bytes_per_token}  # fmt: skip
            config, metrics = self.turnout_config(), {**metrics, "startup_s": self.startup_s, **kv}
        return rec | {k: v for k, v in metrics.items() if v is not None} | {"config": config}

    def turnout_config(self) -> dict[str, Any]:
        a = vars(self.args)
        keys = ["input", "max_tokens"] if a.get("input") else list(WORKLOAD_KEYS[self.args.workload])
        if self.args.workload == "throughput" and any(p in self.peers for p in peers.HF_ENGINES):
            keys += ["peer_subset", "peer_output_len"]
        workload = {k: a[k] for k in keys} | {"peers": self.peers, "cold_cache": a["cold_cache"]}
        if self.schema is not None:
            workload["schema"] = self.schema
        return {"workload": workload, **self.selection, "engine": self.cfg.model_dump()}

    def peer_config(self, engine: str, res: dict[str, Any]) -> dict[str, Any]:
        here = self.args.workload in CHILD_PEERS  # the peer ran this workload's requests in our child
        if engine == "nano-vllm":
            runner = "turnout.bench.peers nano-vllm" if here else "nanobench.py"
            return {"runner": runner, "NANOVLLM_SRC": peers.nano_vllm_env()["NANOVLLM_SRC"]}
        if engine == "vllm":
            runner = "turnout.bench.peers vllm" if here else "vllmbench.py"
            cfg = {"runner": runner, "version": res.get("version"), "PYTHONPATH": self.args.vllm_site}
            cfg |= self.vllm_precision()
            if self.args.workload == "latency":
                ttft = {"ttft": "turnout.bench.peers vllm", "max_model_len": self.cfg.max_model_len}
                cfg |= {**ttft, "ttft_startup_s": res.get("ttft_startup_s")}
            elif here:
                cfg["max_model_len"] = self.cfg.max_model_len
            return cfg
        if engine in peers.VARIANTS:
            return {**res["selection"], "engine": self.variant_configs[engine]}
        return {"dtype": self.dtype}

    def vllm_precision(self) -> dict[str, Any]:
        """vLLM's LLM arguments for this run's weight quantization and KV-cache dtype (vLLM's names and
        values), so that vLLM runs at turnout's precision: on a quantized checkpoint, the checkpoint's own."""
        quantization = None if self.quantized else self.cfg.quantization
        return {"quantization": quantization, "kv_cache_dtype": self.cfg.kv_cache_dtype}

    def variant_config(self, engine: str) -> dict[str, Any]:
        """turnout-static's engine config (this run's, with tuning records ignored) or turnout-bf16's: this
        run's on the unquantized weights (a random FP8 model's bf16 checkpoint, or the checkpoint that this
        run quantizes at load) with the KV cache at the model's dtype."""
        cfg = self.cfg.model_dump()
        if engine == peers.STATIC:
            return {**cfg, "tuned": "off", "tune": "off"}
        shape, fp8, _ = (self.args.random_model or "").partition("-fp8")
        if self.quantized and not fp8:
            raise TurnoutError(
                f"{peers.BF16}: {self.model} is a quantized checkpoint, with no unquantized one beside it; "
                "run a --random-model SHAPE-fp8 model, or a bf16 checkpoint with --quantization fp8"
            )
        if not (self.quantized or self.cfg.quantization or self.cfg.kv_cache_dtype != "auto"):
            raise TurnoutError(f"{peers.BF16}: this run is unquantized already; pass --quantization or "
                               "--kv-cache-dtype fp8, or drop the peer")  # fmt: skip
        cfg["model"] = str(random_model(shape)) if fp8 else cfg["model"]
        return {**cfg, "quantization": None, "kv_cache_dtype": "auto"}

    def peer_records(
        self, results: dict[str, dict], floors: dict[str, Any] | None = None, **extra: Any
    ) -> list[dict[str, Any]]:
        """Each peer's record of each run, with its distance from that run's floor (floors: by run, or the
        latency floors)."""
        out, floors, lat = [], floors or {}, self.args.workload == "latency"
        for engine, res in results.items():
            cfg = self.peer_config(engine, res)
            for run in RUNS:
                m, tok_s = res[run], res[run].get("output_tokens_per_s")
                near = vs_latency_floor(m, floors) if lat else vs_floor(tok_s, floors.get(run))
                out.append(self.record(engine, run, cfg, startup_s=res["startup_s"], **extra, **m, **near))
        return out

    # ---- turnout in this process ----
    def start(self, **overrides: Any) -> Any:
        from turnout import LLM

        t0 = time.perf_counter()
        llm = LLM(config=self.cfg.model_copy(update=overrides))
        self.startup_s = round(time.perf_counter() - t0, 2)
        self.selection = workloads.selection(llm)
        self.shape = self.checkpoint_shape.cached_in(llm.selection.kv_cache_torch_dtype.itemsize)
        workloads.warm_up(llm)
        return llm

    def timed_runs(
        self, llm: Any, reqs: list[workloads.Req], floors: dict[str, Any], res: dict[str, dict]
    ) -> list[dict[str, Any]]:
        """turnout's first run and repeat of reqs, each against the peers' same run and its floor."""
        recs = []
        for run in RUNS:
            m = counted_run(llm, reqs)
            ours = m["output_tokens_per_s"]
            vs = {k: ratio(ours, metric(res, e, run)) for k, e in VS_PEERS.items()}
            near = vs_floor(ours, floors.get(run))
            recs.append(self.record("turnout", run, num_prompts=len(reqs), **m, **vs, **near))
        return recs

    # ---- workloads: each returns its records and the floor its plot draws (None where none is known) ----
    def throughput(self) -> tuple[list[dict], float | None]:
        """nano-vllm's requests (or --input's), or wide decode's: many short prompts, each decoding a long
        output. Beside the HF peers, turnout also runs their greedy subset of the throughput requests."""
        a, wide = self.args, self.args.workload == "wide"
        if wide:
            lens = (a.min_input_len, a.max_input_len), (a.min_output_len, a.max_output_len)
            reqs = workloads.wide(a.num_prompts, *lens)
        elif a.input:
            from turnout.engine.llm_engine import load_tokenizer

            tok, problem = load_tokenizer(self.cfg, self.model_dir)
            reqs = workloads.from_jsonl(a.input, tok, a.max_tokens, problem)
        else:
            reqs = workloads.throughput(a.num_prompts, a.max_input_len, a.max_output_len)
        sub = reqs if wide else workloads.subset(reqs, a.peer_subset, a.peer_output_len)
        runs = dict.fromkeys(RUNS, workloads.as_json(sub))
        res = self.run_peers({"runs": runs, "all": workloads.as_json(reqs)})
        llm = self.start()
        floors = self.run_floors(reqs)
        sub_floors = floors if wide else self.run_floors(sub)
        recs = self.timed_runs(llm, reqs, floors, res)
        for run in RUNS if any(p in res for p in peers.HF_ENGINES) else ():
            m = rate(*workloads.run(llm, sub))
            ours = m["output_tokens_per_s"]
            vs = {k: ratio(ours, metric(res, e, run)) for k, e in VS_HF.items()}
            near = vs_floor(ours, sub_floors.get(run))
            recs.append(self.record("turnout", run, subset=len(sub), **m, **vs, **near))
        llm.shutdown()
        whole = (*peers.BENCH_PY_PEERS, *peers.VARIANTS)  # the peers that ran the whole workload
        full = {e: res.pop(e) for e in whole if e in res}
        recs += self.peer_records(full, floors, num_prompts=len(reqs))
        return recs + self.peer_records(res, sub_floors, subset=len(sub)), _plotted(floors)

    wide = throughput

    def latency(self) -> tuple[list[dict], float | None]:
        a = self.args
        prompt = workloads.random_prompt  # fresh prompts per run: no prefix-cache hit between runs
        plan = {}
        for i, run in enumerate(RUNS):
            ttft = [prompt(n, 200 + 10 * i + j) for j, n in enumerate(self.ttft_lens)]
            plan[run] = {"tpot_prompt": prompt(32, 100 + i), "ttft_prompts": ttft}
        res = self.run_peers({"latency": {"tpot_tokens": a.tpot_tokens, "runs": plan}})
        skipped = [n for n in a.ttft_lens if n not in self.ttft_lens] or None
        llm = self.start()
        floors: dict[str, Any] = {}
        if self.ceiling:
            t, one = a.tpot_tokens, self._floor_s([(32, 0, 1)])  # a 32-token prompt, one output token
            floors["tpot_floor_ms"] = (self._floor_s([(32, 0, t + 1)]) - one) / t * 1e3
            floors["ttft_floor_ms"] = {str(n): self._floor_s([(n, 0, 1)]) * 1e3 for n in self.ttft_lens}
        measured, recs = workloads.latency(llm, a.tpot_tokens, plan), []
        for run, m in measured.items():
            vs = {}
            for engine, name in (("vllm", "vllm"), (peers.STATIC, "static"), (peers.BF16, "bf16")):
                vs[f"tpot_ratio_vs_{name}"] = ratio(m["tpot_ms"], metric(res, engine, run, "tpot_ms"))
                vs[f"ttft_ratio_vs_{name}"] = ratios(m["ttft_ms"], metric(res, engine, run, "ttft_ms"))
            near = vs_latency_floor(m, floors)
            recs.append(self.record("turnout", run, **m, ttft_skipped=skipped, **vs, **near))
        llm.shutdown()
        return recs + self.peer_records(res, floors), floors.get("tpot_floor_ms")

    def prefix(self) -> tuple[list[dict], float | None]:
        a = self.args
        lens = (a.num_prompts, a.prefix_len, a.suffix_len, a.output_len)
        runs = {run: workloads.prefix(*lens, seed=i) for i, run in enumerate(RUNS)}
        off_cfg = {**self.cfg.model_dump(), "enable_prefix_caching": False}
        off_runs = {r: workloads.as_json(q) for r, q in runs.items()}
        off = self.child("turnout", {"config": off_cfg, "runs": off_runs})
        llm, recs = self.start(enable_prefix_caching=True), []
        shapes = workloads.shapes(runs["first"], cached=a.prefix_len)
        shapes[0] = (shapes[0][0], 0, shapes[0][2])  # the first request computes the prefix
        floor, no_cache = self.floor(shapes), self.floor(workloads.shapes(runs["first"]))
        for run, reqs in runs.items():
            m = rate(*workloads.run(llm, reqs))
            ours, off_rate = m["output_tokens_per_s"], off[run]["output_tokens"] / off[run]["seconds"]
            m |= {"no_cache_output_tokens_per_s": off_rate, "speedup_vs_no_cache": ours / off_rate}
            m |= {"no_cache_startup_s": off["startup_s"], **vs_floor(ours, floor)}
            m["no_cache_over_floor"] = vs_floor(off_rate, no_cache).get("over_floor")
            recs.append(self.record("turnout", run, **m))
        llm.shutdown()
        return recs, _plotted({"first": floor})

    def structured(self) -> tuple[list[dict], None]:
        """Per --structured-output-ratio R: round(R * N) of nano-vllm's requests held to the schema, then
        the same prompts unconstrained, each to the tokens it produced constrained. Both runs do the same
        work, whose floor each record carries; the plot draws the cost, which has none."""
        a = self.args
        base = workloads.throughput(a.num_prompts, a.max_input_len, a.max_output_len)
        llm, recs = self.start(), []
        workloads.run(llm, [workloads.Req([1, 2, 3, 4], 8, json_schema=self.schema)])  # compiled, untimed
        for share in a.structured_output_ratio:
            reqs = workloads.structured(base, self.schema, share)
            constrained, plain = workloads.structured_pair(llm, reqs)
            m = structured_metrics(reqs, constrained, plain)
            floor = self.floor(workloads.shapes(workloads.same_lengths(reqs, constrained[1])))
            plain_over = vs_floor(m["unconstrained_output_tokens_per_s"], floor).get("over_floor")
            near = {**vs_floor(m["output_tokens_per_s"], floor), "unconstrained_over_floor": plain_over}
            recs.append(self.record("turnout", "first", structured_output_ratio=share, **m, **near))
        llm.shutdown()
        return recs, None

    def structured_schema(self) -> dict[str, Any]:
        """--json-schema's schema, or the built-in one; TurnoutError where a ratio constrains no request."""
        a = self.args
        if none := [r for r in a.structured_output_ratio if round(r * a.num_prompts) == 0]:
            raise TurnoutError(
                f"--structured-output-ratio {none[0]} constrains none of {a.num_prompts} "
                "requests; raise it or --num-prompts"
            )
        return workloads.json_schema(a.json_schema) if a.json_schema else workloads.JSON_SCHEMA

    # ---- peers ----
    def child(self, engine: str, plan: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
        return peers.child(engine, self.model_dir, self.dtype, plan, self.args.peer_timeout, env)

    def run_peers(self, plan: dict[str, Any]) -> dict[str, dict]:
        """Every peer's result by engine: startup_s, and per run a dict of metrics."""
        out: dict[str, dict] = {}
        for engine in self.peers:
            print(f"running peer {engine} ...", flush=True)
            used = peers.gpu_used_bytes()
            try:
                out[engine] = self.run_peer(engine, plan, used)
            except TurnoutError as e:  # turnout's own runs still count; the exit status says a peer failed
                print(f"error: {e}; its records are left out", file=sys.stderr, flush=True)
                self.failed.append(engine)
            peers.wait_for_gpu(used)  # the next engine, or turnout, gets the whole GPU
        return out

    def run_peer(self, engine: str, plan: dict[str, Any], used: int | None = None) -> dict[str, Any]:
        """One peer's result; used: the GPU's memory in use before it started."""
        if engine in peers.VARIANTS:  # the whole workload (HF peers run plan["runs"], a subset)
            static: dict[str, Any] = {"config": self.variant_configs[engine]}
            if "all" in plan:
                static["runs"] = dict.fromkeys(RUNS, plan["all"])
            if "latency" in plan:
                static["latency"] = plan["latency"]
            plan = static
        here = self.args.workload in CHILD_PEERS
        if engine not in peers.BENCH_PY_PEERS or here:
            env = None
            if engine in peers.BENCH_PY_PEERS:  # vLLM or nano-vllm over this workload's requests
                env = peers.vllm_env(self.args.vllm_site) if engine == "vllm" else peers.nano_vllm_env()
                plan = {"runs": plan["runs"], "max_model_len": self.cfg.max_model_len}
                plan |= {"precision": self.vllm_precision()} if engine == "vllm" else {}
            res = self.child(engine, plan, env)
            for run in RUNS if "runs" in plan else ():
                res[run] = rate(res[run]["seconds"], res[run]["output_tokens"])
            return res
        lat, a = "latency" in plan, self.args
        d = peers.find_peers_dir(a.peers_dir, peers.BENCH_PY_PEERS[engine])
        res = peers.bench_py(
            engine, self.model_dir, d, lat, a.peer_timeout, a.vllm_site, self.vllm_precision()
        )
        tpot = res.get("tpot_ms")  # MODE=tpot times decode only
        metrics = {
            run: {"tpot_ms": tpot, "ttft_ms": {}} if lat else {"output_tokens_per_s": res[run]}
            for run in RUNS
        }
        out = {"startup_s": res["startup_s"], "version": res.get("version"), **metrics}
        if engine == "vllm" and lat and self.ttft_lens:  # TTFT at turnout's max_model_len
            peers.wait_for_gpu(used)
            plan = {**plan, "max_model_len": self.cfg.max_model_len, "precision": self.vllm_precision()}
            try:
                ttft = self.child("vllm", plan, peers.vllm_env(a.vllm_site))
            except TurnoutError as e:  # vLLM's TPOT stands
                print(f"error: {e}; vllm's TTFT is left out", file=sys.stderr, flush=True)
                self.failed.append("vllm (TTFT)")
                return out
            out["ttft_startup_s"] = ttft["startup_s"]
            for run in RUNS:
                out[run]["ttft_ms"] = ttft[run]["ttft_ms"]
        return out

    # ---- roofline ----
    def _floor_s(self, shapes: list[tuple[int, int, int]]) -> float:
        """The least seconds the requests' work takes here, at most max_num_seqs of them a step: turnout's,
        as its started engine resolved it."""
        return roofline.floor(self.shape, shapes, self.ceiling, self.selection["max_num_seqs"]).seconds

    def floor(self, shapes: list[tuple[int, int, int]]) -> dict[str, float] | None:
        """The floor of the requests' work: floor_s and floor_output_tokens_per_s; None without a ceiling."""
        if not self.ceiling:
            return None
        seconds = self._floor_s(shapes)
        return {"floor_s": seconds, "floor_output_tokens_per_s": sum(o for _, _, o in shapes) / seconds}

    def run_floors(self, reqs: list[workloads.Req]) -> dict[str, dict[str, float] | None]:
        """The floor of each run of reqs: the first from scratch, the repeat with every prompt in the prefix
        cache (all but its last token, which runs to sample)."""
        cached = {"first": 0, "repeat": max(len(r.prompt) for r in reqs)}
        return {run: self.floor(workloads.shapes(reqs, n)) for run, n in cached.items()}

    def roofline_line(self, recs: list[dict]) -> str:
        """The ceilings, and the floor of each of turnout's runs; each record's time over it is its
        over_floor (TPOT and TTFT: tpot_over_floor, ttft_over_floor). A latent KV cache's bytes a token come
        first, against what K and V of every attention head would take."""
        kv, standard = self.shape.kv_bytes_per_token, self.shape.standard_kv_bytes_per_token
        if standard:  # a latent KV cache
            less = f"{standard / kv:.1f}x less than K and V of every head take ({standard:,})"
            return f"KV cache: {kv:,} bytes a token, {less}\n{self._roofline_line(recs)}"
        return self._roofline_line(recs)

    def _roofline_line(self, recs: list[dict]) -> str:
        if not self.ceiling:
            return f"roofline: no ceiling known for {self.device}"
        c, fmt = self.ceiling, records.fmt
        head = f"roofline at {c.bytes_per_s / 1e12:.1f} TB/s, {c.flops_per_s / 1e12:.0f} TFLOP/s ({c.where})"
        ours = [r for r in recs if r["engine"] == "turnout" and "subset" not in r]
        if self.args.workload == "latency":
            ttft = ", ".join(f"{n}: {fmt(ms)}" for n, ms in ours[0]["ttft_floor_ms"].items())
            return f"{head}: TPOT floor {fmt(ours[0]['tpot_floor_ms'])} ms, TTFT floor (ms) {ttft or '-'}"
        floors = "; ".join(_floor_phrase(r) for r in ours if "floor_s" in r)
        return f"{head}: floor {floors}; over_floor is each engine's time over it"


def structured_metrics(
    reqs: list[workloads.Req], constrained: tuple[float, list], plain: tuple[float, list]
) -> dict[str, Any]:
    """A structured run's record metrics from its (seconds, outputs) and the unconstrained run's."""
    (seconds, outs), (plain_s, plain_outs) = constrained, plain
    m = rate(seconds, sum(len(o.token_ids) for o in outs))
    plain_rate = sum(len(o.token_ids) for o in plain_outs) / plain_s
    held = [o for r, o in zip(reqs, outs) if r.json_schema is not None]
    return {
        **m,
        "unconstrained_output_tokens_per_s": plain_rate,
        "unconstrained_seconds": plain_s,
        "structured_cost": 1 - m["output_tokens_per_s"] / plain_rate,
        "num_prompts": len(reqs),
        "num_constrained": len(held),
        "num_completed": sum(o.finish_reason == "stop" for o in held),  # grammars that ended their request
        "mean_output_len": m["output_tokens"] / len(reqs),
    }


def counted_run(llm: Any, reqs: list[workloads.Req]) -> dict[str, Any]:
    """rate() of llm's run over reqs, with what the engine counts where it counts (not data parallel): the
    run's preemptions and KV blocks, and its prefix_cache_hit_rate in prompt tokens where it looked some up
    (a repeat of the same prompts hits their cached blocks)."""
    stats = getattr(llm.engine, "stats", lambda: None)
    before = stats()
    m = rate(*workloads.run(llm, reqs))
    if before is None:
        return m
    after = stats()
    m["num_preemptions"] = after["preemptions"] - before["preemptions"]
    m["num_gpu_blocks"] = after["total_blocks"]
    if after["prefix_cache_queries"] > before["prefix_cache_queries"]:
        hits, queries = (after[k] - before[k] for k in ("prefix_cache_hits", "prefix_cache_queries"))
        m["prefix_cache_hit_rate"] = round(hits / queries, 4)
    return m


def _floor_phrase(rec: dict[str, Any]) -> str:
    """The floor of the run a record is of: its run ("first", "repeat", or a structured run's "first at 0.25
    held"), floor_s and floor_output_tokens_per_s."""
    share = rec.get("structured_output_ratio")
    run = rec["run"] + (f" at {share:g} held" if share is not None else "")
    return f"{run} {rec['floor_s']:.3g} s ({records.fmt(rec['floor_output_tokens_per_s'])} output tok/s)"


def _plotted(floors: dict[str, Any]) -> float | None:
    """The first run's floor in output tok/s: the line a plot draws."""
    return (floors.get("first") or {}).get("floor_output_tokens_per_s")
