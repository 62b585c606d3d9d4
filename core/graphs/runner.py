"""CUDA-graph capture and replay for one model on one device.

FULL: the whole forward, attention included, is one graph per (size, uniform-decode) key. Every input
lives in a static buffer (input_ids, positions, query_start_loc, seq_lens, and a slot_mapping and
block_table per KV-cache group); replay copies the step's values in, then each group's metadata builder
refreshes its own buffers in place (build).

PIECEWISE: the forward is cut at every attention call. While capturing, the Attention layer hands its
q, k, v to `hole`, which copies them into shared input buffers (the copy is the graph's last node), ends
the current graph, runs attention eagerly into a shared output buffer and begins the next graph. Replay
runs graph 0, attention 0, graph 1, ... so attention sees the real, unpadded batch of any composition, and
the pieces between see the padded token count. Every size and layer reads and writes the same attention
buffers, so a capture size costs its graphs, not a copy of every layer's q, k and v.

All graphs share one memory pool and are captured largest size first. Padded rows write no KV
(slot_mapping -1); logits and sampling stay outside the graphs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from turnout.attention.backend import AttentionImpl, AttentionMetadata, AttentionMetadataBuilder
from turnout.errors import TurnoutError
from turnout.graphs.dispatcher import Dispatch, GraphDispatcher
from turnout.graphs.modes import RuntimeMode
from turnout.layers.attention import ForwardContext, forward_context

logger = logging.getLogger("turnout")


@dataclass
class _Hole:
    layer_idx: int
    q: torch.Tensor  # [N, H, D], written by the graph before it
    k: torch.Tensor
    v: torch.Tensor


@dataclass
class _Piecewise:
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    holes: list[_Hole] = field(default_factory=list)
    output: torch.Tensor | None = None


@dataclass
class _Full:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor
    metas: tuple[AttentionMetadata, ...]  # by KV-cache group


class GraphRunner:
    def __init__(
        self,
        model: nn.Module,
        impls: list[AttentionImpl],
        builders: list[AttentionMetadataBuilder],
        kv_caches: list[torch.Tensor],
        dispatcher: GraphDispatcher,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        layer_groups: list[int] | None = None,
    ) -> None:
        self.model, self.kv_caches, self.dispatcher = model, kv_caches, dispatcher
        self.impls, self.builders = impls, builders  # by layer_idx; by KV-cache group
        self.max_model_len = max_model_len
        self.layer_groups = layer_groups or [0] * len(kv_caches)  # each layer's KV-cache group
        groups = max(self.layer_groups) + 1
        n, dev = dispatcher.capture_sizes[-1], kv_caches[0].device
        self.max_reqs = max(n, max_num_seqs)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mappings = [torch.full((n,), -1, dtype=torch.long, device=dev) for _ in range(groups)]
        self.query_start_loc = torch.zeros(self.max_reqs + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(self.max_reqs, dtype=torch.int32, device=dev)
        self.block_tables = [
            torch.zeros(self.max_reqs, max_blocks_per_seq, dtype=torch.int32, device=dev)
            for _ in range(groups)
        ]
        self.pad_ones = torch.arange(1, self.max_reqs + 1, dtype=torch.int32, device=dev)  # 1, 2, 3, ...
        self.full: dict[tuple[int, bool], _Full] = {}
        self.piecewise: dict[int, _Piecewise] = {}
        self.pool = None
        self.attn_in: list[torch.Tensor] = []  # q, k, v [N, heads, D], shared by every hole
        self.attn_out: torch.Tensor | None = None  # [N, H * D], shared by every hole
        self.stream = torch.cuda.Stream(dev)
        for builder in builders:
            builder.prepare_cudagraphs(self.max_reqs, max_blocks_per_seq)

    # ---- capture ----
    def capture(self) -> None:
        dev = self.input_ids.device
        torch.cuda.synchronize(dev)
        # graphs allocate from the caching allocator's pool: its growth is their memory. Each capture starts
        # with empty_cache(), so release the cached free blocks first, or the baseline counts them and a
        # capture can seem to use negative memory.
        torch.cuda.empty_cache()
        reserved0, t0 = torch.cuda.memory_reserved(dev), time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        policy = self.dispatcher.policy
        try:
            for n in reversed(self.dispatcher.capture_sizes):
                modes = {(policy.runtime_mode(n, u), u) for u in (True, False)}
                for mode, uniform in sorted(modes, key=lambda m: (m[0].value, m[1])):
                    if mode is RuntimeMode.FULL:
                        self._capture_full(n, uniform)
                    elif mode is RuntimeMode.PIECEWISE and n not in self.piecewise:
                        self._capture_piecewise(n)
        except torch.OutOfMemoryError:
            raise TurnoutError(
                "CUDA graph capture ran out of memory; set fewer cudagraph_capture_sizes, "
                "lower gpu_memory_utilization, or use cudagraph_mode NONE"
            ) from None
        torch.cuda.synchronize(dev)
        used = torch.cuda.memory_reserved(dev) - reserved0
        logger.info(
            "captured %d FULL and %d PIECEWISE graph sets (%d sizes) in %.1fs, graph memory %.2f GiB",
            len(self.full), len(self.piecewise), len(self.dispatcher.capture_sizes),
            time.perf_counter() - t0, used / 2**30,
        )  # fmt: skip

    def _static_metas(self, n: int, uniform: bool) -> tuple[AttentionMetadata, ...]:
        """Metadata over the static buffers, one per KV-cache group; for capture every request runs one
        token (decode) or the first request runs them all (mixed). Host ints are the largest they can be at
        replay."""
        b = n if uniform else min(n, self.max_reqs)
        qsl = self.query_start_loc[: b + 1]
        qsl.copy_(
            torch.arange(b + 1, dtype=torch.int32) if uniform else torch.full((b + 1,), n, dtype=torch.int32)
        )
        qsl[0] = 0
        self.seq_lens[:b].fill_(n if not uniform else 1)
        return tuple(
            AttentionMetadata(
                slot_mapping=slots[:n],
                query_start_loc=qsl,
                seq_lens=self.seq_lens[:b],
                block_table=table[:b],
                max_query_len=1 if uniform else n,
                max_seq_len=self.max_model_len,
                num_actual_tokens=n,
                num_decode_tokens=n if uniform else 0,
            )
            for slots, table in zip(self.slot_mappings, self.block_tables)
        )

    def _context(self, metas: tuple[AttentionMetadata, ...], hole=None) -> ForwardContext:
        """The forward context over metas, each group's backend_data built first."""
        for builder, meta in zip(self.builders, metas):
            meta.backend_data = builder.build(meta)
        return ForwardContext(self.impls, metas[0], self.kv_caches, hole, metas if len(metas) > 1 else ())

    def _run_model(self, n: int) -> torch.Tensor:
        return self.model(self.input_ids[:n], self.positions[:n])

    def _capture_full(self, n: int, uniform: bool) -> None:
        metas = self._static_metas(n, uniform)
        with forward_context(self._context(metas)):
            self._run_model(n)  # warm-up: JIT, autotuning, lazy workspaces
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                output = self._run_model(n)
        self.full[(n, uniform)] = _Full(graph, output, metas)

    def _capture_piecewise(self, n: int) -> None:
        metas = self._static_metas(n, uniform=False)
        pw = _Piecewise()

        def hole(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q, k, v = (self._attn_in(i, t) for i, t in enumerate((q, k, v)))
            pw.graphs[-1].capture_end()
            pw.holes.append(_Hole(layer_idx, q, k, v))
            out = self._attn_out(n, q.shape[1] * v.shape[2], q)  # H x the values' head size
            meta = metas[self.layer_groups[layer_idx]]
            out.copy_(self.impls[layer_idx].forward(q, k, v, self.kv_caches[layer_idx], meta).reshape(n, -1))
            pw.graphs.append(torch.cuda.CUDAGraph())
            pw.graphs[-1].capture_begin(pool=self.pool)
            return out

        with forward_context(self._context(metas)):
            self._run_model(n)  # warm-up, eager
        torch.cuda.synchronize()
        with torch.cuda.stream(self.stream), forward_context(self._context(metas, hole)):
            pw.graphs.append(torch.cuda.CUDAGraph())
            pw.graphs[-1].capture_begin(pool=self.pool)
            pw.output = self._run_model(n)
            pw.graphs[-1].capture_end()
        torch.cuda.synchronize()
        self.piecewise[n] = pw

    def _attn_in(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """x [n, heads, head_size] copied into shared buffer i (q, k or v) of the largest capture size."""
        if len(self.attn_in) <= i:
            shape = (self.dispatcher.capture_sizes[-1], *x.shape[1:])
            self.attn_in.append(torch.empty(shape, dtype=x.dtype, device=x.device))
        return self.attn_in[i][: x.shape[0]].copy_(x)

    def _attn_out(self, n: int, width: int, like: torch.Tensor) -> torch.Tensor:
        if self.attn_out is None:
            self.attn_out = torch.empty(
                self.dispatcher.capture_sizes[-1], width, dtype=like.dtype, device=like.device
            )
        return self.attn_out[:n]

    # ---- replay ----
    def run(
        self,
        d: Dispatch,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metas: tuple[AttentionMetadata, ...],
    ) -> torch.Tensor:
        """The forward of one step through the graphs (metas: each KV-cache group's); returns hidden states
        [T, hidden] (unpadded)."""
        t, n = metas[0].num_actual_tokens, d.num_tokens
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        for slots, meta in zip(self.slot_mappings, metas):
            slots[:t].copy_(meta.slot_mapping)
            slots[t:n].fill_(-1)
        if d.mode is RuntimeMode.FULL:
            full = self.full[(n, d.uniform_decode)]
            for g, (static, meta) in enumerate(zip(full.metas, metas)):
                self._fill_full_meta(static, meta, d.uniform_decode, shared=g == 0)
                static.backend_data = self.builders[g].build(static)
            full.graph.replay()
            return full.output[:t]
        pw = self.piecewise[n]
        step_metas = [
            AttentionMetadata(**{**meta.__dict__, "slot_mapping": slots[:t]})
            for slots, meta in zip(self.slot_mappings, metas)
        ]
        for graph, h in zip(pw.graphs, pw.holes + [None]):
            graph.replay()
            if h is not None:
                impl, cache = self.impls[h.layer_idx], self.kv_caches[h.layer_idx]
                meta = step_metas[self.layer_groups[h.layer_idx]]
                o = impl.forward(h.q[:t], h.k[:t], h.v[:t], cache, meta)
                self.attn_out[:t].copy_(o.reshape(t, -1))
        return pw.output[:t]

    def _fill_full_meta(
        self, static: AttentionMetadata, meta: AttentionMetadata, uniform: bool, shared: bool = True
    ) -> None:
        """Copy meta into static's buffers: its block_table, and (shared: once for all groups) the
        query_start_loc and seq_lens every group reads."""
        b, t = meta.num_reqs, meta.num_actual_tokens
        bp = static.seq_lens.shape[0]
        qsl = static.query_start_loc
        if shared:
            qsl[: b + 1].copy_(meta.query_start_loc)
            # padded requests: one token each when uniform (they own the padded rows), else empty
            if uniform:
                torch.add(self.pad_ones[: bp - b], t, out=qsl[b + 1 :])
            else:
                qsl[b + 1 :].fill_(t)
            static.seq_lens[:b].copy_(meta.seq_lens)
            static.seq_lens[b:].fill_(1)
        width = meta.block_table.shape[1]
        static.block_table[:b, :width].copy_(meta.block_table)
        static.block_table[b:].zero_()
