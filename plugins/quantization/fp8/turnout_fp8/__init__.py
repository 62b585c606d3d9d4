"""FP8 (e4m3) weights: HF's fine-grained FP8 checkpoints (`quant_method: "fp8"`, 128x128 block scales, or
per-tensor scales without `weight_block_size`), compressed-tensors FP8 (per-tensor or per-channel weight
scales, static or dynamic activation scales) and online quantization of an unquantized checkpoint
(`quantization = "fp8"`: per-channel weight scales, dynamic per-token activation scales).

On CUDA (sm89+) the weights stay in FP8: prefill and large batches run an FP8 GEMM (cuBLASLt through
torch._scaled_mm for per-channel scales, a Triton kernel for block scales), decode batches of at most
kernels.GEMV_MAX_M rows a Triton GEMV that reads the FP8 weights and keeps the activations in the compute
dtype. On the CPU every format is dequantized to the compute dtype at load."""

from turnout import hookimpl
from turnout_fp8.method import Fp8Method


@hookimpl
def turnout_quantization_methods(platform) -> list:
    return [Fp8Method()]
