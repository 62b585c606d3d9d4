"""Every benchmark suite: a name, what it measures, and the commands that measure it.
`benchmarks/run.py SUITE` runs them; each writes its records under benchmarks/results/<suite>/. RETIRED
names the folders of suites no longer run, whose records stand.

In a command, {out} is the suite's results folder, {stamp} the run's UTC date and time, and {tmp} a scratch
folder for the run; `turnout`, `python` and `pytest` run in this interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

QWEN3 = "--random-model qwen3-0.6b"
# Set for every command: NVLink multicast (NVLS) off in NCCL, torch and NVSHMEM. A program that uses it can
# take a shared host's GPUs out of service.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class Suite:
    """A suite: what it measures, its commands, the GPUs they need and the environment they run in."""

    about: str
    commands: list[str]
    gpus: int = 1  # 0: runs anywhere
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: int = 1800  # per command


SUITES = {
    "throughput": Suite(
        "The 256 requests of nano-vllm's bench (prompts and outputs of 100-1024 tokens, temperature 0.6) "
        "on the Qwen3-0.6B shape: turnout against nano-vllm on the full workload and HF transformers on 64 "
        "of its requests, then turnout with Triton alone; then both Qwen3 shapes, and the Mistral-7B and "
        "Gemma-3-12B shapes, beside vLLM",
        [f"turnout bench throughput {QWEN3} --peers nano-vllm,hf-generate-batch,hf-generate --out {{out}}",
         f"turnout bench throughput {QWEN3} --attention-backend triton --out {{out}}",
         f"turnout bench throughput {QWEN3} --peers vllm --out {{out}}",
         "turnout bench throughput --random-model qwen3-8b --peers vllm --out {out}",
         "turnout bench throughput --random-model mistral-7b --peers vllm --out {out}",
         "turnout bench throughput --random-model gemma-3-12b --peers vllm --out {out}"]),
    "wide": Suite(
        "Wide decode: 1,024 requests of 16-64 prompt tokens, each decoding 256-512 (temperature 0.6, EOS "
        "ignored), the first run and a repeat, beside vLLM and nano-vllm on the Qwen3-0.6B shape and beside "
        "vLLM on the Qwen3-8B shape",
        [f"turnout bench wide {QWEN3} --peers vllm,nano-vllm --out {{out}}",
         "turnout bench wide --random-model qwen3-8b --peers vllm --out {out}"]),
    "latency": Suite(
        "Batch-1 decode time per token (TPOT) and time to first token (TTFT) at 512- and 4096-token prompts, "
        "Qwen3-0.6B shape, against nano-vllm and HF generate; then TTFT up to 32,768 tokens at the Qwen3-8B "
        "shape beside vLLM",
        [f"turnout bench latency {QWEN3} --peers nano-vllm,hf-generate --out {{out}}",
         f"turnout bench latency {QWEN3} --attention-backend triton --out {{out}}",
         "turnout bench latency --random-model qwen3-8b --peers vllm --ttft-lens 4096,16384,32768 "
         "--out {out}"]),
    "prefix": Suite(
        "256 requests that share a 2,000-token prefix, prefix caching on against off, Qwen3-0.6B shape",
        [f"turnout bench prefix {QWEN3} --out {{out}}"]),
    "structured": Suite(
        "nano-vllm's 256 requests with a JSON schema on every one and on a quarter of them, each against the "
        "same prompts unconstrained to the same output lengths, prefix caching off, Qwen3-0.6B shape; "
        "cost is 1 - constrained over unconstrained output tok/s",
        [f"turnout bench structured {QWEN3} --out {{out}}"]),
    "serve": Suite(
        "nano-vllm's bench workload through `turnout serve` with the openai async client at full concurrency "
        "(streamed and not) against offline LLM.generate in the same run; then request rates 8, 32 and inf "
        "with TTFT, TPOT and ITL at p50 and p99, Qwen3-0.6B shape",
        ["turnout bench serve --random-model qwen3-0.6b --workload nanovllm --max-model-len 4096 "
         "--vs-offline --output {out}/{stamp}-vs-offline.json",
         "turnout bench serve --random-model qwen3-0.6b --workload nanovllm --max-model-len 4096 "
         "--request-rate 8 32 inf --output {out}/{stamp}-rates.json"]),
    "llama-3-8b": Suite(
        "The requests of nano-vllm's bench on the Llama-3-8B shape beside vLLM, then against HF "
        "generate_batch on 64 of them",
        ["turnout bench throughput --random-model llama-3-8b --peers vllm --out {out}",
         "turnout bench throughput --random-model llama-3-8b --peers hf-generate-batch --out {out}"]),
    "cpu-smoke": Suite(
        "Four of nano-vllm's requests, shortened, on the embedded model: the bench end to end on any machine",
        ["turnout bench throughput --num-prompts 4 --max-input-len 64 --max-output-len 16 --out {out}"],
        gpus=0),
    "attention": Suite(
        "Attention kernels alone (bf16, 32 query / 8 KV heads of 128, block 16): decode at batch 1-256 and "
        "context 512-4096 against the memory ceiling, prefill of 4k and 16k tokens against the matmul "
        "ceiling",
        ["python benchmarks/bench_attention.py --backends triton,flashinfer,flash_attn "
         "--json {out}/{stamp}-triton-flashinfer-fa4.json"]),
    "fp8": Suite(
        "nano-vllm's bench at the Qwen3-8B shape in both FP8 formats beside vLLM's FP8 path and turnout "
        "bf16, and wide decode with FP8 weights and KV cache beside both; the folder also holds the sweeps "
        "of turnout-fp8's matmul routes against bf16 cuBLAS by rows M that chose its routes and tiles "
        "(bench_fp8.py, no longer run: each file names its command and commit)",
        ["turnout bench throughput --random-model qwen3-8b-fp8-dynamic --peers vllm,turnout-bf16 --out {out}",
         "turnout bench throughput --random-model qwen3-8b-fp8 --peers vllm,turnout-bf16 --out {out}",
         "turnout bench wide --random-model qwen3-8b-fp8-dynamic --kv-cache-dtype fp8 "
         "--peers vllm,turnout-bf16 --out {out}"]),
    "cpu-latency": Suite(
        "Time to first token on the CPU, the embedded SmolLM2-135M at 512, 2,048 and 4,096 prompt tokens: "
        "`turnout bench latency` (its first run and a repeat, each on fresh prompts); the records with HF "
        "columns put turnout's generate with one output token on a fresh prompt against HF transformers' one "
        "forward in bf16 and fp32, alternating, the first run apart and the median of 3 more",
        ["turnout bench latency --ttft-lens 512,2048,4096 --out {out}/{stamp}-smollm2-bench-latency.json"],
        gpus=0),
    "tune": Suite(
        "`turnout tune` on nano-vllm's bench shapes: every valid candidate (attention per phase, graph mode, "
        "token budget, block size, async) on a short fixed workload, each twice and interleaved; the "
        "record's figures and the winner past a 3% margin and the noise",
        [f"turnout tune --random-model {shape} --workload {w} --budget 120"
         for shape in ("qwen3-0.6b", "qwen3-8b")
         for w in ("throughput", "latency")]),
    "profile-step": Suite(
        "Engine steps kernel bucket by bucket (torch profiler) on the Qwen3-8B shape, default selection: "
        "batch-1 and batch-256 decode at 512 tokens of context, 256 decode rows beside a short prefill, "
        "one 16,384-token prefill; wall, GPU busy and idle per step, the floors",
        ["python benchmarks/profile_step.py --random-model qwen3-8b --phases decode1,decode256,mixed256,"
         "prefill --out {out}"]),
    "conformance": Suite(
        "The attention conformance suite on every installed backend (relative error against float64), the "
        "fused-kernel tests and the GPU end-to-end tests",
        [*(f"pytest -q -p no:cacheprovider tests/test_attention_conformance.py -k {k} "
           f"--junitxml {{tmp}}/conf-{k}.xml" for k in ("triton", "flashinfer", "flash_attn")),
         "pytest -q -p no:cacheprovider tests/test_fused.py tests/test_gpu.py --junitxml {tmp}/gpu.xml",
         "python benchmarks/summarize_conformance.py --errors {tmp}/errors.tsv --junit "
         "{tmp}/conf-triton.xml {tmp}/conf-flashinfer.xml {tmp}/conf-flash_attn.xml "
         "--json {out}/{stamp}-all-backends.json"],
        env={"TURNOUT_CONFORMANCE_ERRORS": "{tmp}/errors.tsv"}),
    "async-scheduling": Suite(
        "Async scheduling (step N+1 scheduled while step N runs on the GPU), off against on: its CUDA tests "
        "(the same tokens as sync with graphs, no host sync in a steady decode step) and nano-vllm's bench, "
        "on the Qwen3-0.6B shape; the tables hold the GPU's idle share between decode steps at batch 256",
        ["pytest -q -p no:cacheprovider tests/test_async_scheduling.py -rf",
         *(f"turnout bench throughput {QWEN3} --{flag} --out {{out}}/{{stamp}}-throughput-{name}.json"
           for flag, name in (("no-async-scheduling", "off"), ("async-scheduling", "on")))]),
    "host-step": Suite(
        "Where each step's wall time goes, by stage and requests running, over the wide-decode workload: a "
        "random shape on the GPU (the wait for its tokens against host work), or a tiny model on the CPU",
        ["python benchmarks/profile_host.py --num-prompts 256 --min-output-len 32 --max-output-len 64 "
         "--json {out}/{stamp}-wide-256.json"],
        gpus=0),
}  # fmt: skip
# Suites no longer run: their scripts answered their question and were deleted. Their records stay, each
# naming the command and commit that made it, and index.py and report.py still show them.
RETIRED = {
    "cpu-vs-hf": (
        "The embedded SmolLM2-135M on the CPU: turnout against HF transformers `generate` in the same "
        "process, greedy, 64 new tokens per request, batch 1 and 16, median of 3 interleaved runs"
    ),
    "graphs": (
        "CUDA-graph modes on the Qwen3-0.6B shape: outputs against NONE on 64 mixed prompts, decode TPOT by "
        "batch, forward time, throughput on decode-heavy, prefill-heavy and mixed workloads, capture cost"
    ),
    "profile": (
        "One decode step, kernel by kernel (torch profiler): batch 1 in FULL, batch 256 in FULL_AND_PIECEWISE"
    ),
    "e2e": (
        "Greedy agreement with HF transformers bf16 on the same GPU (free-running and teacher-forced), "
        "random-weight Qwen3-0.6B and Llama-360M shapes, every GPU backend"
    ),
    "parallel": (
        "Tensor and data parallelism on 2 GPUs (NCCL): outputs against TP=1, and the mixed workload's "
        "throughput; float32 TP=2 against TP=1"
    ),
    "moe": (
        "Expert parallelism on 2 GPUs: a Qwen3-30B-A3B-shaped random model (12 of 48 layers, 128 experts, "
        "top-8), EP=1 (tp1), EP=2 with TP and with DP attention, and TP=2 with split experts: outputs "
        "against EP=1, the mixed workload's throughput and memory per rank; then float32 EP=2 against EP=1"
    ),
    "gemv": (
        "The Triton GEMV against cuBLAS at the Qwen3-0.6B and Qwen3-8B projection shapes, 1-8 rows, with a "
        "tile sweep; then its tiles chosen in a captured batch-1 step, where weight reads overlap the kernel "
        "before"
    ),
    "tune-triton": (
        "Sweeps of the Triton attention kernels' tiles, each best checked against torch SDPA: prefill at 4k, "
        "16k and 4x4k tokens; decode at 64 and 256 requests of 512-2048 keys"
    ),
}
# What each results folder holds, run or retired
ABOUT = {**{name: s.about for name, s in SUITES.items()}, **RETIRED}
