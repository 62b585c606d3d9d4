"""Peers, each in its own process so that one GPU holds one engine at a time; each prints one line
`RESULT {json}`. nano-vllm runs through nanobench.py and vLLM through vllmbench.py (../shared/peers/), both
nano-vllm's own bench.py workload (or batch-1 TPOT with MODE=tpot); vLLM runs with its site folder as its
whole PYTHONPATH. HF transformers, and vLLM and nano-vllm over any other requests, run here
(`python -m turnout.bench.peers ENGINE MODEL DTYPE PLAN.json`): `generate_batch` (continuous batching) and
static `generate` over the plan's requests, or the latency plan at batch 1; vLLM's offline `LLM` over the
latency plan's TTFT prompts or over the plan's runs; nano-vllm's `LLM` over the plan's runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from turnout.bench import workloads
from turnout.bench.workloads import timed
from turnout.errors import TurnoutError

HF_ENGINES = ("hf-generate-batch", "hf-generate")
BENCH_PY_PEERS = {"nano-vllm": "nanobench.py", "vllm": "vllmbench.py"}  # peer: its runner in the peers dir
STATIC = "turnout-static"  # turnout with tuned = off: the static default beside the measured selection
BF16 = "turnout-bf16"  # turnout on the unquantized weights with a 16-bit KV cache, beside an FP8 run
VARIANTS = (STATIC, BF16)  # turnout itself in a child process, at another config
PEERS = (*BENCH_PY_PEERS, *HF_ENGINES, *VARIANTS)
VLLM_SITE = "/tmp/vllm-site"
REPO = Path(__file__).resolve().parents[2]


def find_peers_dir(explicit: str | None, runner: str = "nanobench.py") -> Path:
    """--peers-dir, else the first of ../shared/peers, shared/peers, .peer beside the repository that holds
    the runner."""
    default = [REPO.parent / "shared/peers", REPO / "shared/peers", REPO / ".peer"]
    tries = [Path(explicit)] if explicit else default
    for d in tries:
        if (d / runner).is_file():
            return d
    raise TurnoutError(
        f"no {runner} in {', '.join(map(str, tries))}; pass --peers-dir DIR "
        "(../shared/peers/README.md says what it needs)"
    )


def vllm_env(site: str | Path) -> dict[str, str]:
    """This environment with PYTHONPATH replaced by vLLM's site folder alone: vLLM brings its own FlashInfer,
    which the folders on turnout's PYTHONPATH would shadow."""
    site = Path(site)
    if not (site / "vllm").is_dir():
        raise TurnoutError(
            f"vllm peer: no vllm/ in {site}; pass --vllm-site DIR (../shared/peers/fetch-vllm.sh builds it)"
        )
    return {**os.environ, "PYTHONPATH": str(site)}


def nano_vllm_env() -> dict[str, str]:
    """This environment with NANOVLLM_SRC, nano-vllm's source folder (default .peer/ in the repository)."""
    return {"NANOVLLM_SRC": str(REPO / ".peer"), **os.environ}


def _result(cmd: list[str], env: dict[str, str], name: str, timeout: float) -> dict[str, Any]:
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise TurnoutError(f"peer {name} ran past {timeout:.0f} s; raise --peer-timeout") from None
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
    raise TurnoutError(f"peer {name} failed (exit {p.returncode}): {tail}")


def bench_py(
    engine: str, model_dir: str, peers_dir: Path, tpot: bool, timeout: float, site: str | Path = VLLM_SITE,
    precision: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """nanobench.py's or vllmbench.py's RESULT: startup_s (vLLM: and version), and first/repeat tok/s, or
    tpot_ms with MODE=tpot; vLLM with its site folder as its whole PYTHONPATH, at `precision` (its LLM's
    quantization and kv_cache_dtype, passed as vllmbench.py's QUANTIZATION and KV_CACHE_DTYPE)."""
    env = vllm_env(site) if engine == "vllm" else nano_vllm_env()
    for key in ("MODE", "QUANTIZATION", "KV_CACHE_DTYPE"):  # this call's, never the caller's environment's
        env.pop(key, None)
    env |= {"MODE": "tpot"} if tpot else {}
    if engine == "vllm" and precision:
        env |= {
            "QUANTIZATION": precision["quantization"] or "",
            "KV_CACHE_DTYPE": precision["kv_cache_dtype"],
        }
    args = ["nanovllm"] if engine == "nano-vllm" else []
    cmd = [sys.executable, str(peers_dir / BENCH_PY_PEERS[engine]), *args, model_dir]
    return _result(cmd, env, engine, timeout)


def child(
    engine: str, model_dir: str, dtype: str, plan: dict[str, Any], timeout: float, env: dict | None = None
) -> dict[str, Any]:
    """An HF peer or turnout (or a VARIANTS one, with plan["config"]) over plan["runs"] or plan["latency"];
    vLLM (with env=vllm_env(site)) over plan["runs"] or the latency plan's TTFT prompts; nano-vllm (with
    env=nano_vllm_env()) over plan["runs"]."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(plan, f)
    try:
        cmd = [sys.executable, "-m", "turnout.bench.peers", engine, model_dir, dtype, f.name]
        return _result(cmd, env or dict(os.environ), engine, timeout)
    finally:
        os.unlink(f.name)


def gpu_used_bytes() -> int | None:
    """Memory in use on the GPU, by every process (through NVML, so this process makes no CUDA context);
    None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        return torch.cuda.device_memory_used()
    except Exception:  # no NVML here: what CUDA sees, at the cost of a context
        free, total = torch.cuda.mem_get_info()
        return total - free


def wait_for_gpu(used_before: int | None, timeout: float = 120) -> None:
    """Until the GPU's memory in use is back within 1 GiB of used_before: a peer's engine-core processes
    can free theirs after the peer itself has exited."""
    deadline = time.monotonic() + timeout
    while used_before is not None and (gpu_used_bytes() or 0) > used_before + (1 << 30):
        if time.monotonic() > deadline:
            print(f"note: GPU memory not back after {timeout:.0f} s; going on", file=sys.stderr, flush=True)
            return
        time.sleep(1)


# ---- the HF process ----
def _generate(model: Any, prompts: list[list[int]], new: int) -> int:
    """Static batching: left-padded prompts, exactly `new` greedy tokens each; returns the tokens made."""
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    greedy = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    out = model.generate(input_ids=ids, attention_mask=mask, **greedy)
    return (out.shape[1] - width) * len(prompts)


def _generate_batch(model: Any, prompts: list[list[int]], new: int) -> int:
    """Continuous batching, the whole call timed (it sizes its cache and warms up per call, as a user's
    call does); EOS off (-1), greedy. On a GPU with HF's defaults; on a CPU with a cache the size of the
    requests."""
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    kw = {}
    if model.device.type == "cpu":  # HF sizes a CPU cache from total RAM, blind to other processes
        from transformers import ContinuousBatchingConfig

        pages = sum(-(-(len(p) + new) // 256) for p in prompts) + len(prompts)  # its default 256-token page
        kw["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=pages)
    outs = model.generate_batch(inputs=prompts, generation_config=gc, **kw)
    if len(outs) != len(prompts) or any(o.error for o in outs.values()):
        raise RuntimeError(f"generate_batch finished {len(outs)} of {len(prompts)} requests")
    return sum(len(o.generated_tokens) for o in outs.values())


def _turnout(engine: str, plan: dict[str, Any]) -> dict[str, Any]:
    """turnout with plan["config"] in a process of its own (the prefix workload's engine without caching,
    VARIANTS), over plan["runs"] or plan["latency"]; its selection as the bench records it."""
    from turnout import LLM
    from turnout.config import EngineConfig

    t0 = time.perf_counter()
    llm = LLM(config=EngineConfig(**plan["config"]))
    res: dict[str, Any] = {"engine": engine, "startup_s": round(time.perf_counter() - t0, 2)}
    res["selection"] = workloads.selection(llm)
    workloads.warm_up(llm)
    for run, reqs in plan.get("runs", {}).items():
        seconds, tokens = workloads.run(llm, [workloads.Req(**r) for r in reqs])
        res[run] = {"seconds": seconds, "output_tokens": tokens}
    if lat := plan.get("latency"):
        res |= workloads.latency(llm, lat["tpot_tokens"], lat["runs"])
    llm.shutdown()
    return res


def _fa4_for_nano_vllm() -> None:
    """nano-vllm's two FlashAttention-2 calls on FlashAttention-4's paged varlen kernel (no FA2 wheel is
    built for this torch), as nanobench.py maps them: varlen with page_table and seqused_k (nano-vllm passes
    its arguments by name; max_seqlen_q and _k go unused), and decode as varlen with one query per request."""
    import flash_attn
    import torch
    from flash_attn.cute import flash_attn_varlen_func as fa4

    first = lambda x: x[0] if isinstance(x, tuple) else x  # noqa: E731

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=True, block_table=None, **_):
        kw = dict(cu_seqlens_q=cu_seqlens_q, softmax_scale=softmax_scale, causal=causal)
        if block_table is None:
            return first(fa4(q, k, v, cu_seqlens_k=cu_seqlens_k, **kw))
        used = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).int()
        return first(fa4(q, k, v, seqused_k=used, page_table=block_table.clamp(min=0), **kw))

    def kvcache(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None, causal=True):
        cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        kw = dict(softmax_scale=softmax_scale, causal=causal, page_table=block_table.clamp(min=0))
        out = fa4(q.squeeze(1), k_cache, v_cache, cu_seqlens_q=cu, seqused_k=cache_seqlens, **kw)
        return first(out).unsqueeze(1)

    flash_attn.flash_attn_varlen_func, flash_attn.flash_attn_with_kvcache = varlen, kvcache


def _offline(engine: str, model_dir: str, plan: dict[str, Any]) -> dict[str, Any]:
    """vLLM's offline LLM with its defaults, or nano-vllm (NANOVLLM_SRC) with CUDA graphs, at
    plan["max_model_len"] as vllmbench.py and nanobench.py start them (vLLM at plan["precision"]); after
    their warm-up, each run's requests in one timed `generate`, or (vLLM, a latency plan) each TTFT prompt
    alone, one output token, timed as turnout's ttft_ms."""
    if engine == "vllm":
        import vllm
        from vllm import LLM, SamplingParams, TokensPrompt

        kw, res = {"seed": 0, **plan.get("precision", {})}, {"version": vllm.__version__}
        prompt, tokens = lambda ids: TokensPrompt(prompt_token_ids=ids), lambda o: len(o.outputs[0].token_ids)
    else:
        _fa4_for_nano_vllm()
        sys.path.insert(0, os.environ["NANOVLLM_SRC"])
        from nanovllm import LLM, SamplingParams

        kw, res = {"enforce_eager": False}, {}
        prompt, tokens = lambda ids: ids, lambda o: len(o["token_ids"])
    t0 = time.perf_counter()
    llm = LLM(model_dir, max_model_len=plan["max_model_len"], **kw)
    res |= {"engine": engine, "startup_s": round(time.perf_counter() - t0, 2)}
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)

    def generate(prompts: list[list[int]], params: Any) -> tuple[float, list[Any]]:
        t = time.perf_counter()
        outs = llm.generate([prompt(p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t, outs

    if lat := plan.get("latency"):
        one = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1)
        for run, p in lat["runs"].items():
            res[run] = {"ttft_ms": {str(len(q)): generate([q], one)[0] * 1e3 for q in p["ttft_prompts"]}}
    for run, reqs in plan.get("runs", {}).items():
        keys = ("temperature", "ignore_eos", "max_tokens")
        params = [SamplingParams(**{k: r[k] for k in keys}) for r in reqs]
        seconds, outs = generate([r["prompt"] for r in reqs], params)
        res[run] = {"seconds": seconds, "output_tokens": sum(map(tokens, outs))}
    return res


def main(engine: str, model_dir: str, dtype: str, plan_file: str) -> dict[str, Any]:
    plan = json.loads(Path(plan_file).read_text())
    if engine in ("turnout", *VARIANTS):
        return _turnout(engine, plan)
    if engine in BENCH_PY_PEERS:
        return _offline(engine, model_dir, plan)
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    res: dict[str, Any] = {"engine": engine, "startup_s": round(time.perf_counter() - t0, 2), "dtype": dtype}
    fn = _generate_batch if engine == "hf-generate-batch" else _generate
    with torch.no_grad():
        fn(model, [[1, 2, 3, 4]], 4)  # warm-up
        for run, reqs in plan.get("runs", {}).items():  # one output length: what static batching runs
            seconds, tokens = timed(fn, model, [r["prompt"] for r in reqs], reqs[0]["max_tokens"])
            res[run] = {"seconds": seconds, "output_tokens": tokens}
        if lat := plan.get("latency"):
            one = lambda p, n: timed(fn, model, [p], n)[0]  # seconds of one request
            res |= workloads.latency(None, lat["tpot_tokens"], lat["runs"], one)
    return res


if __name__ == "__main__":
    print("RESULT", json.dumps(main(*sys.argv[1:5])), flush=True)
    if sys.argv[1] == "nano-vllm":  # its result is out; end as nanobench.py ends, past nano-vllm's exit hooks
        os._exit(0)
