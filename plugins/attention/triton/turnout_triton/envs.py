"""The Triton plugin's switches, declared to the core through turnout_env_vars."""

from turnout import EnvVar

PREFILL = EnvVar("TURNOUT_TRITON_PREFILL", str, "", "prefill tiles: block_m,block_n,warps,stages[,trans_k]")
DECODE = EnvVar("TURNOUT_TRITON_DECODE", str, "", "decode tiles: block_n,warps,stages[,maxnreg]")


def split_keys(text: str) -> int:
    """A positive multiple of 32, the decode tiles' default block_n."""
    n = int(text)
    if n < 32 or n % 32:
        raise ValueError("want a positive multiple of 32")
    return n


SPLIT_KEYS = EnvVar("TURNOUT_TRITON_SPLIT_KEYS", split_keys, 512, "fewest keys of a decode split: 32, 64...")
ENV_VARS = [PREFILL, DECODE, SPLIT_KEYS]
