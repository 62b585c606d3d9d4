"""Unset settings are fitted to the hardware and the chosen backend (turnout.defaults); set ones are kept,
and the engine and its workers run with the fitted values."""

from __future__ import annotations

import torch
from turnout_cpu.backend import CPUAttentionBackend
from turnout_flash_attn.backend import FlashAttnBackend, Probe

from turnout import LLM
from turnout.config import EngineConfig
from turnout.defaults import fit_defaults
from turnout.graphs.dispatcher import default_capture_sizes
from turnout.platform import Platform

H200 = Platform("cuda", "H200", 1, (9, 0), 141 << 30, (torch.float16, torch.bfloat16, torch.float32))
L4 = Platform("cuda", "L4", 1, (8, 9), 24 << 30, (torch.float16, torch.bfloat16, torch.float32))
CPU = Platform("cpu", "cpu", 1, None, 16 << 30, (torch.float32,))


def values(config: EngineConfig, platform: Platform, backend) -> dict:
    return {k: v for k, (v, _) in fit_defaults(config, platform, backend).items()}


def test_token_budget_fits_the_device():
    cpu = CPUAttentionBackend()
    assert values(EngineConfig(), H200, cpu)["max_num_batched_tokens"] == 16384
    assert values(EngineConfig(), L4, cpu)["max_num_batched_tokens"] == 8192
    assert values(EngineConfig(), CPU, cpu)["max_num_batched_tokens"] == 4096
    assert "max_num_batched_tokens" not in values(EngineConfig(max_num_batched_tokens=512), H200, cpu)


def test_block_size_is_the_backends_preference_unless_set():
    fa4 = FlashAttnBackend(H200, Probe("fa4"))
    assert values(EngineConfig(), H200, fa4)["block_size"] == 128
    assert values(EngineConfig(), H200, CPUAttentionBackend())["block_size"] == 16
    assert "block_size" not in values(EngineConfig(block_size=32), H200, fa4)


def test_max_num_seqs_is_vllms_llm_default_for_the_device_unless_set():
    # vLLM 0.26's LLM class (engine/arg_utils.py, get_batch_defaults): 1024 on a GPU of >= 70 GiB, else 256;
    # on the CPU 256 a rank
    cpu = CPUAttentionBackend()
    seqs = lambda config, platform: fit_defaults(config, platform, cpu)["max_num_seqs"]  # noqa: E731
    assert seqs(EngineConfig(), H200) == (1024, "GPU with 141 GiB (>= 70): vLLM's offline default 1024")
    assert seqs(EngineConfig(), L4) == (256, "GPU with 24 GiB (< 70): vLLM's offline default 256")
    assert seqs(EngineConfig(), CPU) == (256, "CPU: vLLM's offline default 256")
    assert seqs(EngineConfig(tensor_parallel_size=2), CPU)[0] == 256
    assert "max_num_seqs" not in values(EngineConfig(max_num_seqs=8), H200, cpu)
    # never more requests than a step's tokens (vLLM caps it so), nor than a fixed cache's blocks
    value, why = seqs(EngineConfig(max_num_batched_tokens=512), H200)
    assert value == 512 and why.endswith(
        "capped at max_num_batched_tokens 512 (no more requests than a step's tokens)"
    )
    value, why = seqs(EngineConfig(num_gpu_blocks_override=300, max_num_batched_tokens=400), H200)
    assert value == 300 and why.endswith(
        "capped at num_gpu_blocks_override 300 (each running request holds a KV block)"
    )
    assert seqs(EngineConfig(num_gpu_blocks_override=4096), H200)[0] == 1024


def test_default_graphs_cover_every_decode_step_of_max_num_seqs():
    # vLLM's sizes to min(2 * max_num_seqs, 512); past 512, every 64 up to the first that covers
    # max_num_seqs, so a decode step of all running requests replays a FULL graph instead of running
    # eager, host-bound (benchmarks/results/host-step/, wide/)
    assert default_capture_sizes(256) == [s for s in default_capture_sizes(1024) if s <= 512]
    assert default_capture_sizes(1024)[-9:] == [512, 576, 640, 704, 768, 832, 896, 960, 1024]
    assert default_capture_sizes(600)[-3:] == [512, 576, 640]
    assert default_capture_sizes(8) == [1, 2, 4, 8, 16]
    for seqs in (1, 7, 256, 513, 1000, 1024, 2048):
        sizes = default_capture_sizes(seqs)
        assert sizes == sorted(set(sizes)) and sizes[-1] >= seqs


def test_engine_and_workers_run_with_the_fitted_values(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", attention_backend="cpu", max_model_len=64)
    assert (llm.engine.config.block_size, llm.engine.config.max_num_batched_tokens) == (16, 4096)
    assert llm.engine.config.max_num_seqs == llm.engine.scheduler.max_num_seqs == 256
    assert llm.engine.executor.worker.runner.config.max_num_seqs == 256
    assert llm.engine.scheduler.bm.block_size == 16
    assert llm.engine.executor.worker.runner.block_size == 16
    out = llm.generate([[3, 4, 5]], use_tqdm=False)[0]
    assert len(out.token_ids) > 0


def test_tune_searches_max_num_seqs_only_where_its_load_runs_more_requests(tiny_llama):
    """turnout tune measures half and twice the fitted max_num_seqs only where its load has more requests
    than the smaller of the two admits: below that both run the load alike."""
    from turnout.models.info import ModelInfo
    from turnout.tuning.tuner import Search
    from turnout.tuning.workload import Load

    config, info = EngineConfig(model=str(tiny_llama), dtype="float32"), ModelInfo.from_dir(tiny_llama)

    def options(num_prompts: int) -> list[int]:
        search = Search(config, info, Load("throughput", num_prompts, (4, 8), 4), 2, 60, False)
        try:
            assert search.default["max_num_seqs"] == 256
            return [o["max_num_seqs"] for o in search.options("max_num_seqs", search.default, {})]
        finally:
            search.close()

    assert options(8) == [256]
    assert options(200) == [256, 128]
    assert options(300) == [256, 128, 512]
