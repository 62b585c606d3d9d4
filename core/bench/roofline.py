"""The floor of a workload on a device: the least time its bytes and its FLOPs can take at the device's
ceilings. Weights are read once per engine step, every decode token reads its request's KV context once,
and every computed token writes its K and V once."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Ceiling:
    bytes_per_s: float
    flops_per_s: float  # dense matmul in the engine's dtype
    where: str  # how and where the ceiling was measured
    fp8_flops_per_s: float | None = None  # dense e4m3 matmul; None (not measured): at flops_per_s


# One row per device, matched by substring of torch.cuda.get_device_name(). Only measured values go here.
CEILINGS = {  # FP8: an 8192^3 e4m3 _scaled_mm with row-wise scales (benchmarks/results/fp8/)
    "H200": Ceiling(4.3e12, 790e12, "measured on one H200 (141 GB HBM3e): a large device-to-device copy, "
                    "a bf16 matmul", fp8_flops_per_s=1222e12),
    "H100 80GB HBM3": Ceiling(3.05e12, 784e12, "measured on one H100 80GB HBM3: a 4 GiB device-to-device "
                              "copy, an 8192^3 bf16 matmul", fp8_flops_per_s=1369e12),
}  # fmt: skip


def ceiling_for(device: str) -> Ceiling | None:
    return next((c for name, c in CEILINGS.items() if name in device), None)


@dataclass(frozen=True)
class Shape:
    """What a model step costs: matmul weights (the LM head included, the embedding gather not), KV bytes
    per token over all layers (values of dtype_bytes), and attention FLOPs per (query, key) pair over all
    layers. A token runs through expert_share of the routed experts' weights. standard_kv_bytes_per_token:
    what K and V of every attention head would take, where a latent vector is cached instead (MLA)."""

    weight_params: int
    kv_bytes_per_token: int
    attn_flops_per_pair: int
    dtype_bytes: int
    fp8_params: int = 0  # of weight_params, those read as one byte and multiplied in FP8
    expert_params: int = 0  # of weight_params, the routed experts'
    expert_share: float = 1.0  # experts a token routes to over routed experts
    standard_kv_bytes_per_token: int | None = None

    def cached_in(self, nbytes: int) -> Shape:
        """This shape with its KV cache in values of nbytes (an FP8 cache: 1)."""
        per_value = lambda b: b and b * nbytes // self.dtype_bytes  # noqa: E731
        return replace(self, kv_bytes_per_token=per_value(self.kv_bytes_per_token),
                       standard_kv_bytes_per_token=per_value(self.standard_kv_bytes_per_token))  # fmt: skip

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, dtype_bytes: int, fp8_linears: bool = False) -> Shape:
        """fp8_linears: the decoder's linear weights run in FP8 (quantized at load); an FP8 checkpoint's
        e4m3 tensors count as FP8 either way."""
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        params, embed, fp8, linear, experts = _safetensors_params(Path(model_dir))
        tied = cfg.get("tie_word_embeddings", False)  # a tied embedding is read as the LM head
        shape = cls.from_config(cfg, params if tied else params - embed, dtype_bytes)
        return replace(shape, fp8_params=linear if fp8_linears else fp8, expert_params=experts)

    @classmethod
    def from_config(cls, cfg: dict[str, Any], weight_params: int, dtype_bytes: int) -> Shape:
        """The shape of an HF config's attention and routing, with weight_params matmul weights."""
        heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
        routed = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts")
        share = cfg["num_experts_per_tok"] / routed if routed else 1.0
        if rank := cfg.get("kv_lora_rank"):  # MLA: one latent vector a token and layer, attention absorbed
            rope = cfg["qk_rope_head_dim"]
            kv_bytes = layers * (rank + rope) * dtype_bytes
            attn_flops = 2 * layers * heads * (2 * rank + rope)  # QK^T over rank + rope, PV over rank
            standard = layers * heads * (cfg["qk_nope_head_dim"] + rope + cfg["v_head_dim"]) * dtype_bytes
            return cls(weight_params, kv_bytes, attn_flops, dtype_bytes, expert_share=share,
                       standard_kv_bytes_per_token=standard)  # fmt: skip
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        kv_heads = cfg.get("num_key_value_heads") or heads
        kv_bytes = 2 * layers * kv_heads * head_dim * dtype_bytes
        attn_flops = 4 * layers * heads * head_dim  # QK^T and PV, 2 FLOPs per multiply-add
        return cls(weight_params, kv_bytes, attn_flops, dtype_bytes, expert_share=share)


def _safetensors_params(model_dir: Path) -> tuple[int, int, int, int, int]:
    """(all parameters, embedding parameters, FP8 e4m3 parameters, decoder linear weights, routed experts'
    weights), from the safetensors headers alone; scales do not count."""
    total = embed = fp8 = linear = experts = 0
    for header in _headers(model_dir):
        for name, t in header.items():
            if name != "__metadata__" and not name.endswith(("_scale", "_scale_inv")):
                n = math.prod(t["shape"])
                total += n
                embed += n if name.endswith("embed_tokens.weight") else 0
                fp8 += n if t["dtype"] == "F8_E4M3" else 0
                linear += n if name.endswith("proj.weight") and len(t["shape"]) == 2 else 0
                experts += n if ".experts." in name else 0
    return total, embed, fp8, linear, experts


def _headers(model_dir: Path) -> Iterator[dict[str, Any]]:
    """Each weight file's safetensors header; a GGUF's cached folder gives its GGUF's table in that form."""
    from turnout.loader.gguf import gguf_shapes

    if (shapes := gguf_shapes(model_dir)) is not None:
        yield {name: {"shape": list(shape), "dtype": "GGUF"} for name, shape in shapes}
        return
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            yield json.loads(fh.read(int.from_bytes(fh.read(8), "little")))


@dataclass(frozen=True)
class Floor:
    seconds: float
    bytes: float
    flops: float
    steps: int
    bound: str  # "memory" or "compute"


def floor(shape: Shape, reqs: list[tuple[int, int, int]], ceiling: Ceiling, max_num_seqs: int = 256) -> Floor:
    """reqs: (prompt_len, cached_len, output_len) each. The first output token comes from the prefill; each
    later one is a decode step over the request's context so far. Steps: at least the longest output, and
    at least the output tokens over max_num_seqs. A step reads the routed experts that its batch of
    min(len(reqs), max_num_seqs) tokens, each routed independently, is expected to reach; a token multiplies
    expert_share of them."""
    steps = max(max(o for _, _, o in reqs), math.ceil(sum(o for _, _, o in reqs) / max_num_seqs))
    computed = sum(p - c + o - 1 for p, c, o in reqs)  # tokens that run through the model
    decode_reads = sum((o - 1) * p + (o - 1) * o // 2 for p, _, o in reqs)  # context p + j for j < o
    cached_reads = sum(c for _, c, _ in reqs)  # a cached prefix is read once by its prefill
    reached = 1 - (1 - shape.expert_share) ** min(len(reqs), max_num_seqs)
    read = 1 - shape.expert_params * (1 - reached) / shape.weight_params  # of the weights, read a step
    used = 1 - shape.expert_params * (1 - shape.expert_share) / shape.weight_params  # multiplied a token
    weight_bytes = shape.dtype_bytes * (shape.weight_params - shape.fp8_params) + shape.fp8_params
    nbytes = weight_bytes * read * steps + shape.kv_bytes_per_token * (decode_reads + cached_reads + computed)
    # a token at position t attends to t + 1 keys: prefill positions c..p-1, decode positions p..p+o-2
    pairs = sum(_sum_range(c + 1, p + o - 1) for p, c, o in reqs)
    fp8_flops = 2 * shape.fp8_params * used * computed
    flops = 2 * (shape.weight_params - shape.fp8_params) * used * computed + shape.attn_flops_per_pair * pairs
    t_mem = nbytes / ceiling.bytes_per_s
    t_compute = flops / ceiling.flops_per_s + fp8_flops / (ceiling.fp8_flops_per_s or ceiling.flops_per_s)
    flops += fp8_flops
    return Floor(max(t_mem, t_compute), nbytes, flops, steps, "memory" if t_mem >= t_compute else "compute")


def _sum_range(a: int, b: int) -> int:
    """a + (a + 1) + ... + b, 0 when b < a."""
    return (a + b) * (b - a + 1) // 2 if b >= a else 0
