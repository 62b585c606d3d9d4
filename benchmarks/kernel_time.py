"""nano-vllm's bench as the sum of its kernels: at the rates an H200 step profile measured, at the ceilings.

  python benchmarks/kernel_time.py --random-model qwen3-8b \
      --decode benchmarks/results/profile-step/2026-12-02-0112-h200-step-qwen3-8b-ctx1024.json \
      --prefill benchmarks/results/profile-step/2026-12-02-1336-h200-step-qwen3-8b-prefill4k-gaps.json \
      --bench benchmarks/results/throughput/2026-12-02-1343-h200-throughput-qwen3-8b-vs-vllm-per-phase.json

The bench's 256 requests (prompts, then outputs of 100-1024 tokens) run as the engine schedules them with
every request admitted: one prefill of all prompts, then decode step s for the requests with more than s
outputs. A decode step at batch m costs its profile's buckets (GEMMs, norms, LM head, sampling, the rest)
interpolated between the decode1 and decodeN phases, plus attention over its requests' keys at the bytes/s
decodeN's attention reached (--attention-bw overrides it, e.g. a kernel bench's figure). The prefill costs
the prefill phase's GEMM FLOP rate, its attention FLOP rate and its other kernels per token. "ceilings"
puts every GEMM at max(weight bytes / bandwidth, FLOPs / matmul ceiling) and attention at the ceilings,
with the other kernels as measured. No host time: what the engines spend beyond it is overhead.
--bench: a throughput record (turnout beside vLLM): each engine's first run over these times, and the
output tok/s a ratio over vLLM would need (--ratios).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_json  # noqa: E402

from turnout.bench.random_models import SHAPES, random_config  # noqa: E402
from turnout.bench.roofline import CEILINGS, Shape  # noqa: E402
from turnout.bench.workloads import Req, throughput  # noqa: E402

H200 = CEILINGS["H200"]
OTHER = ("norm/rotary/act", "lm_head", "sampling", "memcpy/memset", "other")


def shape_of(name: str) -> tuple[int, Shape]:
    """(the layers' matmul weights, the LM head left out, and the bf16 Shape with them)."""
    cfg = random_config(name)
    hidden = cfg.hidden_size
    head = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head, 2 * cfg.num_key_value_heads * head
    body = cfg.num_hidden_layers * (hidden * (q + kv) + q * hidden + 3 * hidden * cfg.intermediate_size)
    return body, Shape.from_config(cfg.to_dict(), body, 2)


def phases(path: str) -> dict[str, dict]:
    """A profile-step record's phases by name: the phase's fields, its buckets as {bucket: us per step} in
    "b", and the record's config in "config"."""
    doc = json.loads(Path(path).read_text())
    return {
        r["phase"]: {**r, "b": {b["bucket"]: b["us/step"] for b in r["buckets"]}, "config": doc["config"]}
        for r in doc["results"]
        if "buckets" in r
    }


def interpolate(one: dict, many: dict, n: int):
    """Seconds of a bucket at batch m: linear between decode1's and decodeN's."""

    def at(bucket: str, m: int) -> float:
        lo, hi = one["b"].get(bucket, 0.0), many["b"].get(bucket, 0.0)
        return (lo + (hi - lo) * (m - 1) / (n - 1)) * 1e-6

    return at


def model(a: argparse.Namespace, reqs: list[Req]) -> tuple[dict, dict]:
    """Seconds of reqs' kernels at the measured rates and at the ceilings, by part; and the rates."""
    body, shape = shape_of(a.random_model)
    kv, pair = shape.kv_bytes_per_token, shape.attn_flops_per_pair
    dec, pre = phases(a.decode), phases(a.prefill)["prefill"]
    one = dec["decode1"]
    n = max(int(k[6:]) for k in dec if k.startswith("decode") and k != "decode1")
    many, cfg = dec[f"decode{n}"], dec[f"decode{n}"]["config"]
    keys = n * (cfg["context"] + cfg["warmup"] + cfg["steps"])  # a profiled step's, as profile_step counts
    bw = a.attention_bw or keys * kv / (many["b"]["attention"] * 1e-6)
    tokens = pre["config"]["prefill_len"]
    rates = {
        "decode_attention_bytes_per_s": bw,
        "prefill_gemm_flops_per_s": 2 * body * tokens / (pre["b"]["gemm/gemv"] * 1e-6),
        "prefill_attention_flops_per_s": pair * tokens * (tokens + 1) / 2 / (pre["b"]["attention"] * 1e-6),
    }
    other_per_token = sum(pre["b"].get(k, 0.0) for k in OTHER) * 1e-6 / tokens
    at = interpolate(one, many, n)
    lens, outs = [len(r.prompt) for r in reqs], [r.max_tokens for r in reqs]
    flops = 2 * body * sum(lens), pair * sum(x * (x + 1) // 2 for x in lens)  # prefill: GEMMs, attention
    parts = ("prefill", "decode_gemm", "decode_attention", "decode_other")
    t = {k: dict.fromkeys(parts, 0.0) for k in ("measured", "ceilings")}
    t["measured"]["prefill"] = (flops[0] / rates["prefill_gemm_flops_per_s"]
                                + flops[1] / rates["prefill_attention_flops_per_s"])  # fmt: skip
    t["ceilings"]["prefill"] = sum(flops) / H200.flops_per_s
    for s in range(1, max(outs)):
        ctx = [x + s for x, o in zip(lens, outs) if o > s]  # decode step s: the requests with more outputs
        m = len(ctx)
        t["measured"]["decode_gemm"] += at("gemm/gemv", m)
        t["ceilings"]["decode_gemm"] += max(2 * body / H200.bytes_per_s, 2 * body * m / H200.flops_per_s)
        t["measured"]["decode_attention"] += sum(ctx) * kv / bw
        t["ceilings"]["decode_attention"] += sum(ctx) * kv / H200.bytes_per_s
        for part in t.values():
            part["decode_other"] += sum(at(k, m) for k in OTHER)  # the LM head is one of them
    for part in t.values():
        part["prefill"] += other_per_token * sum(lens)
    return t, rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random-model", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--decode", required=True, help="a profile-step record with decode1 and decodeN phases")
    ap.add_argument("--prefill", required=True, help="a profile-step record with a prefill phase")
    ap.add_argument("--attention-bw", type=float, help="decode attention bytes/s instead of decodeN's")
    ap.add_argument("--bench", help="a throughput record of turnout beside vLLM")
    ap.add_argument("--ratios", type=float, nargs="*", default=[1.1, 1.2], help="targets over vLLM's tok/s")
    ap.add_argument("--json", help="write the record here")
    a = ap.parse_args()
    reqs = throughput()
    t, rates = model(a, reqs)
    outputs = sum(r.max_tokens for r in reqs)
    rows = [{"rates": k, **v, "seconds": sum(v.values()), "output tok/s": outputs / sum(v.values())}
            for k, v in t.items()]  # fmt: skip
    print_table(rows)
    engines = []
    if a.bench:
        first = {r["engine"]: r["output_tokens_per_s"] for r in json.loads(Path(a.bench).read_text())
                 if r["run"] == "first"}  # fmt: skip
        wanted = {**first, **{f"{x:.2f}x vLLM": x * first["vllm"] for x in a.ratios}}
        engines = [{"engine": e, "output tok/s": tps, "seconds": outputs / tps,
                    **{f"/ {r['rates']} kernel time": outputs / tps / r["seconds"] for r in rows}}
                   for e, tps in wanted.items()]  # fmt: skip
        print()
        print_table(engines)
    if a.json:
        write_json(a.json, rows, a, rates=rates, engines=engines, model=f"random-{a.random_model}")


if __name__ == "__main__":
    main()
