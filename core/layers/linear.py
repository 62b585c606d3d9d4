"""Tensor-parallel linear layers. Each parameter carries a weight_loader that takes the full checkpoint
tensor and keeps this rank's shard, so models load the same files at any TP size."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from turnout.distributed import get_parallel_state, tp_all_reduce
from turnout.layers import gemv
from turnout.layers.activation import PendingSiluMul
from turnout.layers.norm import PendingNorm


def pack_for_cpu(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout of a bf16 weight [out, in] on the CPU: F.linear reorders the weight on every
    call; packed once, the same matmul gives the same bits 1.2-1.9x faster at decode sizes. None where it
    does not apply (other dtypes or devices, no oneDNN)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16)  # laid out for 16-row inputs; any work
        probe = torch.ones(1, weight.shape[1], dtype=weight.dtype)
        same = torch.equal(linear(probe, weight, None, packed), F.linear(probe, weight))
    except (RuntimeError, AttributeError):  # a CPU without bf16 support, a torch without the op
        return None
    return packed if same else None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:  # [N, in] -> [N, out]
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    if gemv.enabled(x, weight):  # decode batches of at most gemv.MAX_M rows on CUDA
        return gemv.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def pack_linears_for_cpu(model: nn.Module) -> int:
    """Give every layer with a `packed_weight` slot its packed weight (see pack_for_cpu); returns how many."""
    n = 0
    for m in model.modules():
        if hasattr(m, "packed_weight") and (p := pack_for_cpu(m.weight)) is not None:
            m.packed_weight, n = p, n + 1
    return n


def _param(*shape: int, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b, W split by output rows: each rank holds out_features / tp rows of W [out, in] and b,
    and returns its slice of y, [N, out_features / tp], not gathered (a RowParallelLinear takes it next).
    Its input may be a PendingNorm (RMSNorm(feeds_linear=True)), applied in the decode GEMV's prologue, by
    the quantization method (LinearMethod.apply_pending), or materialized first."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        ps = get_parallel_state()
        self.tp_rank, self.tp_size = ps.tp_rank, ps.tp_size
        assert out_features % self.tp_size == 0, f"{out_features} rows do not split over {self.tp_size} ranks"
        self.out_per_rank = out_features // self.tp_size
        self.weight = _param(self.out_per_rank, in_features, loader=self.weight_loader)
        self.bias = _param(self.out_per_rank, loader=self.weight_loader) if bias else None
        self.packed_weight: torch.Tensor | None = None  # the weight in oneDNN's layout, CPU bf16 only
        self.quant_method = None  # a turnout.quantization.LinearMethod, set before the checkpoint loads

    def shard_rows(self, shard_id: Any = None) -> tuple[int, int, int]:
        """Where checkpoint part shard_id goes, in weight rows: (offset in this rank's weight, rows, first
        row of this rank's slice in the part's full tensor)."""
        return 0, self.out_per_rank, self.tp_rank * self.out_per_rank

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        """Copy this rank's rows of the full checkpoint weight [out, in] or bias [out] (of part shard_id,
        for a fused layer) into their place in param."""
        offset, size, start = self.shard_rows(shard_id)
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        """x [N, in_features] -> this rank's [N, out_features / tp]."""
        if self.quant_method is not None:
            if isinstance(x, PendingNorm):
                return self.quant_method.apply_pending(self, x, self.bias)
            return self.quant_method.apply(self, x, self.bias)
        if isinstance(x, PendingNorm):
            if gemv.enabled(x.x, self.weight) and x.x.shape[1] <= gemv.NORM_MAX_K:  # the GEMV's prologue
                norm = (x.weight, x.eps)
                return gemv.gemv(x.x, self.weight, self.bias, norm=norm, residual=x.residual,
                                 residual_out=x.residual_out)[0]  # fmt: skip
            x = x.materialize()
        return linear(x, self.weight, self.bias, self.packed_weight)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_up_proj = [gate | up]). Each rank holds, in
    order, its 1/tp slice of each output, so its y is [gate slice | up slice]; every size must split over
    tp. Load each checkpoint tensor with weight_loader(param, tensor, shard_id), shard_id indexing
    output_sizes."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def shard_rows(self, shard_id: Any = 0) -> tuple[int, int, int]:
        """Output shard_id's rows: its 1/tp slice, after the slices of the outputs before it."""
        size = self.output_sizes[shard_id] // self.tp_size
        return sum(self.output_sizes[:shard_id]) // self.tp_size, size, self.tp_rank * size


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; each rank's output is [q | k | v] of its own heads, [N, (num_heads +
    2 num_kv_heads) head_size], num_heads and num_kv_heads being the per-rank counts this layer exposes.
    Per rank: num_heads = heads / tp (must divide); num_kv_heads = kv_heads / tp, or 1 when tp > kv_heads,
    then each KV head is replicated on kv_replicas = tp / kv_heads consecutive ranks (tp and kv_heads are
    expected to divide one another; not checked). Load q_proj, k_proj and v_proj (full checkpoint tensors,
    weight or bias) with weight_loader(param, tensor, "q" | "k" | "v")."""

    def __init__(
        self, hidden: int, head_size: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        tp = get_parallel_state().tp_size
        assert num_heads % tp == 0, f"{num_heads} attention heads do not split over {tp} ranks"
        self.head_size = head_size
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)  # ranks that share one KV head
        out = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp
        super().__init__(hidden, out, bias)

    def shard_rows(self, shard_id: Any = "q") -> tuple[int, int, int]:
        """This rank's heads of q, k or v [heads * head_size, hidden]; rank r takes KV head block
        r // kv_replicas."""
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        return offset, size, rank * size


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W [out, in] split by input columns: a rank takes its slice x [N, in / tp] (a
    column-parallel output, or a PendingSiluMul from SiluAndMul(feeds_linear=True)), and the partial sums
    are all-reduced, so every rank gets the whole [N, out]. The bias is whole on each rank, added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        ps = get_parallel_state()
        self.tp_rank, self.tp_size = ps.tp_rank, ps.tp_size
        assert in_features % self.tp_size == 0, (
            f"{in_features} columns do not split over {self.tp_size} ranks"
        )
        self.weight = _param(out_features, in_features // self.tp_size, loader=self.weight_loader)
        self.bias = _param(out_features, loader=self._bias_loader) if bias else None
        self.packed_weight: torch.Tensor | None = None  # the weight in oneDNN's layout, CPU bf16 only
        self.quant_method = None  # a turnout.quantization.LinearMethod, set before the checkpoint loads
        self.in_per_rank = in_features // self.tp_size

    def shard_cols(self) -> tuple[int, int]:
        """This rank's input columns of the checkpoint weight [out, in]: (first column, columns)."""
        return self.tp_rank * self.in_per_rank, self.in_per_rank

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy this rank's columns of the full checkpoint weight [out, in] into param (the bias has its own
        loader that copies it whole)."""
        start, n = self.shard_cols()
        param.data.copy_(loaded.narrow(1, start, n))

    def _bias_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor | PendingSiluMul) -> torch.Tensor:
        """x [N, in_features / tp] -> [N, out_features], summed over the TP ranks."""
        if self.quant_method is not None:
            qm = self.quant_method
            y = tp_all_reduce(
                qm.apply_pending(self, x, None) if isinstance(x, PendingSiluMul) else qm.apply(self, x, None)
            )
            return y if self.bias is None else y + self.bias
        if isinstance(x, PendingSiluMul):
            if gemv.enabled(x.x, self.weight):  # SiLU-and-mul runs in the GEMV's prologue
                y = gemv.gemv(x.x, self.weight, silu_mul=True)
            else:
                y = linear(x.materialize(), self.weight, None, self.packed_weight)
        else:
            y = linear(x, self.weight, None, self.packed_weight)
        y = tp_all_reduce(y)
        return y if self.bias is None else y + self.bias
