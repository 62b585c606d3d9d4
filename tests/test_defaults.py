"""Unset settings are fitted to the hardware and the chosen backend (turnout.defaults); set ones are kept,
and the engine and its workers run with the fitted values."""

from __future__ import annotations

import torch
from turnout_cpu.backend import CPUAttentionBackend
from turnout_flash_attn.backend import FlashAttnBackend, Probe

from turnout import LLM
from turnout.config import EngineConfig
from turnout.defaults import fit_defaults
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


def test_engine_and_workers_run_with_the_fitted_values(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", attention_backend="cpu", max_model_len=64)
    assert (llm.engine.config.block_size, llm.engine.config.max_num_batched_tokens) == (16, 4096)
    assert llm.engine.scheduler.bm.block_size == 16
    assert llm.engine.executor.worker.runner.block_size == 16
    out = llm.generate([[3, 4, 5]], use_tqdm=False)[0]
    assert len(out.token_ids) > 0
