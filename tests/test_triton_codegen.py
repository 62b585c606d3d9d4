"""The Triton attention kernels' code generation, checked on a machine without a GPU: Triton's interpreter
runs their arithmetic on the CPU (test_attention_conformance.py) but never compiles them, so a construct
only the compiler rejects would first fail on a GPU. Here each variant is compiled for sm_90 (to PTX and,
with the ptxas Triton ships, a cubin) in a fresh process, where triton is imported without the
interpreter."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

PRELUDE = """
import re
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from turnout_triton import kernels

LOG2E = kernels.LOG2E
INTS = {"counts", "cu", "seq_lens", "block_table"}
FLOATS = {"scale_log2", "k_scale", "v_scale"}
SCALARS = {"num_reqs", "first_tile", "block_size", "num_kv_heads"}  # i32, as are the strides (s_*)


def compile_(fn, consts, fp8, **opts):
    sig = {}
    for n in fn.arg_names:
        sig[n] = "constexpr" if n in consts else "*i32" if n in INTS else "*i64" if n == "slot_mapping" \\
            else "*fp32" if n in ("part_o", "part_lse") else "fp32" if n in FLOATS \\
            else "i32" if n.startswith("s_") or n in SCALARS \\
            else "*fp8e4nv" if fp8 and n in ("k_cache", "v_cache") else "*bf16"
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm  # ptx, cubin, ...


def decode_tiles(head, qpk, mla=False):  # the tiles and launch options an H200 gets, the register cap too
    cfg = kernels._decode_config(head, qpk, False, sm90=True, latent=mla)
    tiles = dict(QPK=qpk, ROWS=cfg["rows"], BLOCK_N=cfg["block_n"], NUM_SPLITS=4, SPLIT_KEYS=512,
                 MAX_SPLITS=16)
    return tiles, dict(num_warps=cfg["warps"], num_stages=cfg["stages"], **kernels._maxnreg(cfg))
"""

SCRIPT = (
    PRELUDE
    + """

for window, cap, cache in (v.split(":") for v in sys.argv[1:]):
    window, cap, fp8, mla = int(window), float(cap) * LOG2E, cache == "fp8", cache == "mla"
    # the latent layout at DeepSeek-V2-Lite's 512 + 64, 16 and 8 query heads (TP 1 and 2) on its one KV head
    head, pe, qpks = (512, 64, (16, 8)) if mla else (128, 0, (2, 4))
    feats = dict(WINDOW=window, SOFT_CAP=cap, PDL=True, PREC="tf32", HEAD=head, HEAD_P2=head, BLOCK_SIZE=16,
                 FP8=fp8, PE=pe, PE_P2=pe or 1)
    for qpk in qpks:  # the tiles an H200 gets at 16 / 8 and 32 / 8 heads
        tiles, opts = decode_tiles(head, qpk, mla)
        compile_(kernels._decode_kernel, dict(**tiles, **feats), fp8, **opts)
    if mla:
        cfg = kernels._fit_config(kernels._prefill_config(head, 16, False, latent=True), 16)
        compile_(kernels._prefill_kernel, dict(QPK=16, QPK_P2=16, BLOCK_Q=cfg["block_m"] // 16,
                 BLOCK_N=cfg["block_n"], K_T=False, **feats), fp8, num_warps=cfg["warps"],
                 num_stages=cfg["stages"])
    else:
        compile_(kernels._prefill_kernel, dict(QPK=2, QPK_P2=2, BLOCK_Q=64, BLOCK_N=128, K_T=False, **feats),
                 fp8, num_warps=8, num_stages=3)
    store = dict(HEAD=head + pe, HEAD_P2=1024 if mla else 128, KVH_P2=1 if mla else 8, PDL=True, FP8=fp8,
                 K_ONLY=mla)
    compile_(kernels._store_kv_kernel, store, fp8, num_warps=4)
print("compiled")
"""
)

# the float32 division opcodes in the PTX of the store kernel over an FP8 cache, and of the decode kernel
# (which writes decode steps' keys itself) over an FP8 and a bf16 cache; then the store's float negations
FP8_WRITES = (
    PRELUDE
    + """
def ptx(fn, fp8, consts, **opts):
    return compile_(fn, dict(HEAD=128, HEAD_P2=128, PDL=True, FP8=fp8, **consts), fp8, **opts)["ptx"]


def ops(code, pattern):
    print(" ".join(sorted(set(re.findall(pattern, code)))))


DIV = r"div\\.[a-z.]*f32"
store = ptx(kernels._store_kv_kernel, True, dict(KVH_P2=8, K_ONLY=False), num_warps=4)
ops(store, DIV)
tiles, opts = decode_tiles(128, 4)
tiles.update(WINDOW=0, SOFT_CAP=0.0, PREC="tf32", BLOCK_SIZE=16, PE=0, PE_P2=1)
for fp8 in (True, False):
    ops(ptx(kernels._decode_kernel, fp8, tiles, **opts), DIV)
zero = "|".join(["0f00000000", *re.findall(r"mov\\.[bf]32\\s+(%\\w+), 0f00000000;", store)])
ops(store, rf"neg\\.[a-z.]*f32|sub\\.[a-z.]*f32\\s+%\\w+, (?:{zero}),")  # -x, or 0 - x (Triton 3.6's -x)
"""
)


def _compile(script: str, *args: str) -> subprocess.CompletedProcess:
    """script in a fresh process with triton's NVIDIA backend (skips where there is none)."""
    if importlib.util.find_spec("triton") is None or not importlib.util.find_spec("triton.backends.nvidia"):
        pytest.skip("needs triton with its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, without its warning
    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip


@pytest.mark.slow
def test_the_per_layer_feature_variants_compile_for_sm90() -> None:
    """A sliding window, a soft-cap, and both (window:cap:cache; 0 is none), on the bf16 paths' H200 tiles,
    over a bf16 cache and an FP8 one (kv_cache_dtype fp8); and the MLA latent layout at DeepSeek-V2-Lite's
    shape. (triton is not imported here: this process may need it under the interpreter.)"""
    res = _compile(SCRIPT, "7:0:bf16", "0:50:bf16", "4096:50:bf16", "0:0:fp8", "7:50:fp8", "0:0:mla")
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]


@pytest.mark.slow
def test_fp8_cache_writes_divide_correctly_rounded_and_negate_no_float():
    """x / k_scale before the e4m3 rounding is IEEE division (div.rn.f32), as torch's: Triton's `/` compiles
    to div.full.f32 (up to 2 ulp off), which moves ties to the other e4m3 neighbour of torch's value. And a
    subnormal's sign is x's sign bit, put on by OR: no float negation, which Triton 3.6 compiles to 0 - mag
    and so stores -0 as +0 (0x00, where torch's cast gives 0x80). The interpreter divides exactly and
    negates as numpy does, so only the compiled code shows either."""
    res = _compile(FP8_WRITES)
    assert res.returncode == 0, res.stderr[-3000:]
    store, decode_fp8, decode_bf16, negations = res.stdout.split("\n")[:4]
    assert store == "div.rn.f32", res.stdout
    assert "div.rn.f32" in decode_fp8.split() and "div.rn.f32" not in decode_bf16.split(), res.stdout
    assert negations == "", res.stdout
