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


# the position-dependent kinds, checked against HF's rotary module decoding with its KV cache: a prefill
# up to where the frequencies switch, then one position a forward. (parameters, base, head_dim, max_pos)
SHORT, LONG = [1.0 + 0.1 * i for i in range(8)], [2.0 + 1.5 * i for i in range(8)]
DECODING = {
    "dynamic_4": ({"rope_type": "dynamic", "factor": 4.0}, 10000.0, 16, 64),
    "dynamic_1_7": ({"rope_type": "dynamic", "factor": 1.7}, 1e6, 128, 100),
    "longrope": (
        {
            "rope_type": "longrope",
            "short_factor": SHORT,
            "long_factor": LONG,
            "original_max_position_embeddings": 32,
        },
        10000.0,
        16,
        256,
    ),
    "longrope_su_attention_factor": (
        {
            "type": "su",
            "short_factor": SHORT,
            "long_factor": LONG,
            "original_max_position_embeddings": 64,
            "factor": 2.0,
            "attention_factor": 1.3,
        },
        1e4,
        16,
        128,
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", list(DECODING))
def test_position_dependent_tables_are_hf_modules_decoding(name: str) -> None:
    """Row p is the cos/sin HF's rotary module gives position p when a forward ends there: dynamic NTK's
    base grown for p + 1 tokens past max_position_embeddings, LongRoPE's long factors from
    original_max_position_embeddings on, the short ones (and plain frequencies) before."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    params, base, head_dim, max_position = DECODING[name]
    hf_params = {**params, "rope_type": "longrope"} if params.get("type") == "su" else params
    hf = Qwen3RotaryEmbedding(_hf_config(hf_params, base, head_dim, max_position))
    rope = RotaryEmbedding(head_dim, max_position, base, dict(params))
    switch = params.get("original_max_position_embeddings", max_position)
    rows = rope.cos.shape[0]
    assert rows == (int(max_position * params["factor"]) if "dynamic" in name else max_position)
    x, half = torch.zeros(1, dtype=torch.float32), head_dim // 2
    cos, sin = hf(x, torch.arange(switch)[None])  # the prefill, all in the first regime
    for p in range(rows):
        if p >= switch:
            cos, sin = hf(x, torch.tensor([[p]]))
        i = min(p, cos.shape[1] - 1)
        assert torch.equal(cos[0, i, :half], rope.cos[p]) and torch.equal(sin[0, i, :half], rope.sin[p]), p


def test_longrope_rows_are_hf_init_functions_short_then_long() -> None:
    """ROPE_INIT_FUNCTIONS["longrope"] with no seq_len (short) and with one past the original (long)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params, base, head_dim, max_position = DECODING["longrope"]
    config = _hf_config(params, base, head_dim, max_position)
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=33)
    assert factor > 1 and not torch.equal(short, long)
    positions = torch.arange(max_position, dtype=torch.float32)[:, None]
    want = torch.cat([positions[:32] * short, positions[32:] * long])
    rope = RotaryEmbedding(head_dim, max_position, base, dict(params))
    assert torch.equal(rope.cos, want.cos() * factor) and torch.equal(rope.sin, want.sin() * factor)


NESTED = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}


@pytest.mark.parametrize(
    "scaling,match",
    [
        (NESTED, r"nested by layer type \(full_attention, sliding_attention\).*rope_parameters_for"),
        ({"rope_type": "proportional", "factor": 2.0}, r"rope scaling 'proportional' is not supported"),
        ({"rope_type": "dynamic"}, r"rope scaling 'dynamic' needs factor"),
        (
            {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG[:3]},
            r"long_factor as a list of 8",
        ),
    ],
)
def test_what_it_does_not_implement_is_an_error_naming_it(scaling: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RotaryEmbedding(16, 64, 10000.0, scaling)


def test_rope_parameters_for_picks_a_layer_types_dict() -> None:
    """Gemma 3 as transformers 5 writes it: each layer type's own base and scaling; a flat dict (or the
    older rope_scaling beside a top-level rope_theta) serves every layer type."""
    from turnout.layers import rope_parameters_for

    nested = {"rope_parameters": NESTED}
    assert rope_parameters_for(nested, "full_attention") == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert rope_parameters_for(nested, "sliding_attention") == (10000.0, {"rope_type": "default"})
    with pytest.raises(ValueError, match=r"layer type None is not one of them"):
        rope_parameters_for(nested)
    flat = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_theta": 5e5}
    assert rope_parameters_for(flat, "sliding_attention") == (5e5, {"rope_type": "yarn", "factor": 4.0})
    base, scaling = rope_parameters_for(nested, "full_attention")
    rope = RotaryEmbedding(16, 64, base, scaling)
    assert torch.equal(rope.cos, RotaryEmbedding(16, 64, 1e6, {"type": "linear", "factor": 8.0}).cos)
