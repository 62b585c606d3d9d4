"""The Triton plugin's switches, declared to the core through turnout_env_vars."""

from turnout import EnvVar

PREFILL = EnvVar("TURNOUT_TRITON_PREFILL", str, "", "prefill tiles: block_m,block_n,warps,stages[,trans_k]")
DECODE = EnvVar("TURNOUT_TRITON_DECODE", str, "", "decode tiles: block_n,warps,stages")
ENV_VARS = [PREFILL, DECODE]
