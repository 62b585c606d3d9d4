"""Paged attention with torch's SDPA on the CPU.

Decode rows (one query token) run batched: their block_table rows are gathered into one padded
[Bd, Hkv, L, D] tensor with a length mask. Prefill rows (chunks, prefix hits) run one request at a
time with a causal mask offset by the cached context. All indices are built once per step in build_metadata,
from the metadata and the block size of the spec.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from turnout import Priority
from turnout.attention import AttentionBackend, AttentionMetadata, CudagraphSupport, valid_rows


@dataclass
class _Prefill:
    row: int
    q_start: int
    q_end: int
    blocks: torch.Tensor  # [max_blocks] block ids (the row of block_table)
    seq_len: int
    mask: torch.Tensor | None  # [q_len, seq_len] bool, None when plain causal from position 0


@dataclass
class CPUMetadata:
    decode_tokens: torch.Tensor  # [Bd] token index of each decode row's query
    decode_blocks: torch.Tensor  # [Bd, max_blocks] block ids
    decode_lens: torch.Tensor  # [Bd] seq_len of each decode row
    prefills: list[_Prefill]
    store_rows: torch.Tensor | None  # [n] rows with a slot when some slots are -1 (padding), else None
    decode_slots: torch.Tensor  # [Bd * L] cache slot of every key position, L = longest decode row
    decode_mask: torch.Tensor  # [Bd, 1, 1, L] True = attend


class CPUAttentionBackend(AttentionBackend):
    name = "cpu"
    priority = Priority.DEFAULT
    device_types = ("cpu",)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    cudagraph_support = CudagraphSupport.NEVER

    def build_metadata(self, meta: AttentionMetadata) -> CPUMetadata:
        qsl = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        decode_rows, prefills = [], []
        for row, (qs, qe, seq_len) in enumerate(zip(qsl, qsl[1:], seq_lens)):
            if qe - qs == 1:
                decode_rows.append(row)
                continue
            ctx = seq_len - (qe - qs)
            mask = None
            if ctx:
                mask = torch.arange(seq_len)[None, :] <= torch.arange(ctx, seq_len)[:, None]
            prefills.append(_Prefill(row, qs, qe, meta.block_table[row].long(), seq_len, mask))
        rows = torch.tensor(decode_rows, dtype=torch.long)
        blocks, lens = meta.block_table[rows].long(), meta.seq_lens[rows].long()
        return CPUMetadata(
            decode_tokens=meta.query_start_loc[rows].long(),
            decode_blocks=blocks,
            decode_lens=lens,
            prefills=prefills,
            store_rows=valid_rows(meta.slot_mapping[: meta.num_actual_tokens]),
            **_decode_slots(blocks, lens, self.spec.block_size),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        md: CPUMetadata = meta.backend_data
        hkv, d = kv_cache.shape[-2:]
        scale = self.spec.scale
        self._store(kv_cache, k, v, meta, md)
        out = torch.zeros_like(q)
        if len(md.decode_tokens):
            dq = q.index_select(0, md.decode_tokens)
            out.index_copy_(0, md.decode_tokens, self._decode(dq, kv_cache, md, scale))
        for p in md.prefills:
            # index_select, not kv_cache[0, blocks]: advanced indexing is orders of magnitude slower on CPU
            keys = kv_cache[0].index_select(0, p.blocks).reshape(-1, hkv, d)[: p.seq_len].transpose(0, 1)
            vals = kv_cache[1].index_select(0, p.blocks).reshape(-1, hkv, d)[: p.seq_len].transpose(0, 1)
            qq = q[p.q_start : p.q_end].transpose(0, 1)  # [H, q_len, D]
            o = F.scaled_dot_product_attention(
                qq, keys, vals, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=True
            )
            out[p.q_start : p.q_end] = o.transpose(0, 1)
        return out

    def _store(
        self,
        kv_cache: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        md: CPUMetadata,
    ) -> None:
        t = meta.num_actual_tokens
        slots, k, v = meta.slot_mapping[:t], k[:t], v[:t]
        if md.store_rows is not None:
            slots, k, v = slots[md.store_rows], k[md.store_rows], v[md.store_rows]
        hkv, d = kv_cache.shape[-2:]
        kv_cache[0].view(-1, hkv, d).index_copy_(0, slots, k)
        kv_cache[1].view(-1, hkv, d).index_copy_(0, slots, v)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, md: CPUMetadata, scale: float) -> torch.Tensor:
        """q [Bd, H, D] -> [Bd, H, D]."""
        bd = md.decode_blocks.shape[0]
        hkv, d = kv_cache.shape[-2:]
        keys = kv_cache[0].view(-1, hkv, d).index_select(0, md.decode_slots).view(bd, -1, hkv, d)
        vals = kv_cache[1].view(-1, hkv, d).index_select(0, md.decode_slots).view(bd, -1, hkv, d)
        keys, vals = keys.transpose(1, 2), vals.transpose(1, 2)  # [Bd, Hkv, L, D]
        if q.dtype == torch.float32:
            o = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys, vals, attn_mask=md.decode_mask, scale=scale, enable_gqa=True
            )
            return o.squeeze(2)
        # torch's CPU SDPA is ~3x slower than plain matmuls at these sizes in bf16/fp16
        qg = q.view(bd, hkv, -1, d)  # [Bd, Hkv, G, D]: the G query heads sharing one KV head
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale  # [Bd, Hkv, G, L]
        scores.masked_fill_(~md.decode_mask, float("-inf"))
        return torch.matmul(scores.softmax(-1).to(q.dtype), vals).view_as(q)


def _decode_slots(blocks: torch.Tensor, lens: torch.Tensor, block_size: int) -> dict[str, torch.Tensor]:
    """The cache slot of every key position of every decode row, [Bd * L], and the [Bd, 1, 1, L] mask of
    the real ones. Positions past a row's seq_len point at its position 0: a finite value that the mask
    then ignores (a masked slot still meets the values in the matmul, so it must not hold NaN)."""
    pos = torch.arange(int(lens.max()) if len(lens) else 0)
    valid = pos[None, :] < lens[:, None]  # [Bd, L]
    pos = torch.where(valid, pos, 0)
    slots = blocks.gather(1, pos // block_size) * block_size + pos % block_size
    return {"decode_slots": slots.flatten(), "decode_mask": valid[:, None, None, :]}
