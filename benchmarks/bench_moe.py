"""Expert parallelism on a Qwen3-30B-A3B-shaped random model with fewer layers: greedy outputs of each config
against the first, throughput on the mixed workload of bench_parallel, and memory per rank.

  python benchmarks/run.py moe                                                   # 2 GPUs: the "moe" suite
  python benchmarks/bench_moe.py --json benchmarks/results/moe/moe.json           # the same, bf16 part
  python benchmarks/bench_moe.py --tiny --device cpu --quick --skip-throughput           # CPU smoke (gloo)

A config is bench_parallel's tp<N> / dp<N>, with an "ep" suffix for enable_expert_parallel: tp1 (EP=1, the
reference), tp2 (each expert's intermediate dim split over 2 ranks), tp2ep (EP=2, attention TP), dp2ep
(EP=2, attention data-parallel: each replica a rank). Agreement with the first config is measured free
running and teacher forced (bench_parallel): in bfloat16, TP sums its partial products in another order
and the grouped GEMM picks its tiles by the pairs per expert, so a near-tie may part; --dtype float32 makes
the check strict. Memory per rank is Worker.memory_report: weight bytes (experts apart), KV cache bytes and
the peak allocated (CUDA).

The checkpoint is written directly (per-expert tensors, as the real Qwen3-30B-A3B's), N(0, 0.02), once per
--model-dir.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_parallel import compare, parse_args, parse_config  # noqa: E402
from common import print_table, write_json  # noqa: E402

# Qwen3-30B-A3B's config.json, less its 48 layers
QWEN3_30B_A3B = dict(
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936, tie_word_embeddings=False,
    rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def make_random_moe(path: Path, layers: int, seed: int = 0, **shape) -> Path:
    """config.json, one safetensors file a layer (bf16, N(0, 0.02), norms 1) and a small tokenizer."""
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    from turnout.bench.random_models import write_tokenizer

    if (path / "config.json").exists():
        return path
    cfg = Qwen3MoeConfig(**{**QWEN3_30B_A3B, **shape, "num_hidden_layers": layers})
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    h, d, e, i = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.moe_intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(dev).manual_seed(seed)
    rand = lambda *s: (torch.randn(*s, generator=g, device=dev) * 0.02).to(torch.bfloat16).cpu()
    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    index: dict[str, str] = {}

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, path / name, metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, name))

    v = cfg.vocab_size
    ends = {
        "model.embed_tokens.weight": rand(v, h),
        "lm_head.weight": rand(v, h),
        "model.norm.weight": ones(h),
    }
    shard("embed.safetensors", ends)
    for n in range(layers):
        p = f"model.layers.{n}."
        t = {p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
             p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
             p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
             p + "self_attn.q_norm.weight": ones(d), p + "self_attn.k_norm.weight": ones(d),
             p + "mlp.gate.weight": rand(e, h)}  # fmt: skip
        for x in range(e):
            ex = f"{p}mlp.experts.{x}."
            t |= {ex + "gate_proj.weight": rand(i, h), ex + "up_proj.weight": rand(i, h),
                  ex + "down_proj.weight": rand(h, i)}  # fmt: skip
        shard(f"layer-{n:03d}.safetensors", t)
    index_doc = {"metadata": {}, "weight_map": index}
    (path / "model.safetensors.index.json").write_text(json.dumps(index_doc))
    write_tokenizer(path, cfg.vocab_size)
    cfg.save_pretrained(path)  # last: its presence marks a complete checkpoint
    return path


def parse(name: str) -> dict[str, int | bool]:
    """'tp2ep' -> {'tp': 2, 'pp': 1, 'dp': 1, 'ep': True}."""
    ep = name.endswith("ep")
    return {**parse_config(name.removesuffix("ep")), "ep": ep}


def memory(llm) -> list[dict]:
    """Worker.memory_report of every rank, replicas in order, in MiB."""
    engines = getattr(llm.engine, "engines", [llm.engine])
    reports = [r for e in engines for r in e.executor.collective_rpc("memory_report")]
    keys = ("weight_bytes", "expert_weight_bytes", "kv_cache_bytes", "peak_allocated_bytes")
    mib = lambda r: {k.replace("_bytes", "_mib"): round(r[k] / 2**20, 1) for k in keys if k in r}
    return [mib(r) for r in reports]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["tp1", "tp2ep", "dp2ep", "tp2"],
                    help="the first is the reference")  # fmt: skip
    ap.add_argument("--layers", type=int, default=12, help="of Qwen3-30B-A3B's 48 (bf16: ~1.25 GB a layer)")
    ap.add_argument("--model-dir", help="default /tmp/turnout-qwen3-30b-a3b-<layers>l (-tiny with --tiny)")
    ap.add_argument(
        "--tiny", action="store_true", help="hidden 64, 8 experts top-2, 2 layers (CPU smoke runs)"
    )
    ap.add_argument("--executor", default="multiproc", help="every config in worker processes, as dp2ep")
    args, configs = parse_args(ap, parse)

    if args.tiny:
        tiny = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                    vocab_size=512)  # fmt: skip
        path = make_random_moe(Path(args.model_dir or "/tmp/turnout-qwen3-moe-tiny"), 2, **tiny)
        model = "tiny Qwen3-MoE (2 layers, hidden 64, 8 experts top-2), random weights"
    else:
        path = make_random_moe(
            Path(args.model_dir or f"/tmp/turnout-qwen3-30b-a3b-{args.layers}l"), args.layers
        )
        model = f"Qwen3-30B-A3B-shaped, {args.layers} of 48 layers, random bf16 weights"
    sizes = lambda c: dict(
        tensor_parallel_size=c["tp"], data_parallel_size=c["dp"], enable_expert_parallel=c["ep"]
    )
    runs = [(name, sizes(c)) for name, c in zip(args.configs, configs)]
    describe = lambda llm: {"moe_kernel": llm.selection.moe.chosen.name, "memory_per_rank": memory(llm)}
    after = lambda llm: {"memory_per_rank": memory(llm)}  # peaks after the workloads
    rows, extra = compare(path, runs, describe, after, args, model)
    keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k != "memory_per_rank"]
    print_table([{k: r.get(k, "") for k in keys} for r in rows])
    for r in rows:
        for rank, m in enumerate(r.get("memory_per_rank", [])):
            print(f"{r['config']} rank {rank}: {m}")
    write_json(args.json, rows, args, **extra)


if __name__ == "__main__":
    main()
