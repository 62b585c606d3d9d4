"""The FlashInfer plugin's switches, declared to the core through turnout_env_vars."""

from turnout import EnvVar

CUDAGRAPH = EnvVar("TURNOUT_FLASHINFER_CUDAGRAPH", str, "", "a CUDA-graph support level for FlashInfer")
PREFILL_BACKEND = EnvVar(
    "TURNOUT_FLASHINFER_PREFILL_BACKEND", str, "fa2", "prefill kernels: fa2, fa3 or auto"
)
ENV_VARS = [CUDAGRAPH, PREFILL_BACKEND]
