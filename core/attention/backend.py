"""Attention backends in three parts, by lifetime (vLLM's AttentionBackend, AttentionMetadataBuilder and
AttentionImpl):
  - AttentionBackend: what it serves, declared as data, and `check(ctx)` during selection; no state of a
    step or a layer;
  - AttentionMetadataBuilder: one per KV-cache group on a worker (`backend.make_builder(spec, group)`); per
    step `build(meta)` once, its result stored in meta.backend_data; it owns the group's CUDA-graph buffers;
  - AttentionImpl: one per attention layer (`backend.make_impl(spec, layer)`); `forward` once per step.

Shapes (T = tokens in the step, B = requests in the step, H / Hkv / D from the AttentionSpec):
  q: [T, H, D]                         k, v: [T, Hkv, D]
  kv_cache: kv_cache_shape(...)        default [2, num_blocks, block_size, Hkv, D]: keys, then values, in
                                       spec.cache_dtype: the model dtype, or float8_e4m3fn (kv_cache_dtype)
  slot_mapping: [T] int64              slot = block_id * block_size + offset; -1 writes nowhere
  query_start_loc: [B + 1] int32       cu_seqlens of the queries
  seq_lens: [B] int32                  tokens in the KV cache after this step (context + query)
  block_table: [B, max_blocks] int32   block ids of each request in the layer's KV-cache group, padded with 0
                                       (NULL_BLOCK where a window freed them: kv_spec)
Query token i of request b sits at position seq_lens[b] - query_len[b] + i and attends causally to every
cached token up to and including that position; a layer may narrow that to a sliding window and cap its
scores (AttentionLayerSpec), where its backend declares the feature (attention_features).

An FP8 cache (kv_cache_dtype "fp8", vLLM's names and format) holds float8_e4m3fn with per-layer scalar
scales: key x is stored as e4m3(clamp(x / layer.k_scale, -448, 448)), rounded to nearest even, and read as
stored * layer.k_scale in float32; values likewise with v_scale. A backend reads the cache dtypes it
declares in kv_cache_dtypes; selection refuses it the others.

Multi-head latent attention (spec.kv_lora_rank set; the "mla" KV-cache spec), in its absorbed form: Hkv is
1 and D = kv_lora_rank + qk_rope_head_dim. k [T, 1, D] is the latent vector, the key of every query head;
v is k[..., :kv_lora_rank], the values, which the cache does not hold apart: kv_cache is
[num_blocks, block_size, 1, D], written with k alone. forward returns [T, H, kv_lora_rank].
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from turnout.attention.kv_spec import (
    KV_CACHE_SPEC_KINDS,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from turnout.envs import EnvVar
from turnout.errors import ConfigError
from turnout.platform import Platform


class CudagraphSupport(enum.IntEnum):
    """Which batches a backend can replay from a CUDA graph with static metadata buffers."""

    NEVER = 0
    UNIFORM_DECODE = 1  # every request runs exactly one token
    UNIFORM_BATCH = 2  # every request runs the same number of tokens
    ALWAYS = 3  # any batch

    @classmethod
    def from_env(cls, var: EnvVar[str], default: CudagraphSupport) -> CudagraphSupport:
        """A backend's declared level, or the one its declared switch `var` sets (to try a capture on a new
        library version, or to turn graphs off around a backend)."""
        value = var.value.strip().upper()
        if not value:
            return default
        if value not in cls.__members__:
            levels = ", ".join(cls.__members__)
            raise ConfigError(f"{var.name}={value!r} is not a CUDA-graph support level; use one of {levels}")
        return cls[value]


# vLLM's kv_cache_dtype names: "auto" is the model dtype; "fp8" and its alias "fp8_e4m3" are float8_e4m3fn
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}
KV_CACHE_ALIASES = {"fp8_e4m3": "fp8"}  # the name a backend declares for each alias
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def kv_cache_torch_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The element dtype of a KV cache of kv_cache_dtype (a KV_CACHE_DTYPES name) for a model run in dtype."""
    return KV_CACHE_DTYPES[kv_cache_dtype] or dtype


def quantize_kv(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of cache_dtype stores it: unchanged in the model dtype; for float8_e4m3fn,
    e4m3(clamp(x / scale, -448, 448)) computed in float32, rounded to nearest even."""
    if cache_dtype != torch.float8_e4m3fn:
        return x.to(cache_dtype)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(cache_dtype)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache contents x read in dtype: unchanged where x is already dtype; FP8 contents as x * scale in
    float32, then cast to dtype."""
    if x.dtype == dtype:
        return x
    return (x.float() * scale).to(dtype)


# What a layer may set for itself, by vLLM's names: its own softmax scale (a feature where the layers'
# scales differ), a sliding window and a logit soft-cap.
LAYER_FEATURES = ("scale", "sliding_window", "logits_soft_cap")


@dataclass(frozen=True)
class AttentionLayerSpec:
    """One attention layer's own features, which its AttentionImpl is made with (make_impl).

    sliding_window: a query at position p attends to keys in (p - sliding_window, p], its own included
    (HF's and vLLM's convention); None attends to every earlier key. logits_soft_cap: each score s (after the
    scale) becomes cap * tanh(s / cap) before the causal mask and the softmax, as Gemma 2 does; None leaves
    it. k_scale and v_scale: the FP8 KV cache's scales of this layer (the checkpoint's, else vLLM's 1.0);
    a cache in the model dtype ignores them."""

    index: int  # layer_idx: this layer's KV cache
    scale: float  # softmax scale
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0


def layer_features(layers: Iterable[AttentionLayerSpec]) -> frozenset[str]:
    """The LAYER_FEATURES the layers use: "scale" where their scales differ, "sliding_window" and
    "logits_soft_cap" where any layer sets one."""
    layers = list(layers)
    used = {"scale"} if len({layer.scale for layer in layers}) > 1 else set()
    used |= {f for f in LAYER_FEATURES[1:] if any(getattr(layer, f) is not None for layer in layers)}
    return frozenset(used)


@dataclass(frozen=True)
class AttentionContext:
    """What selection knows when it asks a backend whether it can serve: the model's head counts, the
    per-layer features (LAYER_FEATURES names) its layers use, as its ModelArchitecture declares them, and the
    KV cache's dtype (a KV_CACHE_DTYPES name)."""

    platform: Platform
    dtype: torch.dtype
    head_size: int
    num_heads: int
    num_kv_heads: int
    block_size: int
    features: frozenset[str] = frozenset()
    kv_cache_dtype: str = "auto"
    kv_lora_rank: int | None = None  # multi-head latent attention: head_size is the latent vector's

    @property
    def kv_cache_specs(self) -> frozenset[str]:
        """The KV-cache spec kinds (KV_CACHE_SPEC_KINDS) the layers need: "mla" for multi-head latent
        attention; else "sliding_window" where some layer has a window, and "full" always (a model's
        declaration does not say whether every layer has one)."""
        if self.kv_lora_rank:
            return frozenset({"mla"})
        return frozenset({"full"} | ({"sliding_window"} & self.features))


@dataclass(frozen=True)
class AttentionSpec:
    """What the attention layers on this rank run, given to every builder and implementation the backend
    makes. Every layer shares one KV cache shape; `layers` holds what each sets for itself
    (AttentionLayerSpec)."""

    num_heads: int  # query heads on this rank: the model's / tensor_parallel_size
    num_kv_heads: int  # KV heads on this rank: the model's / tensor_parallel_size, at least 1 (replicated)
    head_size: int
    dtype: torch.dtype  # of q, k, v and the output; of the KV cache where kv_cache_dtype is "auto"
    block_size: int  # tokens per KV block
    scale: float  # softmax scale of every layer; where layers differ ("scale" feature), layer 0's
    num_layers: int  # attention layers on this rank (this pipeline stage's)
    layers: tuple[AttentionLayerSpec, ...] = ()  # by layer_idx; empty: every layer is plain, at `scale`
    kv_cache_dtype: str = "auto"  # a KV_CACHE_DTYPES name
    # multi-head latent attention (see the module docstring): num_kv_heads 1, head_size the latent vector's,
    # values its first kv_lora_rank dims; None: keys and values of head_size each
    kv_lora_rank: int | None = None

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's element dtype: dtype, or float8_e4m3fn for an FP8 cache."""
        return kv_cache_torch_dtype(self.kv_cache_dtype, self.dtype)

    def layer(self, i: int) -> AttentionLayerSpec:
        """Layer i's own features: layers[i], or plain causal attention at `scale` where layers is empty."""
        return self.layers[i] if self.layers else AttentionLayerSpec(i, self.scale)

    @property
    def features(self) -> frozenset[str]:
        """The LAYER_FEATURES these layers use (layer_features)."""
        return layer_features(self.layers)

    @property
    def v_head_size(self) -> int:
        """The values' head size, that of forward's output: kv_lora_rank under MLA, else head_size."""
        return self.kv_lora_rank or self.head_size

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """Each layer's KVCacheSpec, by layer_idx: MLAAttentionSpec under multi-head latent attention, else
        SlidingWindowSpec where the layer has a window, else FullAttentionSpec."""
        shape = (self.block_size, self.num_kv_heads, self.head_size, self.cache_dtype)
        if self.kv_lora_rank:
            return [MLAAttentionSpec(*shape, self.kv_lora_rank)] * self.num_layers
        windows = [self.layer(i).sliding_window for i in range(self.num_layers)]
        return [SlidingWindowSpec(*shape, w) if w else FullAttentionSpec(*shape) for w in windows]


@dataclass
class AttentionMetadata:
    """One step's batch, built once by the model runner and shared by every layer.

    Row order: requests keep the scheduler's order, which is not sorted by query length. Decode rows (one
    query token) may sit anywhere; num_decode_tokens counts only the leading run of them.

    Cache contents: of request b, positions [0, seq_lens[b]) are cached once this step's k, v are written.
    Every other slot a block_table row reaches (the rest of the last block, and block 0 in the padding) is
    undefined: stale keys of a freed request, or NaN in the conformance tests. A backend must keep those
    slots out of its sums (a masked score times NaN is still NaN), never just weight them by zero.

    CUDA-graph padding: under a FULL graph T and B are the captured sizes. Padded tokens (rows from
    num_actual_tokens on) have slot -1; their output rows are discarded and may hold anything. Padded
    requests run one token with seq_len 1 (uniform decode) or no token (other batches). While a graph is
    captured the host ints (max_query_len, max_seq_len) are upper bounds of what a replay will see.
    """

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int  # T without graph padding
    num_decode_tokens: int = 0  # leading rows that run exactly one token
    backend_data: Any = None  # what the group's AttentionMetadataBuilder.build returned for this step

    @property
    def num_reqs(self) -> int:
        """Requests in the step, padding ones included: seq_lens' length."""
        return self.seq_lens.shape[0]

    @property
    def query_lens(self) -> torch.Tensor:
        """[num_reqs] int32 on the device: each request's query tokens this step (1 for a decode row)."""
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @property
    def uniform_decode(self) -> bool:
        """Every request runs exactly one token (and there is no graph padding)."""
        return self.max_query_len == 1 and self.num_actual_tokens == self.num_reqs


class AttentionMetadataBuilder:
    """One KV-cache group's per-step preparation on one worker: the backend makes one per group
    (make_builder), so two groups never share its state. The base builds nothing."""

    def __init__(self, backend: AttentionBackend, spec: AttentionSpec, group: int = 0) -> None:
        self.backend, self.spec, self.group = backend, spec, group

    def build(self, meta: AttentionMetadata) -> Any:
        """Once per step, before the group's layers run: plan kernels, precompute indices. The model runner
        stores the result in meta.backend_data, which every layer of the group reads.

        For FULL CUDA graphs the runner calls it on static metadata buffers before capture and again
        before every replay: whatever tensors the layers read must then be updated in place, not replaced."""
        return None

    def prepare_cudagraphs(self, max_num_reqs: int, max_blocks_per_req: int) -> None:
        """Called once before any FULL capture: size static buffers for the largest batch and block table."""


class AttentionImpl:
    """One attention layer's computation, made by the backend for that layer (make_impl); it computes from
    its arguments and the step's backend_data and keeps no state across steps."""

    def __init__(self, backend: AttentionBackend, spec: AttentionSpec, layer: AttentionLayerSpec) -> None:
        self.backend, self.spec, self.layer = backend, spec, layer

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # this layer's, kv_cache_shape(...)
        meta: AttentionMetadata,  # of the layer's KV-cache group, backend_data built by its builder
    ) -> torch.Tensor:
        """Write k, v into kv_cache at meta.slot_mapping (skipping -1), quantized with the layer's k_scale and
        v_scale where the cache is FP8 (see the module docstring), then attend as self.layer says: its
        scale, and its sliding window and soft-cap where the backend declares them (attention_features).
        Returns [T, H, spec.v_head_size] (D; under MLA kv_lora_rank, and only k is written); must not modify
        q, k or v."""
        raise NotImplementedError


class AttentionBackend:
    """Base class: what a backend serves, as data, and the parts it makes. A subclass declares name,
    device_types and dtypes (there are no defaults: a backend that forgot them would be refused on some
    platform without saying why) and impl_cls; builder_cls where its layers read per-step metadata."""

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    # the rank for mixed and prefill steps under "auto"; None: priority. Where the valid backend it ranks
    # first is not the one priority ranks first, and the two can share one KV cache, "auto" composes that
    # pair per phase (attention.per_phase): priority's for decode steps, this one's for the rest
    mixed_priority: ClassVar[int | None] = None
    device_types: ClassVar[tuple[str, ...]]  # e.g. ("cpu", "cuda")
    dtypes: ClassVar[tuple[torch.dtype, ...]]  # the CPU runs float32 unless it has native bfloat16
    head_sizes: ClassVar[tuple[int, ...] | None] = None  # None: any head size
    block_size_multiple: ClassVar[int] = 1  # block_size must be a multiple of this
    preferred_block_size: int = 16  # block_size where the config leaves it unset; a multiple of the above
    min_capability: ClassVar[tuple[int, int] | None] = None  # CUDA compute capability
    cudagraph_support: ClassVar[CudagraphSupport] = CudagraphSupport.NEVER
    # the LAYER_FEATURES the impls serve: a model whose layers use another is refused by selection
    attention_features: ClassVar[frozenset[str]] = frozenset()
    # the KV_CACHE_DTYPES names whose cache the impls read and write ("fp8" covers its alias "fp8_e4m3")
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    # the KV_CACHE_SPEC_KINDS the impls serve. "sliding_window": a layer with a window reads only the blocks
    # in it, each group's block_table holding NULL_BLOCK for the blocks freed before it
    kv_cache_specs: ClassVar[tuple[str, ...]] = ("full",)
    builder_cls: ClassVar[type[AttentionMetadataBuilder]] = AttentionMetadataBuilder
    impl_cls: ClassVar[type[AttentionImpl]]  # a layer's forward

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not hasattr(cls, "impl_cls") and cls.make_impl is AttentionBackend.make_impl:
            return  # an intermediate base class, or one of another plugin API's shape (plugin_shapes)
        missing = [a for a in ("name", "device_types", "dtypes") if not hasattr(cls, a)]
        if missing:
            raise TypeError(
                f"attention backend {cls.__name__} must declare {', '.join(missing)}, e.g. name = "
                '"mine", device_types = ("cpu", "cuda"), dtypes = (torch.float32, torch.bfloat16)'
            )
        if unknown := set(cls.attention_features) - set(LAYER_FEATURES):
            raise TypeError(f"attention backend {cls.__name__}: unknown attention_features {sorted(unknown)}")
        names = [k for k in KV_CACHE_DTYPES if k not in KV_CACHE_ALIASES]
        if unknown := set(cls.kv_cache_dtypes) - set(names):
            raise TypeError(
                f"attention backend {cls.__name__}: unknown kv_cache_dtypes {sorted(unknown)}; "
                f"declare some of {', '.join(names)}"
            )
        if unknown := set(cls.kv_cache_specs) - set(KV_CACHE_SPEC_KINDS):
            raise TypeError(
                f"attention backend {cls.__name__}: unknown kv_cache_specs {sorted(unknown)}; "
                f"declare some of {', '.join(KV_CACHE_SPEC_KINDS)}"
            )

    def import_error(self) -> str | None:
        """Import the heavy library; return why it is unusable, or None. Called only when checked."""
        return None

    def platform_reasons(self, platform: Platform) -> list[str]:
        """Why this backend cannot run on platform whatever the model: its device, compute capability or
        library (`turnout plugins` shows them); check() adds the model's reasons."""
        reasons = self._device_reasons(platform)
        if not reasons and (err := self.import_error()):
            reasons.append(err)
        return reasons

    def _device_reasons(self, p: Platform) -> list[str]:
        if p.device_type not in self.device_types:
            return [f"needs device {'/'.join(self.device_types)}, have {p.device_type}"]
        if self.min_capability and (p.capability or (0, 0)) < self.min_capability:
            need = "%d.%d" % self.min_capability
            return [f"needs compute capability >= {need}, have {p.capability}"]
        return []

    def check(self, ctx: AttentionContext) -> list[str]:
        """Every reason this backend cannot serve ctx; empty means it can. A query: it changes nothing."""
        reasons = self._device_reasons(ctx.platform)
        if ctx.dtype not in self.dtypes:
            ok = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            reasons.append(f"dtype {str(ctx.dtype).removeprefix('torch.')} unsupported (supports {ok})")
        if self.head_sizes is not None and ctx.head_size not in self.head_sizes:
            reasons.append(f"head size {ctx.head_size} unsupported (supports {list(self.head_sizes)})")
        if ctx.block_size is not None and ctx.block_size % self.block_size_multiple:
            reasons.append(f"block_size {ctx.block_size} is not a multiple of {self.block_size_multiple}")
        if ctx.num_heads % ctx.num_kv_heads:
            reasons.append(f"num_heads {ctx.num_heads} not divisible by num_kv_heads {ctx.num_kv_heads}")
        if missing := sorted(ctx.features - set(self.attention_features)):
            have = ", ".join(sorted(self.attention_features)) or "none"
            reasons.append(f"per-layer {', '.join(missing)} unsupported (supports {have})")
        if KV_CACHE_ALIASES.get(ctx.kv_cache_dtype, ctx.kv_cache_dtype) not in self.kv_cache_dtypes:
            have = ", ".join(self.kv_cache_dtypes) or "none"
            reasons.append(f"kv_cache_dtype {ctx.kv_cache_dtype} unsupported (supports {have})")
        if missing := sorted(ctx.kv_cache_specs - set(self.kv_cache_specs)):
            have = ", ".join(self.kv_cache_specs) or "none"
            reasons.append(f"KV-cache spec {', '.join(missing)} unsupported (serves {have})")
        if not reasons and (err := self.import_error()):
            reasons.append(err)
        return reasons

    def kv_cache_shape(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        kv_lora_rank: int | None = None,
    ) -> tuple:
        """Shape of one layer's KV cache tensor, in spec.cache_dtype: num_blocks pages of the layer's
        KVCacheSpec (page_size_bytes each, which sizes the cache). Keys, then values; under multi-head latent
        attention (kv_lora_rank set), the one latent vector a token."""
        if kv_lora_rank:
            return (num_blocks, block_size, num_kv_heads, head_size)
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def make_builder(self, spec: AttentionSpec, group: int = 0) -> AttentionMetadataBuilder:
        """The metadata builder of KV-cache group `group` on a worker whose layers run spec; one per group."""
        return self.builder_cls(self, spec, group)

    def make_impl(self, spec: AttentionSpec, layer: AttentionLayerSpec) -> AttentionImpl:
        """The implementation of one attention layer (spec.layer(i) of the layers spec runs)."""
        return self.impl_cls(self, spec, layer)
