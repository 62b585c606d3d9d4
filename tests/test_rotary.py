"""RotaryEmbedding's scaled cos/sin tables against HF transformers' modeling_rope_utils, bit for bit in
float32: inv_freq and attention_factor from ROPE_INIT_FUNCTIONS, and the cos/sin of HF's own rotary module.
End-to-end greedy parity for the scaled models is in test_parity.py."""

from __future__ import annotations

import warnings

import pytest
import torch

from turnout.layers import RotaryEmbedding

YARN = {"rope_type": "yarn"}
# (rope parameters, base, head_dim, max_position_embeddings)
CONFIGS = {
    "linear_2": ({"rope_type": "linear", "factor": 2.0}, 10000.0, 128, 4096),
    "linear_8_old_type_key": ({"type": "linear", "factor": 8.0}, 1e6, 64, 4096),
    "yarn_qwen3": ({**YARN, "factor": 4.0, "original_max_position_embeddings": 32768}, 1e6, 128, 40960),
    "yarn_short_original": ({**YARN, "factor": 8.0, "original_max_position_embeddings": 64}, 1e6, 16, 512),
    "yarn_beta_mscale": (
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 16,
            "beta_slow": 2,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
        },
        10000.0,
        64,
        163840,
    ),
    "yarn_untruncated_attention_factor": (
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 2048,
            "truncate": False,
            "attention_factor": 1.5,
        },
        5e5,
        64,
        16384,
    ),
    # HF's defaults: original_max_position_embeddings = max_position_embeddings (the table's 4096 rows here),
    # factor = their ratio, beta_fast / beta_slow 32 / 1
    "yarn_no_original": ({"rope_type": "yarn", "factor": 4.0}, 1e6, 32, 4096),
    "yarn_no_factor": ({**YARN, "factor": None, "original_max_position_embeddings": 512}, 1e6, 32, 4096),
}
POSITIONS = 4096  # rows compared: enough for every frequency to wrap many times


def _hf_config(params: dict, base: float, head_dim: int, max_position: int):
    from transformers import Qwen3Config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Qwen3Config(
            head_dim=head_dim,
            hidden_size=4 * head_dim,
            num_attention_heads=4,
            max_position_embeddings=max_position,
            rope_parameters={**params, "rope_theta": base},
        )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tables_are_hf_inv_freq_times_its_attention_factor(name: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params, base, head_dim, max_position = CONFIGS[name]
    kind = params.get("rope_type") or params["type"]
    config = _hf_config(params, base, head_dim, max_position)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    freqs = torch.outer(torch.arange(POSITIONS, dtype=torch.float32), inv_freq)
    rope = RotaryEmbedding(head_size=head_dim, max_position=POSITIONS, base=base, scaling=dict(params))
    assert rope.cos.dtype == rope.sin.dtype == torch.float32
    assert torch.equal(rope.cos, freqs.cos() * attention_factor)
    assert torch.equal(rope.sin, freqs.sin() * attention_factor)


@pytest.mark.parametrize("name", ["linear_2", "yarn_qwen3", "yarn_beta_mscale"])
def test_tables_are_hf_rotary_modules_cos_and_sin(name: str) -> None:
    """HF's Qwen3RotaryEmbedding (cat of the two halves, scaled by its attention_scaling) at scattered
    positions: the same float32 values as our table rows."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    params, base, head_dim, max_position = CONFIGS[name]
    hf = Qwen3RotaryEmbedding(_hf_config(params, base, head_dim, max_position))
    pos = torch.tensor([0, 1, 63, 64, 100, 1000, 4095])
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), pos[None])
    rope = RotaryEmbedding(head_dim, POSITIONS, base, dict(params))
    half = head_dim // 2
    assert torch.equal(cos[0, :, :half], rope.cos[pos]) and torch.equal(cos[0, :, half:], rope.cos[pos])
    assert torch.equal(sin[0, :, :half], rope.sin[pos]) and torch.equal(sin[0, :, half:], rope.sin[pos])
