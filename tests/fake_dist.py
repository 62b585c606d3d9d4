"""Fake installed distributions: a dist-info with entry_points.txt plus a module, put on sys.path."""

from __future__ import annotations

from pathlib import Path


def make_dist(root: Path, dist: str, module: str, source: str, ep_name: str | None = None) -> Path:
    """Write `module.py` and `<dist>-1.2.3.dist-info` under root; return root (to put on sys.path)."""
    (root / f"{module}.py").write_text(source)
    info = root / f"{dist.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text(f"[turnout]\n{ep_name or module} = {module}\n")
    return root


NAIVE_BACKEND = '''
import torch
import turnout
from turnout.attention import AttentionBackend, CudagraphSupport


class NaiveBackend(AttentionBackend):
    """Gathers each request's keys and runs explicit softmax attention: slow, simple, any device."""

    name = "naive"
    priority = PRIORITY
    device_types = ("cpu", "cuda")
    dtypes = (torch.float32, torch.bfloat16, torch.float16)

    def forward(self, layer, q, k, v, kv_cache, meta):
        t = meta.num_actual_tokens
        ok = meta.slot_mapping[:t] >= 0
        hkv, d = kv_cache.shape[-2:]
        kv_cache[0].view(-1, hkv, d)[meta.slot_mapping[:t][ok]] = k[:t][ok]
        kv_cache[1].view(-1, hkv, d)[meta.slot_mapping[:t][ok]] = v[:t][ok]
        out = torch.zeros_like(q)
        qsl, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        group = layer.num_heads // layer.num_kv_heads
        for b, seq_len in enumerate(lens):
            qs, qe = qsl[b], qsl[b + 1]
            keys = kv_cache[0, meta.block_table[b].long()].reshape(-1, hkv, d)[:seq_len]
            vals = kv_cache[1, meta.block_table[b].long()].reshape(-1, hkv, d)[:seq_len]
            keys, vals = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), keys.float()) * layer.scale
            pos = torch.arange(seq_len - (qe - qs), seq_len)
            scores.masked_fill_(torch.arange(seq_len)[None, None, :] > pos[None, :, None], float("-inf"))
            out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals.float()).to(q.dtype)
        return out


@turnout.hookimpl
def turnout_attention_backends(platform):
    return [NaiveBackend()]
'''


def naive_backend_source(priority: int = 100) -> str:
    return NAIVE_BACKEND.replace("PRIORITY", str(priority))
