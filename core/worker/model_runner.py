"""Turns a SchedulerOutput into tensors, runs the model, samples.

At start-up it builds the model (a turnout.models.CausalLM), numbers its Attention layers and has the
chosen backend make each one's AttentionImpl before anything is sized or run; the engine then sets the
KV-cache groups (set_kv_cache_config), which say whose block table each layer reads and which KV tensor it
uses, and each group gets its own AttentionMetadataBuilder.
Per step it builds input_ids, positions, query_start_loc (cu_seqlens), seq_lens and, per KV-cache group,
the block table and slot_mapping, publishes them to the Attention layers through forward_context, and keeps
the logits of the rows that sample until sample_tokens.

Pipeline parallelism (pp_size > 1): every stage gets the same SchedulerOutput and splits its requests the
same way into up to pp_size micro-batches of contiguous requests with about equal token counts
(`micro_batches`); each gets its own inputs and attention metadata. For micro-batch m a stage receives
the [2, T_m, hidden] (hidden, residual) pair from the previous stage (the first stage embeds instead),
runs its layers, and starts an async send to the next stage before it moves on to m + 1. So while stage s
runs m, stage s - 1 already runs m + 1: a GPipe-style fill and drain within each step. Only the last stage
computes logits (all micro-batches' rows, in request order) and samples; the others return nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from turnout import quantization
from turnout.attention.backend import AttentionBackend, AttentionMetadata, AttentionMetadataBuilder
from turnout.attention.kv_spec import KVCacheConfig, KVCacheSpec, kv_cache_config
from turnout.config import EngineConfig
from turnout.distributed import get_parallel_state, pp_recv, pp_send
from turnout.engine.request import TokenLogprobs
from turnout.engine.scheduler import ScheduledRequest, SchedulerOutput
from turnout.errors import TurnoutError, WeightLoadError
from turnout.graphs.dispatcher import GraphDispatcher, default_capture_sizes
from turnout.graphs.modes import RuntimeMode
from turnout.graphs.runner import GraphRunner
from turnout.layers import moe
from turnout.layers.attention import (
    ForwardContext,
    bind_attention_layers,
    bind_kv_cache_groups,
    forward_context,
)
from turnout.layers.linear import pack_linears_for_cpu
from turnout.loader.weights import load_checkpoint
from turnout.models.interface import CausalLM
from turnout.sampling_params import SamplingParams
from turnout.selection import Selection, quantization_context
from turnout.structured_outputs import GrammarOutput, apply_token_bitmask
from turnout.worker import block_table, kv_cache
from turnout.worker.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from turnout.worker.sampler import Sampler, gather_logprobs

logger = logging.getLogger("turnout")
_GREEDY = SamplingParams(temperature=0.0)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata  # KV-cache group 0's
    logits_indices: torch.Tensor  # [S] token index of each sampling row's last token
    sample_reqs: list[ScheduledRequest]
    metas: tuple[AttentionMetadata, ...] = ()  # every group's, meta first; empty where there is one group

    @property
    def group_metas(self) -> tuple[AttentionMetadata, ...]:
        """Every KV-cache group's metadata, in group order."""
        return self.metas or (self.meta,)


class ModelRunner:
    def __init__(self, config: EngineConfig, selection: Selection, device: torch.device) -> None:
        self.config, self.selection, self.device = config, selection, device
        self.backend: AttentionBackend = selection.backend
        self.dtype = selection.dtype
        self.info = selection.model_info
        self.block_size = config.block_size
        self.model = self._load_model()
        self.attn_spec = bind_attention_layers(self.model, self.dtype, self.block_size, config.kv_cache_dtype)
        self._check_layer_features()
        spec = self.attn_spec
        self.impls = [self.backend.make_impl(spec, spec.layer(i)) for i in range(spec.num_layers)]
        self.builders: list[AttentionMetadataBuilder] = []  # by KV-cache group: set_kv_cache_config
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        self.kv_caches: list[torch.Tensor] = []  # by layer_idx; layers of different groups share tensors
        self.kv_cache_tensors: list[torch.Tensor] = []  # each KV tensor once
        self.graphs: GraphRunner | None = None
        self._pending: tuple[torch.Tensor, list[ScheduledRequest]] | None = None
        self._prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        self._staging64 = HostStaging(device, torch.int64)
        self._staging32 = HostStaging(device, torch.int32)
        self._last_sampled: torch.Tensor | None = None  # by sample_tokens_async, for placeholder inputs
        self._staging_fill = HostStaging(device, torch.int64)
        self.set_kv_cache_config(kv_cache_config([self.kv_cache_specs()]), stage=0)  # this rank's alone

    def _check_layer_features(self) -> None:
        """The layers as built use only features and KV-cache specs the backend serves: selection went by
        what the model's ModelArchitecture declares (attention_features) and config.json says (kv_lora_rank),
        and either can fall short."""
        arch = self.selection.architecture.name
        if missing := sorted(self.attn_spec.features - set(self.backend.attention_features)):
            raise TurnoutError(
                f"{arch}'s attention layers use per-layer {', '.join(missing)}, which attention backend "
                f"{self.backend.name} does not serve; its ModelArchitecture must declare them "
                "(attention_features) so that selection picks a backend that does"
            )
        kinds = {s.kind for s in self.attn_spec.kv_cache_specs()}
        if missing := sorted(kinds - set(self.backend.kv_cache_specs)):
            raise TurnoutError(
                f"{arch}'s attention layers need KV-cache spec {', '.join(missing)}, which attention backend "
                f"{self.backend.name} does not serve (it serves {', '.join(self.backend.kv_cache_specs)})"
            )

    def _load_model(self) -> CausalLM:
        t0 = time.perf_counter()
        cls = self.selection.architecture.load()
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = cls(self.info.hf_config)
        finally:
            torch.set_default_dtype(prev)
        if not isinstance(model, nn.Module) or not isinstance(model, CausalLM):
            missing = [m for m in ("forward", "compute_logits", "load_weights") if not hasattr(model, m)]
            raise TurnoutError(
                f"model class {cls.__module__}.{cls.__qualname__} is not a torch.nn.Module implementing "
                f"turnout.models.CausalLM (missing: {', '.join(missing) or 'nn.Module'}); "
                "see docs/writing-a-plugin.md"
            )
        if self.selection.moe is not None:
            moe.bind_kernel(model, self.selection.moe.obj)
        if (method := self.selection.quantization_method) is not None:
            ctx = quantization_context(self.config, self.info, self.selection.platform, self.dtype)
            with torch.device(self.device):
                n = quantization.quantize_linears(model, method, ctx)
            logger.info(
                "quantization %s: %d layers (%s)",
                method.name,
                n,
                "; ".join(self.selection.quantization_notes),
            )
        ps, kernel = get_parallel_state(), self.selection.moe and self.selection.moe.chosen.name
        rank = (ps.tp_rank, ps.tp_size, ps.pp_rank, ps.pp_size, ps.ep_rank, ps.ep_size)
        key = (cls, str(self.info.path), self.dtype, str(self.device), rank, kernel, method and method.name)
        loaded = load_checkpoint(model, self.info.path, key)
        # load_weights names what the checkpoint lacks itself; a parameter it does not return is its bug
        if unfilled := sorted(n for n, _ in model.named_parameters() if n not in loaded):
            plugin = self.selection.model.chosen.plugin
            raise WeightLoadError(
                f"the model plugin {plugin} never filled its parameter {unfilled[0]} ({len(unfilled)} in "
                f"all): {cls.__qualname__}.load_weights did not return it; a bug in the plugin, report it to "
                "its authors"
            )
        quantization.process_weights_after_loading(model)
        if self.device.type == "cpu" and (n := pack_linears_for_cpu(model)):
            logger.info("packed %d bf16 weights into oneDNN's layout", n)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        logger.info(
            "loaded %s (%.0f MiB) in %.1fs", type(model).__name__, nbytes / 2**20, time.perf_counter() - t0
        )
        return model.eval()

    # ---- KV cache ----
    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """This rank's attention layers' KV-cache specs, by layer_idx."""
        return self.attn_spec.kv_cache_specs()

    def set_kv_cache_config(self, config: KVCacheConfig, stage: int | None = None) -> None:
        """The model's KV-cache groups (over every pipeline stage; stage None: this rank's): each layer's
        group and KV tensor, and one block table per group. Before the KV cache is sized."""
        placement = config.placement(get_parallel_state().pp_rank if stage is None else stage)
        slots = sorted({j for _, j in placement})
        self.kv_config = config
        self.layer_groups = [g for g, _ in placement]
        self.layer_tensors = [slots.index(j) for _, j in placement]
        bind_kv_cache_groups(self.model, self.layer_groups)
        self.block_tables = [
            block_table.BlockTables(g, s.num_skipped_blocks if s.frees_blocks else None)
            for g, s in enumerate(config.specs)
        ]
        self.builders = [self.backend.make_builder(self.attn_spec, g) for g in range(len(config.specs))]

    @property
    def num_kv_tensors(self) -> int:
        """The KV tensors this rank allocates: one per slot its layers use."""
        return len(set(self.layer_tensors))

    def kv_bytes_per_block(self) -> int:
        return kv_cache.kv_bytes_per_block(self.attn_spec, self.num_kv_tensors)

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit: cpu_kv_cache_bytes on CPU; on CUDA, what is left of
        gpu_memory_utilization after the weights and the peak of a max-size dummy step."""
        if self.config.num_gpu_blocks_override:
            return self.config.num_gpu_blocks_override
        if self.device.type != "cuda":
            return max(
                1, kv_cache.blocks_in(self.config.cpu_kv_cache_bytes, self.attn_spec, self.num_kv_tensors)
            )
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        dummy_kv = self._dummy_run(self.config.max_num_batched_tokens)
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - dummy_kv  # the real cache takes its place
        used_elsewhere = total - free - torch.cuda.memory_reserved(self.device)  # other processes, NCCL
        budget = total * self.config.gpu_memory_utilization - peak - used_elsewhere
        logger.info("memory: total %.1f GiB, peak step %.2f GiB", total / 2**30, peak / 2**30)
        return kv_cache.blocks_in(budget, self.attn_spec, self.num_kv_tensors)

    def _dummy_run(self, num_tokens: int) -> int:
        """A prefill of num_tokens over a throwaway KV cache: measures peak activation memory. Returns the
        throwaway cache's bytes (a block for each of up to max_num_seqs requests), which were live at the
        peak."""
        num_seqs = max(1, min(self.config.max_num_seqs, num_tokens))
        per_seq = num_tokens // num_seqs
        nb = block_table.blocks_for(per_seq, self.block_size)
        self.allocate_kv_cache(nb * num_seqs)
        blocks = [list(range(i * nb, (i + 1) * nb)) for i in range(num_seqs)]
        groups = len(self.block_tables)
        reqs = [
            ScheduledRequest(f"dummy{i}", [0] * per_seq, 0, (b,) * groups, True, _GREEDY, [], [])
            for i, b in enumerate(blocks)
        ]
        self.execute_model(SchedulerOutput(reqs))
        self.sample_tokens()
        for tables in self.block_tables:
            tables.release([r.req_id for r in reqs])
        self.kv_caches, self.kv_cache_tensors = [], []
        return self.kv_bytes_per_block() * nb * num_seqs

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache_tensors = kv_cache.allocate_kv_caches(
            self.backend, self.attn_spec, num_blocks, self.device, self.num_kv_tensors
        )
        self.kv_caches = [self.kv_cache_tensors[t] for t in self.layer_tensors]

    def capture_graphs(self, num_blocks: int) -> None:
        policy = self.selection.effective_graph
        if self.device.type != "cuda" or not policy.uses_graphs:
            return
        cfg = self.config
        sizes = cfg.cudagraph_capture_sizes or default_capture_sizes(cfg.max_num_seqs)
        sizes = [s for s in sizes if s <= cfg.max_num_batched_tokens]
        max_len = min(cfg.max_model_len or self.info.max_position_embeddings, num_blocks * self.block_size)
        self.graphs = GraphRunner(
            self.model, self.impls, self.builders, self.kv_caches, GraphDispatcher(policy, sizes),
            cfg.max_num_seqs, block_table.blocks_for(max_len, self.block_size), max_len, self.layer_groups,
        )  # fmt: skip
        self.graphs.capture()

    # ---- one step ----
    def prepare(self, out: SchedulerOutput) -> StepInputs:
        reqs = out.requests
        qlens = np.array([len(r.token_ids) for r in reqs], dtype=np.int64)
        starts = np.array([r.start_pos for r in reqs], dtype=np.int64)
        cu = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(qlens, out=cu[1:])
        input_ids = np.fromiter((t for r in reqs for t in r.token_ids), dtype=np.int64, count=int(cu[-1]))
        positions = np.repeat(starts - cu[:-1], qlens) + np.arange(cu[-1])  # request i, token j: start_i + j
        tables = [t(reqs) for t in self.block_tables]  # one per KV-cache group
        rows = np.repeat(np.arange(len(reqs)), qlens)
        slot_mappings = [block_table.slot_mapping(t, rows, positions, self.block_size) for t in tables]
        seq_lens = starts + qlens
        sample_reqs = [r for r in reqs if r.sample]
        logits_idx = (cu[1:] - 1)[np.array([r.sample for r in reqs], dtype=bool)]
        ids, pos, slots, lidx, *more_slots = self._staging64(
            [input_ids, positions, slot_mappings[0], logits_idx, *slot_mappings[1:]]
        )
        if self._last_sampled is not None:  # the previous step sampled without waiting: async scheduling
            self._fill_placeholders(input_ids, ids)
        cu_d, lens_d, bt, *more_bt = self._staging32(
            [cu.astype(np.int32), seq_lens.astype(np.int32), *tables]
        )
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=cu_d,
            seq_lens=lens_d,
            block_table=bt.view(tables[0].shape),
            max_query_len=int(qlens.max()),
            max_seq_len=int(seq_lens.max()),
            num_actual_tokens=int(cu[-1]),
            num_decode_tokens=int(np.argmin(qlens == 1)) if (qlens != 1).any() else len(reqs),
        )
        if len(tables) == 1:
            return StepInputs(ids, pos, meta, lidx, sample_reqs)
        metas = [
            dataclasses.replace(meta, slot_mapping=s, block_table=b.view(t.shape))
            for s, b, t in zip(more_slots, more_bt, tables[1:])
        ]
        return StepInputs(ids, pos, meta, lidx, sample_reqs, (meta, *metas))

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.generators.pop(req_id, None)
        for tables in self.block_tables:
            tables.release(out.finished_req_ids)
        self._pending, self._prompt_logprobs = None, {}
        if not out.requests:
            self._last_sampled = None  # the next step is scheduled with every token known: no placeholder
            if get_parallel_state().dp_size > 1:  # expert parallelism spans the replicas: join their steps
                moe.dummy_step(self.model)
            return
        if get_parallel_state().pp_size > 1:
            return self._execute_pipeline(out)
        inp = self.prepare(out)
        d = self.graphs.dispatcher.dispatch([len(r.token_ids) for r in out.requests]) if self.graphs else None
        if d is not None and d.mode is not RuntimeMode.NONE:
            if d.mode is RuntimeMode.PIECEWISE:  # attention runs eagerly in the holes
                self._build(inp)
            hidden = self.graphs.run(d, inp.input_ids, inp.positions, inp.group_metas)
        else:
            hidden = self._forward(inp)
        self._prompt_logprobs = self.prompt_logprobs(out.requests, hidden)
        if inp.sample_reqs:
            self._pending = (self.model.compute_logits(hidden[inp.logits_indices]), inp.sample_reqs)

    def _build(self, inp: StepInputs) -> None:
        """Each KV-cache group's backend_data for this step, by the group's builder."""
        for builder, meta in zip(self.builders, inp.group_metas):
            meta.backend_data = builder.build(meta)

    def _forward(self, inp: StepInputs, intermediate: torch.Tensor | None = None) -> torch.Tensor:
        """Eager forward: [T, hidden], or [2, T, hidden] on a non-last pipeline stage."""
        self._build(inp)
        with forward_context(ForwardContext(self.impls, inp.meta, self.kv_caches, metas=inp.metas)):
            return self.model(inp.input_ids, inp.positions, intermediate)

    def _execute_pipeline(self, out: SchedulerOutput) -> None:
        ps = get_parallel_state()
        hidden_size = self.info.hf_config["hidden_size"]
        sends, logits, sample_reqs = [], [], []
        for reqs in micro_batches(out.requests, ps.pp_size):
            inp = self.prepare(SchedulerOutput(reqs))
            x = None
            if not ps.is_first_pp:
                x = pp_recv((2, inp.meta.num_actual_tokens, hidden_size), self.dtype, self.device)
            hidden = self._forward(inp, x)
            if not ps.is_last_pp:
                sends.append((hidden, pp_send(hidden)))  # the tensor stays alive until its send is done
                continue
            self._prompt_logprobs |= self.prompt_logprobs(reqs, hidden)
            if inp.sample_reqs:
                logits.append(self.model.compute_logits(hidden[inp.logits_indices]))
                sample_reqs += inp.sample_reqs
        for _, work in sends:
            work.wait()
        if logits:
            self._pending = (torch.cat(logits), sample_reqs)

    def prompt_logprobs(
        self, reqs: list[ScheduledRequest], hidden: torch.Tensor
    ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """For requests that asked prompt_logprobs: position j of this chunk scores prompt token j + 1."""
        out, row = {}, 0
        for r in reqs:
            first, end = r.start_pos + 1, min(r.start_pos + len(r.token_ids), len(r.prompt_token_ids) - 1) + 1
            if r.params.prompt_logprobs is not None and end > first:
                logits = self.model.compute_logits(hidden[row : row + end - first])
                target = torch.tensor(r.prompt_token_ids[first:end], device=logits.device)
                lps, ranks, tops = gather_logprobs(
                    logits.float(), target, [r.params.prompt_logprobs] * (end - first)
                )
                out[r.req_id] = (first, list(zip(lps, ranks, tops)))
            row += len(r.token_ids)
        return out

    def _fill_placeholders(self, host_ids: np.ndarray, input_ids: torch.Tensor) -> None:
        """A negative input token, placeholder(k), is row k of the previous step's sampled tokens: it is
        taken from their tensor on the device, so the host never waits for them."""
        dst = np.flatnonzero(host_ids < 0)
        if dst.size:
            d, s = self._staging_fill([dst, -1 - host_ids[dst]])
            input_ids[d] = self._last_sampled[s]

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        """Sample the pending step's rows; a grammar_output's rows first lose the tokens it forbids."""
        self._last_sampled = None
        return self._sample(grammar_output).get()

    @torch.inference_mode()
    def sample_tokens_async(self, grammar_output: GrammarOutput | None = None) -> AsyncModelRunnerOutput:
        """sample_tokens without waiting: the tokens also stay on the device, where the next step's
        placeholder inputs take them from."""
        out = self._sample(grammar_output)
        self._last_sampled = out.token_ids
        return out

    def _sample(self, grammar_output: GrammarOutput | None = None) -> AsyncModelRunnerOutput:
        prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, {}
        if self._pending is None:
            return AsyncModelRunnerOutput(prompt_logprobs=prompt_logprobs)
        logits, reqs = self._pending
        self._pending = None
        if grammar_output is not None:
            row = {r.req_id: i for i, r in enumerate(reqs)}
            apply_token_bitmask(logits, grammar_output.bitmask, [row[i] for i in grammar_output.req_ids])
        sampled = self.sampler.forward(
            logits,
            [r.params for r in reqs],
            [self._generator(r) for r in reqs],
            [r.prompt_token_ids for r in reqs],
            [r.output_token_ids for r in reqs],
            [r.num_output_tokens for r in reqs],
        )
        return AsyncModelRunnerOutput(sampled, reqs, prompt_logprobs)

    def _generator(self, r: ScheduledRequest) -> torch.Generator | None:
        if r.params.seed is None or r.params.greedy:
            return None
        g = self.generators.get(r.req_id)
        if g is None:
            g = self.generators[r.req_id] = torch.Generator(self.device).manual_seed(r.params.seed)
        return g


class HostStaging:
    """A step's host arrays of one dtype go to the device in one H2D copy, through a pinned buffer; the
    copy of the previous call must have left the buffer before it is overwritten. Each array starts on a
    16-byte boundary, so a kernel sees the same pointer alignment (one compiled specialisation) at every
    batch size. Off CUDA: no copy."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.align = 16 // dtype.itemsize
        self.host: torch.Tensor | None = None
        self.copied: torch.cuda.Event | None = None

    def __call__(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:  # flat [a.size] tensors
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a).ravel()) for a in arrays]
        starts = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum([-(-a.size // self.align) * self.align for a in arrays], out=starts[1:])
        n = int(starts[-1])
        if self.copied is not None:
            self.copied.synchronize()
        if self.host is None or self.host.numel() < n:
            self.host = torch.empty(max(n, 4096, 2 * (0 if self.host is None else self.host.numel())),
                                    dtype=self.dtype, pin_memory=True)  # fmt: skip
        buf = self.host.numpy()
        for a, off in zip(arrays, starts):
            buf[off : off + a.size] = a.ravel()
        dev = self.host[:n].to(self.device, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()
        return [dev[off : off + a.size] for a, off in zip(arrays, starts.tolist())]


def micro_batches(reqs: list[ScheduledRequest], n: int) -> list[list[ScheduledRequest]]:
    """Up to n runs of contiguous requests with about equal token counts; a request is never split."""
    cum = np.cumsum([len(r.token_ids) for r in reqs])
    # cut after the first request whose running total reaches k/n of the step's tokens
    cuts = np.searchsorted(cum, cum[-1] * np.arange(1, n) / n) + 1
    bounds = np.unique([0, *cuts.tolist(), len(reqs)])
    return [reqs[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
