import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm

from turnout.errors import WeightLoadError
from turnout.loader.weights import one_line

CONVERT_MARKER = "turnout-convert.json"
CONVERT_VERSION = 3  # 3: weights stored in the config's dtype, the folder named by the source's content
HASH_LIMIT = 64 << 20  # config and tokenizer files are hashed; the weights are checked by size
SAMPLE = 1 << 20  # source_digest reads a larger file's head and SAMPLES chunks of this size spread over it
SAMPLES = 32
STORED_DTYPE = "bfloat16"  # the released SmolLM2/Llama dtype; config.json names it and the weights use it
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _meta(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types[0] == gguf.GGUFValueType.STRING else value.item()


def _f32(value: float) -> float:
    return float(str(np.float32(value)))


def hf_name(gguf_name: str) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{suffix}"
    return f"{_GLOBAL[base]}.{suffix}" if base in _GLOBAL else None


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's rope row permutation: per head, rows (d/2, 2) back to (2, d/2)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _open(gguf_path: Path) -> gguf.GGUFReader:
    if not gguf_path.is_file():
        raise WeightLoadError(f"GGUF file {gguf_path} does not exist; pass the path of a .gguf file")
    try:
        return gguf.GGUFReader(gguf_path)
    except Exception as e:
        raise WeightLoadError(f"corrupt GGUF file {gguf_path}: {one_line(e)}; re-download it") from None


def _tensor(t: Any, gguf_path: Path) -> torch.Tensor:
    try:
        w = dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise WeightLoadError(
            f"tensor {t.name} in {gguf_path} has type {t.tensor_type.name}, which gguf cannot dequantize; "
            "upgrade it: pip install -U gguf"
        ) from None
    return torch.from_numpy(np.array(w, dtype=np.float32)).reshape(tuple(reversed(t.shape.tolist())))


def _tensors(
    reader: gguf.GGUFReader, gguf_path: Path, n_head: int, n_kv_head: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    tensors = {}
    for t in tqdm(reader.tensors, desc=f"converting {gguf_path.name}", unit="tensor"):
        if (name := hf_name(t.name)) is None:
            raise WeightLoadError(
                f"tensor {t.name} in {gguf_path} has no llama equivalent; convert from the HF release instead"
            )
        w = _tensor(t, gguf_path)
        if ".attn_q." in t.name or ".attn_k." in t.name:
            w = unpermute(w, n_head if ".attn_q." in t.name else n_kv_head)
        tensors[name] = w.to(dtype).contiguous()
    return tensors


def _config(reader: gguf.GGUFReader) -> dict[str, Any]:
    """config.json, from the GGUF's metadata and tensor names and shapes: nothing is dequantised."""
    arch = lambda key, default=None: _meta(reader, f"llama.{key}", default)
    names = {t.name for t in reader.tensors}
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise WeightLoadError("the GGUF has no token_embd.weight tensor; it is not a llama checkpoint")
    hidden, n_head = arch("embedding_length"), arch("attention.head_count")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": arch("feed_forward_length"),
        "num_hidden_layers": arch("block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": arch("attention.head_count_kv", n_head),
        "head_dim": arch("attention.key_length", hidden // n_head),
        "rms_norm_eps": _f32(arch("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(arch("rope.freq_base", 10000.0)),
        "max_position_embeddings": arch("context_length", 2048),
        "vocab_size": int(embed.shape[-1]),  # GGUF shapes run innermost first: (hidden, vocab)
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "torch_dtype": STORED_DTYPE,
    }
    return config | _special_ids(reader)


def _special_ids(reader: gguf.GGUFReader) -> dict[str, int]:
    keys = {
        "bos_token_id": "bos_token_id",
        "eos_token_id": "eos_token_id",
        "pad_token_id": "padding_token_id",
    }
    ids = {k: _meta(reader, f"tokenizer.ggml.{v}") for k, v in keys.items()}
    return {k: v for k, v in ids.items() if v is not None}


def _check(reader: gguf.GGUFReader, gguf_path: Path) -> None:
    if (arch := _meta(reader, "general.architecture")) != "llama":
        raise WeightLoadError(f"{gguf_path} is a {arch} GGUF; only llama-architecture GGUFs convert")
    if _meta(reader, "llama.rope.scaling.type", "none") != "none":
        raise WeightLoadError(
            f"{gguf_path} uses rope scaling, which the GGUF converter lacks; use the HF release"
        )


def _save_tokenizer(reader: gguf.GGUFReader, gguf_path: Path, out: Path) -> None:
    if _meta(reader, "tokenizer.ggml.model") is None:
        return
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except (ValueError, KeyError, OSError) as e:
        raise WeightLoadError(
            f"cannot build the tokenizer of {gguf_path}: {one_line(e)}; "
            "upgrade transformers or convert from the HF release"
        ) from None
    if not tok.chat_template and (template := _meta(reader, "tokenizer.chat_template")):
        tok.chat_template = template
    tok.save_pretrained(out)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def gguf_config(gguf_path: Path) -> dict[str, Any]:
    """The config.json a conversion of gguf_path would write, read without converting it."""
    reader = _open(Path(gguf_path))
    _check(reader, gguf_path)
    return _config(reader)


def source_digest(path: Path) -> str:
    """A stable key of a GGUF file's content: sha256 of its size and, for a file of up to HASH_LIMIT bytes,
    all of it; for a larger one its first HASH_LIMIT bytes (the header, metadata and tokenizer) and SAMPLES
    chunks at fixed fractions of the tensor data, so a multi-GB file costs ~100 MB of reads."""
    h, size = hashlib.sha256(), path.stat().st_size
    h.update(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        if size <= HASH_LIMIT:
            while chunk := f.read(SAMPLE):
                h.update(chunk)
            return h.hexdigest()
        h.update(f.read(HASH_LIMIT))
        for i in range(SAMPLES):
            f.seek(HASH_LIMIT + (size - HASH_LIMIT - SAMPLE) * i // (SAMPLES - 1))
            h.update(f.read(SAMPLE))
    return h.hexdigest()


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def manifest(folder: Path) -> dict[str, list]:
    """name -> [size, sha256 or None] for every file of a conversion (the marker excepted)."""
    files = sorted(f for f in folder.iterdir() if f.is_file() and f.name != CONVERT_MARKER)
    return {
        f.name: [f.stat().st_size, file_digest(f) if f.stat().st_size < HASH_LIMIT else None] for f in files
    }


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = _open(gguf_path)
    _check(reader, gguf_path)
    n_head = _meta(reader, "llama.attention.head_count")
    config = _config(reader)
    n_kv_head = _meta(reader, "llama.attention.head_count_kv", n_head)
    tensors = _tensors(reader, gguf_path, n_head, n_kv_head, getattr(torch, config["torch_dtype"]))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", _special_ids(reader))
        _save_tokenizer(reader, gguf_path, tmp)
        source = {
            "source": str(gguf_path),
            "source_size": gguf_path.stat().st_size,
            "source_digest": source_digest(gguf_path),
            "version": CONVERT_VERSION,
            "files": manifest(tmp),
        }
        _write_json(tmp / CONVERT_MARKER, source)
        tmp.chmod(0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
