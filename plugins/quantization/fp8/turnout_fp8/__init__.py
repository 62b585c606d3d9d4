"""FP8 (e4m3) weights: HF's fine-grained FP8 checkpoints (`quant_method: "fp8"`, 128x128 block scales, or
per-tensor scales without `weight_block_size`), compressed-tensors FP8 (per-tensor or per-channel weight
scales, static or dynamic activation scales) and online quantization of an unquantized checkpoint
(`quantization = "fp8"`: per-channel weight scales, dynamic per-token activation scales).

On CUDA (sm89+) the weights stay in FP8: one-row decode steps run a Triton GEMV that reads the FP8
weights and keeps the activations in the compute dtype; larger batches quantize the activations and run a
Triton FP8 GEMM or cuBLASLt's (torch._scaled_mm), by rows and scale layout (kernels.ROUTES). On the CPU
every format is dequantized to the compute dtype at load.

Fused MoE experts (Qwen3-MoE's `mlp.experts.<e>.{gate,up,down}_proj`) stored in FP8 load in every format
above, their scales sharded over tensor-parallel ranks as the experts' weights are (w13 by rows, w2 by
columns) and held whole with their experts under expert parallelism. On CUDA they stay in FP8 and the
core's Triton grouped GEMM (turnout.layers.expert_outputs_triton) dequantizes each weight tile in the
kernel, activations in the compute dtype; on the CPU, and for block sizes that kernel cannot tile, they
are dequantized to the compute dtype at load and run in it. `turnout explain` says which. Online
quantization leaves the experts unquantized.

A compressed-tensors checkpoint with a kv_cache_scheme (static, per-tensor FP8) holds a k_scale and a
v_scale for every attention layer; the FP8 KV cache uses them (kv_cache_scales), and with kv_cache_dtype
auto the cache runs in FP8, as in vLLM. Without config_groups only the KV cache is quantized."""

from turnout import hookimpl
from turnout_fp8.method import Fp8Method


@hookimpl
def turnout_quantization_methods(platform) -> list:
    return [Fp8Method()]
