"""Mixture-of-experts: the router, the FusedMoE layer (vLLM's name) and its expert kernels.

A sparse MoE block routes each token to top_k of num_experts experts (softmax over the router logits in
float32, top-k, optionally renormalised: HF's norm_topk_prob) and sums the chosen experts' SwiGLU outputs,
weighted. FusedMoE keeps every expert it holds in two stacked weights, w13 [E, 2I, H] (gate rows, then
up rows) and w2 [E, H, I], and computes the (token, expert) pairs with one of two kernels:

- `triton`: moe_align sorts the pairs by expert and pads each expert's run to a multiple of BLOCK_M
  (sorted_token_ids, expert_ids, num_tokens_post_padded, as in vLLM's fused_moe); a grouped GEMM then
  gives each BLOCK_M run one expert's weight tile. No host sync: CUDA graphs can capture it.
- `torch`: one pair of matmuls per expert that has tokens, the reference and the CPU path.

Both return one output row per pair; `combine` weights them and sums each token's top_k rows in float32,
in top-k order, so a token's result never depends on the other tokens in its batch.

Placement: without expert parallelism every rank holds every expert, and under TP each expert's
intermediate dim is split over the TP ranks (w13 by rows, w2 by columns, all-reduced after). With
`enable_expert_parallel` the tp x dp ranks of a stage split the experts (`expert_ranges`) and hold them
whole; weights of other ranks' experts are never allocated. A rank takes its share of the step's tokens
(under TP the tokens are replicated, so TP rank r takes chunk r), sends each (token, expert) pair to the
expert's rank with all_to_all_single, computes what it received, sends the rows back, combines, and
gathers the chunks over TP. An idle data-parallel replica still joins each all-to-all with 0 tokens
(`dummy_step`), as the step's other replicas wait on it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from turnout.distributed import (
    ep_all_to_all,
    ep_exchange_counts,
    get_parallel_state,
    tp_all_gather,
    tp_all_reduce,
)
from turnout.layers.activation import SiluAndMul
from turnout.platform import Platform
from turnout.priority import Priority

ExpertOutputs = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (router_logits [T, E], top_k, renormalize) -> (weights [T, k] float32, expert ids [T, k] int64)
RoutingFunction = Callable[[torch.Tensor, int, bool], tuple[torch.Tensor, torch.Tensor]]


def num_experts(hf_config: dict[str, Any]) -> int:
    """Routed experts per MoE layer from config.json (Qwen: num_experts, Mixtral: num_local_experts,
    DeepSeek: n_routed_experts); 0 = a dense model."""
    keys = ("num_experts", "num_local_experts", "n_routed_experts")
    return int(next((hf_config[k] for k in keys if hf_config.get(k)), 0))


def expert_ranges(n: int, ep_size: int) -> list[range]:
    """Experts of each EP rank: contiguous, as even as possible, the first n % ep_size ranks one more."""
    per, extra = divmod(n, ep_size)
    starts = [r * per + min(r, extra) for r in range(ep_size + 1)]
    return [range(a, b) for a, b in zip(starts[:-1], starts[1:])]


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, k] float32, expert ids [T, k] int64), as HF's Qwen3MoeTopKRouter."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def combine(pair_out: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """pair_out [T * k, H] (row t * k + j: token t's j-th expert) -> [T, H]; float32 sum, j ascending."""
    t, k = topk_weights.shape
    y = pair_out.view(t, k, pair_out.shape[-1]).float() * topk_weights[..., None]
    return y.sum(dim=1).to(pair_out.dtype)


# ---- kernels: (x [N, H], w13 [E, 2I, H], w2 [E, H, I], topk_ids [N, k]) -> pair outputs [N * k, H] ----
_act = SiluAndMul()


def expert_outputs_torch(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    k = topk_ids.shape[1]
    flat = topk_ids.flatten()
    out = x.new_empty(flat.numel(), w2.shape[1])
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    for e, pairs in enumerate(order.split(counts)):
        if len(pairs):
            out[pairs] = F.linear(_act(F.linear(x[pairs // k], w13[e])), w2[e])
    return out


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert, each expert's run padded to a multiple of block_m, in buffers sized for the
    worst case so that nothing waits on the device:
    sorted_token_ids [L]: pair index (t * k + j), or P = num pairs as padding;
    expert_ids [L / block_m]: the expert of each block (blocks past the end repeat the last expert);
    num_tokens_post_padded [1]: where the used part of sorted_token_ids ends."""
    flat = topk_ids.flatten()
    p = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would ask the device for max(flat)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank_in_expert = torch.arange(p, device=flat.device) - (counts.cumsum(0) - counts)[expert]
    size = -(-(p + min(p, num_experts) * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((size,), p, dtype=torch.int64, device=flat.device)
    sorted_ids[(ends - padded)[expert] + rank_in_expert] = order
    block_starts = torch.arange(0, size, block_m, device=flat.device)
    expert_ids = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids, ends[-1:]


@functools.cache
def _kernel():
    """The @triton.jit grouped GEMM, built on first use so that importing turnout never imports triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def moe_gemm_kernel(
        a, w, s, c, sorted_ids, expert_ids, num_post_padded, N, K, num_pairs, s_am, s_we, s_wn, s_cm,
        s_se, s_sn, s_sk,
        A_DIV: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, SCALES: tl.constexpr,
        BN: tl.constexpr, BK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Grid (blocks of sorted pairs, cdiv(N, BLOCK_N)): c[pair] = a[pair // A_DIV] @ (w[e] * scale)^T
        for the BLOCK_M pairs of one expert e; padding entries (== num_pairs) load zeros and store nothing.
        w is a's dtype, or e4m3 (exact in a's dtype) with SCALES "row" (s [E, N]: each output column
        scaled once, at the end) or "block" (s [E, N / BN, K / BK]: BLOCK_K divides BK, so each K tile's
        product is scaled per output column's block). UPCAST (the interpreter, whose dot multiplies 16-bit
        float bit patterns in triton 3.9): both operands in float32."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(num_post_padded):
            return
        pairs = tl.load(sorted_ids + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        rows = pairs // A_DIV
        e = tl.load(expert_ids + pid_m).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # not tl.zeros, a @jit helper: the interpreter cannot call it if triton came before TRITON_INTERPRET
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                a + rows[:, None] * s_am + ks[None, :], mask=valid[:, None] & (ks[None, :] < K), other=0.0
            )
            wt = tl.load(
                w + e * s_we + cols[None, :] * s_wn + ks[:, None],
                mask=(cols[None, :] < N) & (ks[:, None] < K),
                other=0.0,
            )  # [BLOCK_K, BLOCK_N]: w[e] read transposed
            if UPCAST:
                x, wt = x.to(tl.float32), wt.to(tl.float32)
            else:
                wt = wt.to(x.dtype)
            if SCALES == "block":
                sc = tl.load(s + e * s_se + (cols // BN) * s_sn + (k0 // BK) * s_sk, mask=cols < N, other=0.0)
                acc += tl.dot(x, wt, input_precision=PRECISION) * sc[None, :]
            else:
                acc = tl.dot(x, wt, acc, input_precision=PRECISION)
        if SCALES == "row":
            acc = acc * tl.load(s + e * s_se + cols * s_sn, mask=cols < N, other=0.0)[None, :]
        out = c + pairs[:, None] * s_cm + cols[None, :]
        tl.store(out, acc.to(c.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))  # fmt: skip

    return moe_gemm_kernel, os.environ.get("TRITON_INTERPRET") == "1"


def _tiles(num_pairs: int, num_experts: int, bk: int | None = None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) by the pairs an expert gets on average: every block reads its expert's
    whole weight, so a run padded far past its pairs wastes reads (decode: 256 tokens x top-8 over 128
    experts is 16 pairs each); large runs take vLLM's default fused_moe tiles. BLOCK_K at most bk, a scale
    block's columns."""
    per_expert = num_pairs / num_experts
    bm, bn, bk_tile = (16, 64, 64) if per_expert <= 16 else (32, 64, 64) if per_expert <= 48 else (64, 64, 32)
    return bm, bn, min(bk_tile, bk or bk_tile)


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    align: tuple[torch.Tensor, ...],
    num_pairs: int,
    a_div: int,
    tiles: tuple,
    scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """[num_pairs, N] = a[pair // a_div] @ (w[expert of pair] * scale)^T (moe_gemm_kernel's scales)."""
    sorted_ids, expert_ids, num_post_padded = align
    bm, bn, bk = tiles
    n, k = w.shape[1], w.shape[2]
    c = a.new_empty(num_pairs, n)
    grid = (sorted_ids.numel() // bm, -(-n // bn))
    kernel, interpret = _kernel()
    upcast = interpret and a.dtype != torch.float32
    precision = "ieee" if a.dtype == torch.float32 or upcast else "tf32"  # float32 stays float32 (no TF32)
    scales = "none" if scale is None else "block" if block else "row"
    s = scale if scale is not None else a
    sbn, sbk = block or (1, 1)
    kernel[grid](
        a, w, s, c, sorted_ids, expert_ids, num_post_padded, n, k, num_pairs,
        a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        s.stride(0), s.stride(1) if s.dim() > 1 else 0, s.stride(2) if s.dim() > 2 else 0,
        A_DIV=a_div, PRECISION=precision, UPCAST=upcast, SCALES=scales, BN=sbn, BK=sbk,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4,
    )  # fmt: skip
    return c


def expert_outputs_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None] | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_ids [T, k] -> pair outputs [T * k, H]: row t * k + j is
    w2[e] silu-and-mul(w13[e] x[t]) for e = topk_ids[t, j], through the Triton grouped GEMM. scales: for
    e4m3 experts, (w13 scale, w2 scale, block): [E, N] per row, or [E, ceil(N / bn), ceil(K / bk)] per
    bn x bk block (bk a power of two >= 16, and w13's gate and up each starting on a block row)."""
    p, k = topk_ids.numel(), topk_ids.shape[1]
    if p == 0:
        return x.new_empty(0, w2.shape[1])
    s13, s2, block = scales or (None, None, None)
    tiles = _tiles(p, w13.shape[0], block[1] if block else None)
    align = moe_align(topk_ids, w13.shape[0], tiles[0])
    h = _grouped_gemm(x.contiguous(), w13, align, p, k, tiles, s13, block)  # [P, 2I]
    return _grouped_gemm(_act(h), w2, align, p, 1, tiles, s2, block)  # [P, H]


# ---- kernel selection: candidates with reasons, as attention backends ----
@dataclass(frozen=True)
class MoEContext:
    platform: Platform
    dtype: torch.dtype


@dataclass(frozen=True)
class MoEKernel:
    name: str
    priority: int
    expert_outputs: ExpertOutputs = field(repr=False)
    check: Callable[[MoEContext], list[str]] = field(repr=False)
    cudagraph_safe: bool  # no host sync: a CUDA graph can capture it


def _check_triton(ctx: MoEContext) -> list[str]:
    reasons = []
    if not ctx.platform.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":  # the CPU runs it for tests
        reasons.append(f"needs a CUDA device (or TRITON_INTERPRET=1), have {ctx.platform.device_type}")
    try:
        import triton  # noqa: F401
    except ImportError as e:
        reasons.append(f"triton does not import ({e}); pip install triton")
    return reasons


def _check_torch(ctx: MoEContext) -> list[str]:
    return []


TRITON_KERNEL = MoEKernel("triton", Priority.FIRST, expert_outputs_triton, _check_triton, cudagraph_safe=True)
TORCH_KERNEL = MoEKernel("torch", Priority.DEFAULT, expert_outputs_torch, _check_torch, cudagraph_safe=False)


def moe_kernels(ctx: MoEContext) -> list[MoEKernel]:
    """The candidates, in hookspecs.Priority's tiers: triton FIRST on CUDA, torch DEFAULT; off CUDA triton
    (under TRITON_INTERPRET=1) is a test aid, TESTING, never preferred."""
    triton = TRITON_KERNEL if ctx.platform.is_cuda else replace(TRITON_KERNEL, priority=Priority.TESTING)
    return [triton, TORCH_KERNEL]


def graph_blocker(kernel: MoEKernel, ep_size: int) -> str | None:
    """Why a MoE model cannot run in CUDA graphs with this kernel and placement (None: it can)."""
    if ep_size > 1:
        return f"expert parallelism over {ep_size} ranks sends data-dependent row counts (all_to_all_single)"
    if not kernel.cudagraph_safe:
        return f"MoE kernel {kernel.name} waits on the device for each expert's token count"
    return None


def describe_placement(hf_config: dict[str, Any], tp: int, dp: int, expert_parallel: bool) -> dict[str, Any]:
    """What `turnout explain` shows: the experts each rank holds."""
    n, ep = num_experts(hf_config), (tp * dp if expert_parallel else 1)
    doc: dict[str, Any] = {"num_experts": n, "top_k": hf_config.get("num_experts_per_tok"), "ep_size": ep}
    if ep > 1:
        doc["experts_per_rank"] = [[r.start, r.stop] for r in expert_ranges(n, ep)]
        doc["layout"] = f"expert parallel over {ep} ranks (tp {tp} x dp {dp}), whole experts on each"
    else:
        doc["experts_per_rank"] = [[0, n]]
        doc["layout"] = "every rank holds every expert" + (
            f", its intermediate dim split over {tp} TP ranks" if tp > 1 else ""
        )
    return doc


# ---- the layer ----
def _param(*shape: int, loader: Callable[..., bool]) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


class FusedMoE(nn.Module):
    """The experts of one sparse MoE block. forward(x [T, H], router_logits [T, E]) -> [T, H], the same on
    every TP rank. `kernel` is bound at start-up to the chosen MoEKernel (ModelRunner).

    custom_routing_function (vLLM's name): `(router_logits, top_k, renormalize) -> (weights [T, k] float32,
    expert ids [T, k] int64)` in place of select_experts' softmax top-k, for a model whose router differs
    (DeepSeek's group-limited top-k and routed_scaling_factor); it must give each token's ids and weights
    from that token's logits alone, as every expert-parallel rank routes its own chunk of tokens."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        custom_routing_function: RoutingFunction | None = None,
    ) -> None:
        super().__init__()
        ps = get_parallel_state()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.route: RoutingFunction = custom_routing_function or select_experts
        self.ep_rank, self.ep_size = ps.ep_rank, ps.ep_size
        # under expert parallelism experts stay whole; otherwise each is split over the TP ranks
        self.tp_rank, self.tp_size = (0, 1) if self.ep_size > 1 else (ps.tp_rank, ps.tp_size)
        assert intermediate_size % self.tp_size == 0, (
            f"moe_intermediate_size {intermediate_size} does not split over {self.tp_size} ranks"
        )
        placement = expert_ranges(num_experts, self.ep_size)
        self.local_experts = placement[self.ep_rank]
        e, i = len(self.local_experts), intermediate_size // self.tp_size
        self.w13_weight = _param(e, 2 * i, hidden_size, loader=self.weight_loader)
        self.w2_weight = _param(e, hidden_size, i, loader=self.weight_loader)
        owner = torch.tensor([r for r, rng in enumerate(placement) for _ in rng])
        self.register_buffer("expert_rank", owner, persistent=False)  # expert id -> its EP rank
        local = torch.tensor([j for rng in placement for j in range(len(rng))])
        self.register_buffer("expert_local", local, persistent=False)  # expert id -> index on that rank
        self.kernel: MoEKernel = TORCH_KERNEL
        # a turnout.quantization.MoEMethod, set before the checkpoint loads; None once the weights are in
        # the compute dtype the kernel computes in, or kept where the experts stay quantized and the
        # method computes them (its apply)
        self.quant_method: Any = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert: int, shard: int) -> bool:
        """One checkpoint expert tensor: shard 0 = gate_proj, 1 = up_proj (into w13), 2 = down_proj (w2).
        Returns False, copying nothing, for an expert another EP rank holds."""
        if expert not in self.local_experts:
            return False
        dst = param.data[expert - self.local_experts.start]
        if shard == 2:
            n = dst.shape[1]
            dst.copy_(loaded.narrow(1, self.tp_rank * n, n))
        else:
            n = dst.shape[0] // 2
            dst.narrow(0, shard * n, n).copy_(loaded.narrow(0, self.tp_rank * n, n))
        return True

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] through each token's top_k experts (from router_logits [T, num_experts]), weighted
        by their router probabilities (renormalised over the top_k where renormalize; or as the
        custom_routing_function gives them) -> [T, hidden], whole on every rank: with EP the pairs travel to
        their experts' ranks and back, else the TP shards' partial sums are all-reduced."""
        topk_weights, topk_ids = self.route(router_logits, self.top_k, self.renormalize)
        if self.ep_size > 1:
            return self._forward_ep(x, topk_weights, topk_ids)
        y = self.expert_outputs(x, topk_ids)
        return tp_all_reduce(combine(y, topk_weights))  # partial sums of the intermediate-dim shards

    def expert_outputs(self, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [N, H], topk_ids [N, k] (this rank's expert indices) -> pair outputs [N * k, H]: the quant
        method's (MoEMethod.apply) where it keeps the experts quantized, else the bound kernel's."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, topk_ids)
        return self.kernel.expert_outputs(x, self.w13_weight, self.w2_weight, topk_ids)

    def _forward_ep(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """Send this rank's chunk of pairs to their experts' ranks, compute what arrives, send it back."""
        ps, t, k = get_parallel_state(), x.shape[0], self.top_k
        chunk = -(-t // ps.tp_size)  # TP ranks hold the same tokens: rank r takes rows [r * chunk, ...)
        lo, hi = min(t, ps.tp_rank * chunk), min(t, (ps.tp_rank + 1) * chunk)
        ids = topk_ids[lo:hi].flatten()
        dest = self.expert_rank[ids]
        order = torch.argsort(dest, stable=True)  # pairs grouped by destination rank
        send = torch.zeros(self.ep_size, dtype=torch.int64, device=x.device)
        send.scatter_add_(0, dest, torch.ones_like(dest))
        send_splits, recv_splits = send.tolist(), ep_exchange_counts(send).tolist()
        x_recv = ep_all_to_all(x[lo:hi][order // k], recv_splits, send_splits)
        e_recv = ep_all_to_all(self.expert_local[ids[order]], recv_splits, send_splits)
        y_recv = self.expert_outputs(x_recv, e_recv[:, None])
        y = x.new_empty(len(ids), x.shape[1])
        y[order] = ep_all_to_all(y_recv, send_splits, recv_splits)
        out = combine(y, topk_weights[lo:hi])
        if ps.tp_size == 1 or t == 0:
            return out
        pad = out.new_zeros(chunk - (hi - lo), out.shape[1])
        return tp_all_gather(torch.cat([out, pad]), dim=0)[:t]


def bind_kernel(model: nn.Module, kernel: MoEKernel) -> int:
    """Give every FusedMoE layer of model the chosen kernel; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    for m in layers:
        m.kernel = kernel
    return len(layers)


@torch.inference_mode()
def dummy_step(model: nn.Module) -> None:
    """An idle data-parallel replica's step: every expert-parallel FusedMoE layer joins its all-to-alls with
    0 tokens, in layer order, as the replicas with requests run their forward."""
    for m in model.modules():
        if isinstance(m, FusedMoE) and m.ep_size > 1:
            w = m.w13_weight
            m(w.new_empty(0, w.shape[2]), w.new_empty(0, m.num_experts))
