"""Triton kernels for paged attention over the default cache layout, and their launchers.

Cache: kv_cache [2, num_blocks, block_size, num_kv_heads, head_size]; K = kv_cache[0], V = kv_cache[1].
Every key is found through block_table (block = pos // block_size, row = pos % block_size), so any
block size works. Query heads are folded into the M dimension of each tile: the QPK = num_heads //
num_kv_heads query heads sharing one KV head read each K/V tile once. Softmax is online in float32 with
exp2: scores are pre-multiplied by scale * log2(e); split-KV partials carry their LSE in log2 units.

Constraints: num_heads a multiple of num_kv_heads; head_size <= 256 (padded to a power of two >= 16 in
registers, so 64/128/256 waste nothing); any block size; q, k, v may be strided views (last dim unit
stride). Grids depend only on tensor shapes and the split count (`num_splits`), never on per-request
lengths, which the kernels read from device memory, so CUDA graphs replay them for any batch. Each kernel
is launched with turnout.layers.pdl_launch() and, under PDL, waits for the kernel before it first.

Prefill: a program owns BLOCK_Q query tokens x their QPK heads against one KV head. Key tiles strictly
below its first row's causal diagonal run in a loop without any mask (one FMA and one exp2 per score);
the tiles that cross the diagonal run masked after it. Programs start with the longest query tiles. Its
tiles can be overridden at run time (TURNOUT_TRITON_PREFILL) for a tile sweep.

Per-layer features are constexpr flags, so a layer without them runs the kernels above unchanged: WINDOW
(a sliding window of that many keys, 0 for none) and SOFT_CAP (the logit soft-cap in log2 units, 0 for
none), one compiled variant per value. Under a window, prefill skips the key tiles below its first row's
window and masks every tile it reads; decode splits only the keys [seq_len - WINDOW, seq_len), from the
start of the tile holding the first, and masks that tile. A soft-capped score is capped in float32 from the
raw dot, SOFT_CAP * tanh(s * scale_log2 / SOFT_CAP), before the mask.

FP8 (a constexpr, set where the cache is float8_e4m3fn: kv_cache_dtype fp8) stores k / k_scale and
v / v_scale rounded to e4m3 (_to_e4m3: nearest even, saturated at +-448, the bits torch's cast gives), and
every K/V tile is read as stored * scale in float32, then cast to q's dtype for the dots. Without FP8 the
scales are unused and the kernels are those of a model-dtype cache.

The latent layout of multi-head latent attention (launchers' kv_lora_rank; the "mla" KV-cache spec): kv_cache
[num_blocks, block_size, 1, kv_lora_rank + PE], one KV head, K = the whole row and V = its first
kv_lora_rank dims. The kernels then take HEAD = kv_lora_rank (V's and the output's head size, K's first
part) and PE > 0 (K's last dims, the rope part): a score is q[:HEAD] . K[:HEAD] + q[HEAD:] . K[HEAD:], two
dots of power-of-two widths (512 and 64 at DeepSeek's shape, so a 576-wide head wastes no lanes), and the
tile read for the first part is V's too. Only K is written. PE = 0 compiles the kernels of the default
layout unchanged.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from turnout.layers import pdl_launch
from turnout_triton import envs
from turnout_triton.envs import DECODE, PREFILL

LOG2E = 1.4426950408889634
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_PREFILL_OVERRIDE = PREFILL.value  # read once, when the backend first launches a kernel
_DECODE_OVERRIDE = DECODE.value
MAX_SPLITS = 16
# Keys per decode split, at least: a request's split boundaries depend on its own seq_len alone, so every
# split count that covers them gives bit-identical output, and eager steps and CUDA graphs (captured with
# the split count of max_model_len) agree token for token. The interpreter uses small splits so that CPU
# tests exercise them. TURNOUT_TRITON_SPLIT_KEYS sets it for a measured trade: smaller splits keep more
# programs busy at batch 1 and add partial writes at large batches; at the 8B shape, batch 1, 64 and 128
# gave 512's TPOT (benchmarks/results/latency/*-qwen3-8b-split-keys-*.json).
SPLIT_KEYS = 64 if INTERPRET else envs.SPLIT_KEYS.value
DECODE_PROGRAMS = 1024  # decode programs to aim for (decode_programs): ~8 per SM of an H200


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    """Under PDL (turnout.layers.pdl_launch()): wait until the kernel before has finished and its writes are
    visible, then let the kernel after start."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _to_e4m3(x):
    """float32 x rounded to the nearest float8_e4m3fn value (ties to even), saturated at +-448, still in
    float32: the value torch's clamp-and-cast gives, which then converts to e4m3 exactly (the interpreter's
    own float32 -> e4m3 rounding is not round-to-nearest-even). Normals keep 3 of float32's 23 mantissa
    bits; below 2^-6 (e4m3's subnormals, steps of 2^-9) adding and removing 1.5 * 2^14 rounds to a step."""
    a = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = a.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    mag = ((tl.abs(a) + 24576.0) - 24576.0).to(tl.uint32, bitcast=True)
    sub = (mag | (bits & 0x80000000)).to(tl.float32, bitcast=True)  # a's sign, on zero too (-0.0 is 0x80)
    return tl.where(tl.abs(a) < 0.015625, sub, normal)


@triton.jit
def _to_cache(x, scale, cache_ptr, FP8: tl.constexpr):
    """x as the cache at cache_ptr stores it: x itself, or under FP8 e4m3(x / scale), the quotient correctly
    rounded as torch's (div_rn: on CUDA `/` is div.full.f32, up to 2 ulp off, which moves ties to another
    e4m3 value). (One return: the compiler types every return of a function, constexpr branches included.)"""
    if FP8:
        y = _to_e4m3(tl.math.div_rn(x.to(tl.float32), scale)).to(cache_ptr.dtype.element_ty)
    else:
        y = x
    return y


@triton.jit
def _from_cache(x, scale, dtype: tl.constexpr, FP8: tl.constexpr):
    """Cache contents x as the dots read them: x itself, or under FP8 x * scale in float32, cast to dtype."""
    if FP8:
        y = (x.to(tl.float32) * scale).to(dtype)
    else:
        y = x
    return y


@triton.jit
def _store_kv_kernel(
    k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
    s_kt, s_kh, s_vt, s_vh, s_cb, s_cs, s_ch, block_size, num_kv_heads,
    HEAD: tl.constexpr, HEAD_P2: tl.constexpr, KVH_P2: tl.constexpr, PDL: tl.constexpr, FP8: tl.constexpr,
    K_ONLY: tl.constexpr,
):  # fmt: skip
    """Token t's k and v (K_ONLY, the latent layout: its k alone, of HEAD dims) at its slot."""
    _pdl_wait(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    h = tl.arange(0, KVH_P2)[:, None]
    d = tl.arange(0, HEAD_P2)[None, :]
    mask = (h < tl.where(slot >= 0, num_kv_heads, 0)) & (d < HEAD)  # [KVH_P2, HEAD_P2]
    dst = (slot // block_size) * s_cb + (slot % block_size) * s_cs + h * s_ch + d
    kx = _to_cache(tl.load(k + t * s_kt + h * s_kh + d, mask=mask), k_scale, k_cache, FP8)
    tl.store(k_cache + dst, kx, mask=mask)
    if not K_ONLY:
        vx = _to_cache(tl.load(v + t * s_vt + h * s_vh + d, mask=mask), v_scale, v_cache, FP8)
        tl.store(v_cache + dst, vx, mask=mask)


@triton.jit
def _load_pe(ptr, rows, qt, d, PE: tl.constexpr, PE_P2: tl.constexpr):
    """The latent layout's query dims past HEAD, ptr [M, 1] + [0, PE) -> [M, PE_P2] (rows masked by rows),
    and their offsets; without PE, qt and d, which the kernels then never read."""
    if PE > 0:
        e = tl.arange(0, PE_P2)
        x = tl.load(ptr + e[None, :], mask=rows[:, None] & (e[None, :] < PE), other=0.0)
    else:
        e = d
        x = qt
    return x, e


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    if PREC == "upcast":  # the interpreter's dot multiplies bfloat16 bit patterns as integers (triton 3.9)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _find_request(cu, num_reqs, pid, BLOCK_Q: tl.constexpr):
    """Largest b with cu[b] // BLOCK_Q + b <= pid: request b owns tiles [that, next request's)."""
    lo = 0
    hi = num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = tl.load(cu + mid) // BLOCK_Q + mid <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def _mma(a, b, acc, PREC: tl.constexpr):
    """acc + a @ b, accumulated in place (on Hopper the wgmma accumulator)."""
    if PREC == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _gather_rows(
    base, off, d, kmask, HEAD: tl.constexpr, HEAD_P2: tl.constexpr, MASK: tl.constexpr, TRANS: tl.constexpr
):  # fmt: skip
    """Rows base[off[n] + d] -> [N, HEAD_P2], or [HEAD_P2, N] read transposed when TRANS. Unmasked unless
    MASK (key n valid only where kmask[n]) or the head is padded (d >= HEAD)."""
    if TRANS:
        ptr = base + off[None, :] + d[:, None]
        if MASK:
            x = tl.load(ptr, mask=kmask[None, :] & (d[:, None] < HEAD), other=0.0)
        elif HEAD == HEAD_P2:
            x = tl.load(ptr)
        else:
            x = tl.load(ptr, mask=d[:, None] < HEAD, other=0.0)
    else:
        ptr = base + off[:, None] + d[None, :]
        if MASK:
            x = tl.load(ptr, mask=kmask[:, None] & (d[None, :] < HEAD), other=0.0)
        elif HEAD == HEAD_P2:
            x = tl.load(ptr)
        else:
            x = tl.load(ptr, mask=d[None, :] < HEAD, other=0.0)
    return x


@triton.jit
def _block_ids(bt_row, j, end, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Cache block of each key of the tile [j, j + BLOCK_N) (0 for keys >= end), in one load: a scalar
    when the tile lies in one block, else BLOCK_N lanes reading BLOCK_N // BLOCK_SIZE entries."""
    if BLOCK_SIZE % BLOCK_N == 0:
        ids = tl.load(bt_row + j // BLOCK_SIZE, mask=j < end, other=0)
    else:
        pos = j + tl.arange(0, BLOCK_N)
        ids = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos < end, other=0)
    return ids


@triton.jit
def _soft_cap(s, CAP: tl.constexpr):
    """CAP * tanh(s / CAP) for CAP > 0, from one exp2 of a non-positive argument (no overflow); within
    ~1e-7 CAP of the exact value. (libdevice's tanh does not run in the interpreter.)"""
    e = tl.exp2(tl.abs(s) * (-2.0 * 1.4426950408889634 / CAP))  # e^(-2 |s| / CAP)
    t = (1.0 - e) / (1.0 + e) * CAP
    return tl.where(s < 0, -t, t)


@triton.jit
def _attend_tile(
    qt, qpe, m, den, acc, k_cache, v_cache, blk, j, kv_end, qpos, d, dpe, kv_off, s_cb, s_cs, scale_log2,
    k_scale, v_scale, HEAD: tl.constexpr, HEAD_P2: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, MASK: tl.constexpr, K_T: tl.constexpr, PREC: tl.constexpr, WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr, FP8: tl.constexpr, PE: tl.constexpr, PE_P2: tl.constexpr,
):  # fmt: skip
    """Keys [j, j + BLOCK_N) (j a multiple of BLOCK_N, blk their _block_ids) against qt [M, HEAD_P2];
    m is in log2 units (scale_log2 > 0).

    MASK False: every key is below the causal diagonal of every row and < kv_end, so nothing is masked
    and m stays finite; under a WINDOW, every key is also inside every row's window. MASK True: keys past a
    row's position or >= kv_end are masked, and under a WINDOW those at or before its position - WINDOW.
    SOFT_CAP (log2 units): scores are capped first, and are then in log2 units already. FP8: K and V are
    read as stored * k_scale / v_scale, in qt's dtype. PE > 0 (the latent layout): qpe [M, PE_P2] meets
    K's last PE dims, and V is K's first HEAD, read once."""
    pos = j + tl.arange(0, BLOCK_N)
    kmask = pos < kv_end
    off = blk.to(tl.int64) * s_cb + (pos % BLOCK_SIZE) * s_cs + kv_off  # [BLOCK_N] element offset of each key
    if PE > 0:
        vt = _gather_rows(k_cache, off, d, kmask, HEAD, HEAD_P2, MASK, False)  # [BLOCK_N, HEAD_P2]
        kpe = _gather_rows(k_cache, off + HEAD, dpe, kmask, PE, PE_P2, MASK, True)  # [PE_P2, BLOCK_N]
        s = _dot(qt, tl.trans(vt), PREC) + _dot(qpe, kpe, PREC)  # [M, BLOCK_N] raw scores
    else:
        if K_T:  # K^T read straight into [HEAD_P2, BLOCK_N]
            kt = _gather_rows(k_cache, off, d, kmask, HEAD, HEAD_P2, MASK, True)
        else:
            kt = tl.trans(_gather_rows(k_cache, off, d, kmask, HEAD, HEAD_P2, MASK, False))
        vt = _gather_rows(v_cache, off, d, kmask, HEAD, HEAD_P2, MASK, False)  # [BLOCK_N, HEAD_P2]
        kt, vt = _from_cache(kt, k_scale, qt.dtype, FP8), _from_cache(vt, v_scale, qt.dtype, FP8)
        s = _dot(qt, kt, PREC)  # [M, BLOCK_N] raw scores
    if SOFT_CAP > 0:
        s = _soft_cap(s * scale_log2, SOFT_CAP)
        scale_log2 = 1.0
    if MASK:
        ok = kmask[None, :] & (pos[None, :] <= qpos[:, None])
        if WINDOW:
            ok = ok & (pos[None, :] > qpos[:, None] - WINDOW)
        s = tl.where(ok, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet stay at zero weight
        p = tl.exp2(s - m_use[:, None])
    else:
        m_new = tl.maximum(m, tl.max(s, 1) * scale_log2)
        m_use = m_new
        p = tl.exp2(s * scale_log2 - m_new[:, None])  # one FMA and one exp2 per score
    alpha = tl.exp2(m - m_use)
    den = den * alpha + tl.sum(p, 1)
    acc = _mma(p.to(vt.dtype), vt, acc * alpha[:, None], PREC)
    return m_new, den, acc


@triton.jit(do_not_specialize=["num_reqs", "first_tile", "s_bt"])
def _prefill_kernel(
    q, k_cache, v_cache, out, cu, seq_lens, block_table, scale_log2, num_reqs, first_tile, k_scale, v_scale,
    s_qt, s_qh, s_ot, s_oh, s_cb, s_cs, s_ch, s_bt,
    QPK: tl.constexpr, QPK_P2: tl.constexpr, HEAD: tl.constexpr, HEAD_P2: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, K_T: tl.constexpr,
    PREC: tl.constexpr, PDL: tl.constexpr, WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, FP8: tl.constexpr,
    PE: tl.constexpr, PE_P2: tl.constexpr,
):  # fmt: skip
    """Grid (T // BLOCK_Q + B - first_tile, num_kv_heads) over query tiles from first_tile on, the first
    tile of the first request that may run more than one token. Requests with query_len 1 are left to the
    decode kernel.

    Program pid takes query tile first_tile + num_programs - 1 - pid, so the last tiles of a request, which
    see the most keys, start first and the short ones fill the tail. Key tiles strictly below the causal
    diagonal of the tile's first row run unmasked; the one or two tiles that cross it are masked."""
    _pdl_wait(PDL)
    BLOCK_M: tl.constexpr = BLOCK_Q * QPK_P2
    pid = first_tile + tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    b = _find_request(cu, num_reqs, pid, BLOCK_Q)
    q0 = tl.load(cu + b)
    qlen = tl.load(cu + b + 1) - q0
    ctx = tl.load(seq_lens + b) - qlen
    qb = pid - (q0 // BLOCK_Q + b)  # this program's query tile within the request
    r = tl.arange(0, BLOCK_M)
    tok = qb * BLOCK_Q + r // QPK_P2  # [M] query index within the request
    head = kvh * QPK + r % QPK_P2
    d = tl.arange(0, HEAD_P2)
    row_ok = (tok < tl.where(qlen > 1, qlen, 0)) & (r % QPK_P2 < QPK)
    io_mask = row_ok[:, None] & (d[None, :] < HEAD)
    row = (q0 + tok).to(tl.int64)
    qt = tl.load(q + row[:, None] * s_qt + head[:, None] * s_qh + d[None, :], mask=io_mask, other=0.0)
    qpe, dpe = _load_pe(q + row[:, None] * s_qt + head[:, None] * s_qh + HEAD, row_ok, qt, d, PE, PE_P2)
    qpos = ctx + tok
    tile_end = tl.minimum((qb + 1) * BLOCK_Q, qlen)
    kv_end = tl.where((qlen > 1) & (tile_end > qb * BLOCK_Q), ctx + tile_end, 0)
    full_end = tl.minimum((ctx + qb * BLOCK_Q + 1) // BLOCK_N * BLOCK_N, kv_end)  # keys every row sees
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P2], tl.float32)
    bt_row = block_table + b.to(tl.int64) * s_bt
    kv_off = kvh * s_ch
    if WINDOW:  # from the tile of the first row's oldest key, every tile masked
        lo = tl.maximum(ctx + qb * BLOCK_Q - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        for j in range(lo, kv_end, BLOCK_N):
            m, den, acc = _attend_tile(
                qt, qpe, m, den, acc, k_cache, v_cache, _block_ids(bt_row, j, kv_end, BLOCK_N, BLOCK_SIZE), j,
                kv_end, qpos, d, dpe, kv_off, s_cb, s_cs, scale_log2, k_scale, v_scale, HEAD, HEAD_P2,
                BLOCK_N, BLOCK_SIZE, True, K_T, PREC, WINDOW, SOFT_CAP, FP8, PE, PE_P2,
            )  # fmt: skip
    else:
        # The block ids of the next tile are read one iteration ahead, so the K/V loads, whose addresses
        # need them, depend on no load of their own iteration. Triton's pipeliner counts such a load as a
        # level of indirection and splits the stages between the levels (num_stages 3 would prefetch K/V
        # only one tile ahead); this way K/V get all num_stages - 1 tiles of prefetch.
        ids = _block_ids(bt_row, 0, full_end, BLOCK_N, BLOCK_SIZE)
        for j in range(0, full_end, BLOCK_N):
            cur = ids
            ids = _block_ids(bt_row, j + BLOCK_N, full_end, BLOCK_N, BLOCK_SIZE)
            m, den, acc = _attend_tile(
                qt, qpe, m, den, acc, k_cache, v_cache, cur, j, kv_end, qpos, d, dpe, kv_off, s_cb, s_cs,
                scale_log2, k_scale, v_scale, HEAD, HEAD_P2, BLOCK_N, BLOCK_SIZE, False, K_T, PREC, 0,
                SOFT_CAP, FP8, PE, PE_P2,
            )  # fmt: skip
        for j in range(full_end, kv_end, BLOCK_N):  # the tiles that cross the diagonal: masked
            m, den, acc = _attend_tile(
                qt, qpe, m, den, acc, k_cache, v_cache, _block_ids(bt_row, j, kv_end, BLOCK_N, BLOCK_SIZE), j,
                kv_end, qpos, d, dpe, kv_off, s_cb, s_cs, scale_log2, k_scale, v_scale, HEAD, HEAD_P2,
                BLOCK_N, BLOCK_SIZE, True, K_T, PREC, 0, SOFT_CAP, FP8, PE, PE_P2,
            )  # fmt: skip
    acc = acc / tl.where(den == 0.0, 1.0, den)[:, None]
    o_ptr = out + row[:, None] * s_ot + head[:, None] * s_oh + d[None, :]
    tl.store(o_ptr, acc.to(out.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["s_bt"])  # the block table's width changes from step to step
def _decode_kernel(
    q, k, v, k_cache, v_cache, out, part_o, part_lse, counts, slot_mapping, cu, seq_lens, block_table,
    scale_log2, k_scale, v_scale, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ot, s_oh, s_cb, s_cs, s_ch, s_bt,
    QPK: tl.constexpr, ROWS: tl.constexpr, HEAD: tl.constexpr, HEAD_P2: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, PREC: tl.constexpr,
    SPLIT_KEYS: tl.constexpr, MAX_SPLITS: tl.constexpr, PDL: tl.constexpr, WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr, FP8: tl.constexpr, PE: tl.constexpr, PE_P2: tl.constexpr,
):  # fmt: skip
    """Grid (num_kv_heads, B, P): the KV heads of a request launch side by side, so together they read
    each of its keys' rows whole (at the 8B shape, 2-4% less time at batch 512-1024 than requests side by
    side, benchmarks/results/attention/*-decode-grid-*). Only requests with query_len 1. A request's keys
    [0, seq_len) fall into chunks of max(SPLIT_KEYS, seq_len / MAX_SPLITS) keys, split s covering chunk s;
    program p computes splits p, p + P, ... one by one, each as if alone, so P changes which program works,
    never the bits.
    NUM_SPLITS only has to cover the chunks. A request with one chunk is written to out; with more, each
    split goes to part_o/part_lse and the last of the P programs of the (request, KV head) to finish,
    counted in counts (all zero between launches), merges them (_merge_splits). As in prefill
    (_attend_tile), block ids are read a tile ahead; only a split's last, partial tile is masked.

    The program that owns a request's last split first writes the request's new k, v to the cache at its
    slot: no other program reads that key, and store_kv need not run in decode-only steps.

    Under a WINDOW the chunks split the keys from lo, the start of the tile of seq_len - WINDOW, instead
    of 0; split 0 runs its first tile masked."""
    _pdl_wait(PDL)
    b = tl.program_id(1)
    kvh = tl.program_id(0)
    q0 = tl.load(cu + b)
    is_dec = tl.load(cu + b + 1) - q0 == 1
    seq_len = tl.where(is_dec, tl.load(seq_lens + b), 0)
    if WINDOW:
        lo = tl.maximum(seq_len - WINDOW, 0) // BLOCK_N * BLOCK_N
        chunk = _chunk(seq_len - lo, SPLIT_KEYS, MAX_SPLITS, BLOCK_N)
        written = tl.cdiv(seq_len - lo, chunk)
    else:
        chunk = _chunk(seq_len, SPLIT_KEYS, MAX_SPLITS, BLOCK_N)
        written = tl.cdiv(seq_len, chunk)  # splits with keys
    d = tl.arange(0, HEAD_P2)
    slot = tl.load(slot_mapping + q0, mask=is_dec, other=-1)
    if (slot >= 0) & ((written - 1) % tl.num_programs(2) == tl.program_id(2)):
        dst = (slot // BLOCK_SIZE) * s_cb + (slot % BLOCK_SIZE) * s_cs + kvh * s_ch
        kx = _to_cache(tl.load(k + q0 * s_kt + kvh * s_kh + d, mask=d < HEAD), k_scale, k_cache, FP8)
        tl.store(k_cache + dst + d, kx, mask=d < HEAD)
        if PE > 0:  # the latent layout: k's last PE dims too; V is K's first HEAD
            e = tl.arange(0, PE_P2)
            tl.store(k_cache + dst + HEAD + e, tl.load(k + q0 * s_kt + HEAD + e, mask=e < PE), mask=e < PE)
        else:
            vx = _to_cache(tl.load(v + q0 * s_vt + kvh * s_vh + d, mask=d < HEAD), v_scale, v_cache, FP8)
            tl.store(v_cache + dst + d, vx, mask=d < HEAD)
        tl.debug_barrier()  # the key is read back below by other threads of this program
    r = tl.arange(0, ROWS)
    head = kvh * QPK + r
    row_dec = r < tl.where(is_dec, QPK, 0)
    io_mask = row_dec[:, None] & (d[None, :] < HEAD)
    qt = tl.load(q + q0 * s_qt + head[:, None] * s_qh + d[None, :], mask=io_mask, other=0.0)  # [ROWS, HD_P2]
    qpe, dpe = _load_pe(q + q0 * s_qt + head[:, None] * s_qh + HEAD, row_dec, qt, d, PE, PE_P2)
    qpos = tl.full([ROWS], 0, tl.int32) + seq_len - 1
    bt_row = block_table + b.to(tl.int64) * s_bt
    row0 = (b * (QPK * tl.num_programs(0)) + head) * NUM_SPLITS  # [ROWS] into [B, H, NUM_SPLITS]
    o_ptr = out + q0 * s_ot + head[:, None] * s_oh + d[None, :]
    for sp in range(tl.program_id(2), written, tl.num_programs(2)):  # none past seq_len
        start = sp * chunk
        if WINDOW:
            start += lo
        end = tl.minimum(start + chunk, seq_len)
        m = tl.full([ROWS], float("-inf"), tl.float32)
        den = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_P2], tl.float32)
        if WINDOW:  # the tile of the window's first key, masked; the rest of split 0 from the next one
            if sp == 0:
                m, den, acc = _attend_tile(
                    qt, qpe, m, den, acc, k_cache, v_cache,
                    _block_ids(bt_row, start, end, BLOCK_N, BLOCK_SIZE), start, end, qpos, d, dpe, kvh * s_ch,
                    s_cb, s_cs, scale_log2, k_scale, v_scale, HEAD, HEAD_P2, BLOCK_N, BLOCK_SIZE, True, False,
                    PREC, WINDOW, SOFT_CAP, FP8, PE, PE_P2,
                )  # fmt: skip
                start = tl.minimum(start + BLOCK_N, end)
        full = start + (end - start) // BLOCK_N * BLOCK_N  # start is a multiple of BLOCK_N (or end)
        ids = _block_ids(bt_row, start, full, BLOCK_N, BLOCK_SIZE)
        for j in range(start, full, BLOCK_N):
            cur = ids
            ids = _block_ids(bt_row, j + BLOCK_N, full, BLOCK_N, BLOCK_SIZE)
            m, den, acc = _attend_tile(
                qt, qpe, m, den, acc, k_cache, v_cache, cur, j, end, qpos, d, dpe, kvh * s_ch, s_cb, s_cs,
                scale_log2, k_scale, v_scale, HEAD, HEAD_P2, BLOCK_N, BLOCK_SIZE, False, False, PREC, 0,
                SOFT_CAP, FP8, PE, PE_P2,
            )  # fmt: skip
        for j in range(full, end, BLOCK_N):  # at most one
            m, den, acc = _attend_tile(
                qt, qpe, m, den, acc, k_cache, v_cache, _block_ids(bt_row, j, end, BLOCK_N, BLOCK_SIZE), j,
                end, qpos, d, dpe, kvh * s_ch, s_cb, s_cs, scale_log2, k_scale, v_scale, HEAD, HEAD_P2,
                BLOCK_N, BLOCK_SIZE, True, False, PREC, 0, SOFT_CAP, FP8, PE, PE_P2,
            )  # fmt: skip
        acc = acc / tl.where(den == 0.0, 1.0, den)[:, None]
        if (NUM_SPLITS == 1) | (written == 1):  # a lone split: the merge would give these bits
            tl.store(o_ptr, acc.to(out.dtype.element_ty), mask=io_mask)
        else:
            tl.store(part_o + (row0 + sp)[:, None] * HEAD + d[None, :], acc, mask=io_mask)
            lse = tl.where(den == 0.0, float("-inf"), m + tl.log2(tl.where(den == 0.0, 1.0, den)))
            tl.store(part_lse + row0 + sp, lse, mask=row_dec)
    if NUM_SPLITS > 1:
        if written > 1:
            n = tl.num_programs(2)
            done = n - 1
            count = counts + b * tl.num_programs(0) + kvh
            if n > 1:
                tl.debug_barrier()  # every thread's partials are stored before the count says so
                done = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
            if done == n - 1:  # the other n - 1 programs have stored their partials
                if n > 1:
                    tl.store(count, 0)
                _merge_splits(o_ptr, part_o, part_lse, row0, written, row_dec, io_mask, d, HEAD, NUM_SPLITS)


@triton.jit
def _chunk(seq_len, SPLIT_KEYS: tl.constexpr, MAX_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys per decode split of a request: from its seq_len alone, a multiple of BLOCK_N."""
    return tl.maximum(SPLIT_KEYS, tl.cdiv(tl.cdiv(seq_len, MAX_SPLITS), BLOCK_N) * BLOCK_N)


@triton.jit
def _merge_splits(
    o_ptr, part_o, part_lse, row0, written, row_dec, io_mask, d, HEAD: tl.constexpr, NUM_SPLITS: tl.constexpr
):  # fmt: skip
    """o_ptr [ROWS, HEAD_P2] = sum_s 2^(lse_s - LSE) o_s over splits [0, written) of rows row0, summed one
    split after another: a tree sum over a NUM_SPLITS-wide tensor would pair the splits by NUM_SPLITS, and
    graphs and eager steps launch different counts. Summed in order, any NUM_SPLITS that covers the
    written splits gives the same bits. Partials are read from L2 (.cg): other SMs wrote them."""
    sp = tl.arange(0, NUM_SPLITS)
    lse_mask = row_dec[:, None] & (sp[None, :] < written)
    lse = tl.load(
        part_lse + row0[:, None] + sp[None, :], mask=lse_mask, other=float("-inf"), cache_modifier=".cg"
    )
    mx = tl.max(lse, 1)  # exact in any order
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    acc = tl.zeros(io_mask.shape, tl.float32)
    den = tl.zeros(row_dec.shape, tl.float32)  # sum of weights
    for s in range(0, written):
        w = tl.exp2(
            tl.load(part_lse + row0 + s, mask=row_dec, other=float("-inf"), cache_modifier=".cg") - mx
        )
        o = tl.load(
            part_o + (row0 + s)[:, None] * HEAD + d[None, :], mask=io_mask, other=0.0, cache_modifier=".cg"
        )
        acc += w[:, None] * o
        den += w
    res = acc / tl.maximum(den, 1e-30)[:, None]
    tl.store(o_ptr, res.to(o_ptr.dtype.element_ty), mask=io_mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_lora_rank: int | None = None,
) -> None:
    """k, v: [T, num_kv_heads, head_size] -> kv_cache[:, slot] for every slot_mapping[t] >= 0; an FP8 cache
    gets e4m3(k / k_scale) and e4m3(v / v_scale). With kv_lora_rank (the latent layout) k alone ->
    kv_cache[slot]."""
    t, kvh, hs = k.shape
    if t == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    kc, vc = (kv_cache, kv_cache) if kv_lora_rank else (kv_cache[0], kv_cache[1])
    p2 = triton.next_power_of_2
    _store_kv_kernel[(t,)](
        k, v, kc, vc, slot_mapping, k_scale, v_scale, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), kc.shape[1], kvh,
        HEAD=hs, HEAD_P2=_head_p2(hs), KVH_P2=p2(kvh), FP8=_fp8(kv_cache), K_ONLY=bool(kv_lora_rank),
        num_warps=1 if INTERPRET else 4, **pdl_launch(),
    )  # fmt: skip


def _layout(kv_cache: torch.Tensor, head_size: int, kv_lora_rank: int | None) -> tuple:
    """(K pages, V pages, HEAD, the constexprs PE and PE_P2) of a cache of keys of head_size: the default
    layout's kv_cache[0] and [1] with HEAD = head_size and PE = 0; the latent layout's one tensor as both,
    HEAD = kv_lora_rank and PE the rest."""
    if kv_lora_rank:
        pe = head_size - kv_lora_rank
        return kv_cache, kv_cache, kv_lora_rank, dict(PE=pe, PE_P2=_head_p2(pe))
    return kv_cache[0], kv_cache[1], head_size, dict(PE=0, PE_P2=1)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    max_query_len: int,
    num_splits: int,
    counts: torch.Tensor,
    programs: int | None = None,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_lora_rank: int | None = None,
    num_decode_tokens: int = 0,
) -> torch.Tensor:
    """Write k, v to the cache at slot_mapping, then q [T, H, D] against the cache -> [T, H, D]. Rows past
    query_start_loc[-1] (padding) stay unwritten. sliding_window, logits_soft_cap, k_scale and v_scale: the
    layer's (None: none), as turnout.attention.AttentionLayerSpec defines them; the scales apply where the
    cache is float8_e4m3fn. kv_lora_rank: the latent layout (the module docstring): k alone is written, and
    the output is [T, H, kv_lora_rank]. num_decode_tokens: leading requests known to run one token each
    (AttentionMetadata's; 0 where unknown), which the prefill kernel's grid leaves out.

    The decode kernel always runs (its programs skip requests with query_len != 1) and writes the k, v of
    the requests it serves; store_kv and the prefill kernel run only when max_query_len > 1 (the prefill
    kernel's programs skip requests with query_len 1). counts: split_counts(n) with n >= B * num_kv_heads,
    which the decode kernel leaves zero.
    """
    t, h, hs = q.shape
    kc, vc, head, latent = _layout(kv_cache, hs, kv_lora_rank)  # [num_blocks, block_size, kv heads, D] each
    nb, bs, kvh, _ = kc.shape
    out = torch.empty((t, h, head), dtype=q.dtype, device=q.device)
    b = seq_lens.shape[0]
    if t == 0 or b == 0:
        return out
    if max_query_len > 1:
        store_kv(k, v, kv_cache, slot_mapping, k_scale, v_scale, kv_lora_rank)
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    qpk = h // kvh
    prec = _precision(q.dtype)
    p2, hp2 = triton.next_power_of_2, _head_p2(head)
    scale_log2 = scale * LOG2E
    dec = _decode_config(hp2, p2(qpk), q.dtype == torch.float32, latent=bool(kv_lora_rank))
    s = num_splits
    part_o = out if s == 1 else torch.empty((b, h, s, head), dtype=torch.float32, device=q.device)
    part_lse = out if s == 1 else torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    if counts.numel() < b * kvh:
        raise ValueError(f"counts holds {counts.numel()} entries, the decode kernel needs {b * kvh}")
    p = programs or decode_programs(b, kvh, s)
    _decode_kernel[(kvh, b, p)](
        q, k, v, kc, vc, out, part_o, part_lse, counts, slot_mapping, query_start_loc, seq_lens, block_table,
        scale_log2, k_scale, v_scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), out.stride(0), out.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
        block_table.stride(0),
        QPK=qpk, ROWS=dec["rows"], HEAD=head, HEAD_P2=hp2, BLOCK_N=dec["block_n"], BLOCK_SIZE=bs,
        NUM_SPLITS=s, PREC=prec, SPLIT_KEYS=SPLIT_KEYS, MAX_SPLITS=MAX_SPLITS, FP8=_fp8(kv_cache),
        num_warps=dec["warps"], num_stages=dec["stages"], **_maxnreg(dec),
        **_features(sliding_window, logits_soft_cap), **latent, **pdl_launch(),
    )  # fmt: skip
    if max_query_len > 1:
        _launch_prefill(q, kv_cache, out, query_start_loc, seq_lens, block_table, scale, None,
                        sliding_window, logits_soft_cap, k_scale, v_scale, kv_lora_rank,
                        num_decode_tokens)  # fmt: skip
    return out


def _fp8(kv_cache: torch.Tensor) -> bool:
    """The kernels' FP8 flag: the cache holds float8_e4m3fn (kv_cache_dtype fp8)."""
    return kv_cache.dtype == torch.float8_e4m3fn


def _features(sliding_window: int | None, logits_soft_cap: float | None) -> dict:
    """The kernels' constexpr flags for a layer's features: 0 where it has none."""
    return dict(WINDOW=sliding_window or 0, SOFT_CAP=(logits_soft_cap or 0.0) * LOG2E)


def split_counts(n: int, device: torch.device) -> torch.Tensor:
    """The decode kernel's per-(request, KV head) counters of finished programs: zeros, which every launch
    leaves zero, so one buffer serves every layer and step (and a CUDA graph keeps its address)."""
    return torch.zeros(n, dtype=torch.int32, device=device)


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    config: dict | None = None,
    out: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_lora_rank: int | None = None,
) -> torch.Tensor:
    """The prefill kernel alone (for tuning): rows of requests with query_len > 1 of q [T, H, D] (-> [T, H,
    kv_lora_rank] in the latent layout). config (block_m, block_n, warps, stages, trans_k) overrides
    _prefill_config; rows it skips stay unwritten."""
    if out is None:
        out = q.new_empty(*q.shape[:2], kv_lora_rank or q.shape[2])
    if q.shape[0] and seq_lens.shape[0]:
        _launch_prefill(_last_dim_contiguous(q), kv_cache, out, query_start_loc, seq_lens, block_table, scale,
                        config, sliding_window, logits_soft_cap, k_scale, v_scale, kv_lora_rank)  # fmt: skip
    return out


def _launch_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    config: dict | None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_lora_rank: int | None = None,
    num_decode_tokens: int = 0,
) -> object:
    """Launch the prefill kernel over the requests after the first num_decode_tokens, which run one token
    each; returns what the launch returns (the compiled kernel, on a GPU; None when no tile is left)."""
    t, h, hs = q.shape
    kc, vc, head, latent = _layout(kv_cache, hs, kv_lora_rank)
    _, bs, kvh, _ = kc.shape
    b = seq_lens.shape[0]
    qpk, hp2 = h // kvh, _head_p2(head)
    qpk_p2 = triton.next_power_of_2(qpk)
    prec = _precision(q.dtype)
    fp32 = q.dtype == torch.float32
    cfg = _fit_config(config or _prefill_config(hp2, qpk_p2, fp32, bool(kv_lora_rank)), qpk_p2)
    bq = cfg["block_m"] // qpk_p2
    nd = num_decode_tokens
    first_tile = nd // bq + nd  # request nd's first tile: cu[nd] == nd
    if t // bq + b <= first_tile:
        return None
    return _prefill_kernel[(t // bq + b - first_tile, kvh)](
        q, kc, vc, out, query_start_loc, seq_lens, block_table, scale * LOG2E, b, first_tile, k_scale,
        v_scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1), kc.stride(0), kc.stride(1),
        kc.stride(2), block_table.stride(0), QPK=qpk, QPK_P2=qpk_p2, HEAD=head, HEAD_P2=hp2, BLOCK_Q=bq,
        BLOCK_N=cfg["block_n"], BLOCK_SIZE=bs, K_T=cfg["trans_k"], PREC=prec, FP8=_fp8(kv_cache),
        num_warps=cfg["warps"], num_stages=cfg["stages"], **_features(sliding_window, logits_soft_cap),
        **latent, **pdl_launch(),
    )  # fmt: skip


def num_splits(max_seq_len: int) -> int:
    """Decode splits to launch, a power of two <= MAX_SPLITS that covers every request's chunks (see
    _decode_kernel). The output does not depend on it, only the number of idle programs does; a CUDA graph
    is captured with max_seq_len = max_model_len, so it covers any later batch."""
    return min(triton.next_power_of_2(max(1, math.ceil(max_seq_len / SPLIT_KEYS))), MAX_SPLITS)


def decode_programs(num_reqs: int, num_kv_heads: int, num_splits: int) -> int:
    """Programs per (request, KV head) for the decode kernel, up to num_splits: enough for about
    DECODE_PROGRAMS in all. A graph captured for max_model_len covers MAX_SPLITS splits; at batch 256 one
    program walks them all, instead of 16 programs of which 15 find no keys (2.7 ms of a 4.7 ms step on the
    H200). Any count gives the same bits."""
    want = -(-DECODE_PROGRAMS // (num_reqs * num_kv_heads))
    return min(num_splits, triton.next_power_of_2(max(1, want)))


# Tile choices, tuned on an H200 (bf16, head 128; see benchmarks/bench_attention.py): decode 32-key tiles
# on 2 warps with 4 stages were the fastest of 8 tile sets at batch 64 and 256, context 512-2048 (16 query
# / 8 KV heads), ~3.7 TB/s at 256 x 512; with 4 or more query heads a KV head (32 / 8, benchmarks/results/
# tune-triton/), the same tiles on 4 warps were 23% faster than on 2. Capped at 128 registers a
# thread (ncu: 150 uncapped, three programs an SM), four programs fit an SM, and at 32 / 8 heads batch 256
# at 1024 and 2048 keys took 6-7% less time (84.5 -> 90.2% and 87.6 -> 94.0% of 4.3 TB/s); 16 / 8 heads
# gained nothing (benchmarks/results/attention/*-decode-maxnreg-*). Prefill 128 x 128 tiles on 8 warps
# reached 360 TFLOP/s at 16k before the mask-free hot loop (benchmarks/results/tune-triton/).
# The latent layout's tiles (latent=True: HEAD 512 + PE 64) are not measured on a GPU: they are those for
# which ptxas (sm_90a, Triton 3.9) reports no spills at 16 and 8 query heads; 32-key decode tiles on 4 warps
# spilled 744 bytes a thread, 64 x 32 prefill tiles on 4 warps 6 KB.
def _decode_config(
    head_p2: int, qpk_p2: int, fp32: bool, sm90: bool | None = None, latent: bool = False
) -> dict:
    """The decode tiles for this device (sm90: Hopper or newer; None: the current GPU's)."""
    if _DECODE_OVERRIDE:
        return _parse_decode_config(_DECODE_OVERRIDE, qpk_p2)
    if INTERPRET:
        return dict(rows=qpk_p2, block_n=32, warps=1, stages=1, maxnreg=0)
    rows = max(16, qpk_p2)  # tl.dot needs M >= 16
    if latent:
        return dict(rows=rows, block_n=16, warps=8, stages=2, maxnreg=0)
    if head_p2 <= 128 and not fp32:
        if qpk_p2 <= 2:
            return dict(rows=rows, block_n=32, warps=2, stages=4, maxnreg=0)
        sm90 = _sm90_or_newer() if sm90 is None else sm90
        return dict(rows=rows, block_n=32, warps=4, stages=4, maxnreg=128 if sm90 else 0)
    return dict(rows=rows, block_n=32, warps=4, stages=2, maxnreg=0)


# Prefill tiles can be overridden without editing this file, for a tile sweep:
# TURNOUT_TRITON_PREFILL="block_m,block_n,warps,stages[,trans_k]" in the environment, read at each call,
# applies to every shape and dtype; block_m is raised to the query heads per KV head if below.
PREFILL_KEYS = ("block_m", "block_n", "warps", "stages", "trans_k")


def _prefill_config(head_p2: int, qpk_p2: int, fp32: bool, latent: bool = False) -> dict:
    if _PREFILL_OVERRIDE:
        return _parse_config(_PREFILL_OVERRIDE)
    if INTERPRET:
        return dict(block_m=max(64, qpk_p2), block_n=32, warps=1, stages=1)  # few, large programs
    if latent:
        return dict(block_m=max(32, qpk_p2), block_n=32, warps=8, stages=1)
    if head_p2 <= 128 and not fp32:
        # 3 stages need ~224 KB of shared memory: Hopper has 228 KB (a tile sweep on an H200: 463 TFLOP/s
        # at 16k against 415 with 2 stages); Ampere has 164 KB
        return dict(block_m=max(128, qpk_p2), block_n=128, warps=8, stages=3 if _sm90_or_newer() else 2)
    return dict(block_m=max(64, qpk_p2), block_n=32, warps=4, stages=2)


@functools.cache
def _sm90_or_newer() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@functools.cache
def _parse_config(text: str) -> dict:
    try:
        vals = [int(x) for x in text.split(",")]
    except ValueError:
        vals = []
    if not 4 <= len(vals) <= 5:
        raise ValueError(f"TURNOUT_TRITON_PREFILL={text!r}: want block_m,block_n,warps,stages[,trans_k]")
    return dict(zip(PREFILL_KEYS, vals))


def _parse_decode_config(text: str, qpk_p2: int) -> dict:
    try:
        block_n, warps, stages, *more = (int(x) for x in text.split(","))
        (maxnreg,) = more or [0]
    except ValueError:
        raise ValueError(f"TURNOUT_TRITON_DECODE={text!r}: want block_n,warps,stages[,maxnreg]") from None
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"TURNOUT_TRITON_DECODE={text!r}: block_n must be a power of two >= 16")
    if SPLIT_KEYS % block_n:
        raise ValueError(f"TURNOUT_TRITON_DECODE={text!r}: block_n must divide the split's {SPLIT_KEYS} keys")
    return dict(rows=max(16, qpk_p2), block_n=block_n, warps=warps, stages=stages, maxnreg=maxnreg)


def _maxnreg(cfg: dict) -> dict:
    """The launch's register cap a thread (ptxas .maxnreg), where the config sets one (0: the compiler's)."""
    return {"maxnreg": cfg["maxnreg"]} if cfg["maxnreg"] else {}


def _fit_config(cfg: dict, qpk_p2: int) -> dict:
    """cfg with defaults filled in, checked: tile sides powers of two >= 16 (tl.dot), block_m >= qpk_p2."""
    out = dict(warps=4, stages=2, trans_k=False) | cfg
    out["block_m"] = max(out["block_m"], qpk_p2)
    out["trans_k"] = bool(out["trans_k"])
    for key in ("block_m", "block_n"):
        if out[key] < 16 or out[key] & (out[key] - 1):
            raise ValueError(f"prefill {key}={out[key]}: must be a power of two >= 16")
    return out


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: exact for float32; tf32 is moot for 16-bit inputs (interpreter: upcast)."""
    return "ieee" if dtype == torch.float32 else "upcast" if INTERPRET else "tf32"


def _head_p2(head_size: int) -> int:
    return max(16, triton.next_power_of_2(head_size))  # tl.dot needs K >= 16


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
