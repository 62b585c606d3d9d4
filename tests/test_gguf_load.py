"""A GGUF's weights read at load: dequantized bit for bit as transformers does, q/k rows in HF's order, from
the file the cached folder names; the folder holds config and tokenizer only, and a full disk while it is
written is one line."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from turnout.errors import WeightLoadError
from turnout.loader import gguf as gguf_module
from turnout.loader.default_model import gguf_model_path

T = gguf.GGMLQuantizationType
KINDS = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_1]  # Q5_1: gguf-py's own dequantize
HEADS, KV_HEADS, HIDDEN, VOCAB = 4, 2, 64, 96


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path: Path, seed: int = 0) -> None:
    """A random 1-layer GQA llama whose matrices cycle through KINDS (norms F32)."""
    rng = np.random.default_rng(seed)
    shapes = {"token_embd": (VOCAB, HIDDEN), "output_norm": (HIDDEN,), "output": (VOCAB, HIDDEN)}
    shapes |= {"blk.0.attn_norm": (HIDDEN,), "blk.0.ffn_norm": (HIDDEN,), "blk.0.attn_q": (HIDDEN, HIDDEN)}
    shapes |= {"blk.0.attn_k": (32, HIDDEN), "blk.0.attn_v": (32, HIDDEN), "blk.0.attn_output": (64, 64)}
    shapes |= {"blk.0.ffn_gate": (96, HIDDEN), "blk.0.ffn_up": (96, HIDDEN), "blk.0.ffn_down": (HIDDEN, 96)}
    w = gguf.GGUFWriter(path, "llama")
    for add, value in [("block_count", 1), ("context_length", 128), ("embedding_length", HIDDEN)]:
        getattr(w, f"add_{add}")(value)
    for add, value in [("feed_forward_length", 96), ("head_count", HEADS), ("head_count_kv", KV_HEADS)]:
        getattr(w, f"add_{add}")(value)
    w.add_layer_norm_rms_eps(1e-6)
    matrices = 0
    for name, shape in shapes.items():
        x = rng.standard_normal(shape, dtype=np.float32)
        if "attn_q" in name or "attn_k" in name:
            x = _permute(x, HEADS if "attn_q" in name else KV_HEADS)
        kind = T.F32 if len(shape) == 1 else KINDS[matrices % len(KINDS)]
        matrices += len(shape) == 2
        if kind in (T.F32, T.F16):
            w.add_tensor(f"{name}.weight", x.astype(np.float16) if kind == T.F16 else x)
        else:
            w.add_tensor(f"{name}.weight", gguf.quants.quantize(x, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _transformers_tensors(path: Path) -> dict[str, torch.Tensor]:
    """What from_pretrained(gguf_file=) loads, in float32."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TURNOUT_CACHE_DIR", str(tmp_path / "cache"))
    _write_gguf(tmp_path / "tiny.gguf")
    return tmp_path / "tiny.gguf"


def test_weights_are_transformers_float32_bit_for_bit(tiny: Path) -> None:
    from turnout.bench.roofline import Shape
    from turnout.loader.weights import iter_safetensors

    folder = gguf_model_path(tiny)
    ours, want = dict(iter_safetensors(folder)), _transformers_tensors(tiny)
    assert ours.keys() == want.keys()
    for name, w in want.items():
        assert ours[name].dtype == torch.float32 and ours[name].shape == w.shape, name
        assert torch.equal(ours[name].view(torch.int32), w.float().contiguous().view(torch.int32)), name
    matmuls = sum(w.numel() for w in want.values()) - VOCAB * HIDDEN  # the untied embedding is a gather
    assert Shape.from_checkpoint(folder, dtype_bytes=4).weight_params == matmuls
    kinds = {t.kind for t in gguf_module.read_tensors(tiny)[0]}
    assert kinds == set(KINDS)
    assert sorted(f.name for f in folder.iterdir()) == [
        "config.json",
        "generation_config.json",
        "turnout-convert.json",
    ]  # no copy of the weights


def test_the_folder_reads_the_gguf_it_names(tiny: Path) -> None:
    """A folder whose GGUF went away is converted again from the copy passed now; a GGUF changed under a
    folder fails to load in one line."""
    from turnout.loader.weights import iter_safetensors

    folder = gguf_model_path(tiny)
    first = dict(iter_safetensors(folder))
    moved = tiny.parent / "moved" / "tiny.gguf"
    moved.parent.mkdir()
    tiny.rename(moved)
    assert gguf_model_path(moved) == folder
    again = dict(iter_safetensors(folder))
    assert again.keys() == first.keys() and all(torch.equal(again[k], w) for k, w in first.items())
    with open(moved, "ab") as f:
        f.write(b"\0" * 32)
    with pytest.raises(WeightLoadError, match=f"weights from {moved}, which is gone or has changed") as e:
        dict(iter_safetensors(folder))
    assert "\n" not in str(e.value)


def test_a_full_disk_while_converting_is_one_line_exit_2(
    tiny: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Every file the conversion writes lands on /dev/full, which answers each write with ENOSPC."""
    from turnout.cli import main

    mkdtemp = tempfile.mkdtemp

    def full_mkdtemp(**kw) -> str:
        folder = mkdtemp(**kw)
        for name in ("model.safetensors", "config.json", "generation_config.json", "turnout-convert.json"):
            os.symlink("/dev/full", os.path.join(folder, name))
        return folder

    monkeypatch.setattr(gguf_module.tempfile, "mkdtemp", full_mkdtemp)
    assert main(["generate", "--model", str(tiny), "--prompt", "hi", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: cannot write the converted model to ")
    assert "No space left on device" in err and "free some disk space" in err
