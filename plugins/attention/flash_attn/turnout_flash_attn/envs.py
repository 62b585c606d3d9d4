"""The FlashAttention plugin's switches, declared to the core through turnout_env_vars."""

from turnout import EnvVar

FLASH_ATTN = EnvVar("TURNOUT_FLASH_ATTN", str.strip, "", "2 or 4: allow only FlashAttention-2 or only -4")
CUDAGRAPH = EnvVar("TURNOUT_FLASH_ATTN_CUDAGRAPH", str, "", "a CUDA-graph support level replacing the path's")
ENV_VARS = [FLASH_ATTN, CUDAGRAPH]
