"""The named tiers of a candidate's priority, one order for every plugin kind."""

import enum


class Priority(enum.IntEnum):
    """Named tiers for a candidate's `priority`. Under "auto" the valid candidate with the highest priority
    wins, ties by candidate name, then by plugin name; a candidate named in the config wins if it is valid.
    Any int works; these tiers are the reference points the bundled plugins use.

    The order "auto" follows on each platform, set by the tiers below; `turnout plugins --order` prints it
    for the installed plugins, computed by the one rule selection ranks by (`turnout.selection.ranked`):

    - attention, CUDA (sm80+): triton FIRST > flashinfer SECOND > flash_attn THIRD, the order of their output
      tok/s on nano-vllm's bench on an H200 (benchmarks/results/throughput/, docs/performance.md)
    - attention for mixed and prefill steps (`mixed_priority`), CUDA: flash_attn on its FA4 path (sm90+)
      FIRST > triton SECOND > flashinfer THIRD (flash_attn on FA2: THIRD), the order of their causal
      prefill TFLOP/s at 4k and 16k tokens on an H200 (benchmarks/results/attention/); so where FA4 is
      installed "auto" runs triton+flash_attn (attention.per_phase), which the triton decode kernel wins
    - attention, CPU: cpu DEFAULT > triton under TRITON_INTERPRET=1 TESTING (a test aid, never preferred)
    - executors, any platform: uniproc FIRST > ray SECOND > multiproc THIRD; their checks leave one valid
      in most cases (uniproc for one rank, multiproc for ranks on this node, ray beyond it or at RAY_ADDRESS)
    - models and graph policies: DEFAULT. A third-party architecture above DEFAULT replaces a bundled one.
    - quantization methods: DEFAULT; the checkpoint's quantization_config (or `quantization`) names the
      format, so at most one bundled method is valid for a checkpoint
    - MoE kernels (the core's list, layers/moe.py, no hook): triton FIRST on CUDA > torch DEFAULT; triton
      under TRITON_INTERPRET=1 off CUDA TESTING
    """

    FIRST = 30
    SECOND = 20
    THIRD = 10
    DEFAULT = 0
    TESTING = -1
