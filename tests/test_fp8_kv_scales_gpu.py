"""On a CUDA machine: the Triton backend's FP8 KV cache with the checkpoint's k_scale / v_scale, eager and
in a FULL CUDA graph, against HF transformers fed K (after rope) and V as the cache returns them
(test_fp8_kv_scales.py's reference). The checkpoint quantizes its KV cache alone, so float32 weights and
float32 attention (Triton's IEEE dots) leave e4m3's rounding the one difference the reference models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_fp8_kv_scales import (
    GREEDY,
    NEW,
    PROMPTS,
    SCALES,
    hf_fp8_kv_reference,
    hf_greedy_logprobs,
    with_kv_scales,
)

from turnout import LLM

from tiny_models import make_tiny_model

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a CUDA GPU with FP8 (sm89+)", allow_module_level=True)


@pytest.mark.parametrize("mode", ["NONE", "FULL_AND_PIECEWISE"])
def test_triton_fp8_cache_with_checkpoint_scales_matches_hf(mode: str, tmp_path: Path) -> None:
    """Greedy tokens equal HF's on every prompt and logprobs agree to 1e-3; HF with scale 1.0 in place
    of the checkpoint's is farther off (test_fp8_kv_scales.py bounds that gap on the CPU)."""
    src = make_tiny_model(tmp_path / "src", "llama", seed=3)
    path = with_kv_scales(src, tmp_path / "kv")
    llm = LLM(str(path), dtype="float32", attention_backend="triton", cudagraph_mode=mode)
    assert llm.engine.selection.kv_cache_dtype == "fp8"
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.shutdown()
    model = hf_fp8_kv_reference(src, SCALES)
    for prompt, o in zip(PROMPTS, outs):
        want, want_lp = hf_greedy_logprobs(model, prompt, NEW)
        assert o.token_ids == want, (prompt, o.token_ids, want)
        lp = torch.tensor(
            [x[t].logprob for x, t in zip(o.outputs[0].logprobs, o.token_ids)], dtype=torch.float64
        )
        assert float((lp - want_lp).abs().max()) < 1e-3
