import hashlib
import json
import math
import mmap
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
import torch

from turnout.errors import WeightLoadError, one_line

CONVERT_MARKER = "turnout-convert.json"
CONVERT_VERSION = 4  # 4: the folder holds no weights; they are read from the GGUF its marker names
HASH_LIMIT = 64 << 20  # files up to this size are hashed whole
SAMPLE = 1 << 20  # source_digest reads a larger file's head and SAMPLES chunks of this size spread over it
SAMPLES = 32
CONFIG_DTYPE = "bfloat16"  # config.json's torch_dtype, what dtype="auto" resolves to: the released SmolLM2's
RUN_VALUES = 1 << 22  # values dequantized together: 16 MiB of float32, which malloc reuses run to run
_GGUF_VERSIONS = (2, 3)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
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


class TensorInfo(NamedTuple):
    """One tensor of a GGUF file: its shape in torch's order (outermost first) and where its bytes lie."""

    name: str
    shape: tuple[int, ...]
    kind: gguf.GGMLQuantizationType
    offset: int
    nbytes: int


def _string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8 : pos + 8 + n]).decode(), pos + 8 + n


def _skip(buf: mmap.mmap, pos: int, vtype: int) -> int:
    """The position past one metadata value of type vtype at pos."""
    if vtype in _SCALARS:
        return pos + struct.calcsize(_SCALARS[vtype])
    if vtype == _STRING:
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
    if vtype != _ARRAY:
        raise ValueError(f"unknown metadata type {vtype} at byte {pos}")
    itype, n = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if itype in _SCALARS:
        return pos + n * struct.calcsize(_SCALARS[itype])
    for _ in range(n):  # a tokenizer's strings: ~10^5 of them, so this loop is kept tight
        pos = pos + 8 + struct.unpack_from("<Q", buf, pos)[0] if itype == _STRING else _skip(buf, pos, itype)
    return pos


def _parse(buf: mmap.mmap) -> list[TensorInfo]:
    """The tensor table of a GGUF file, its metadata skipped but general.alignment (GGUF v2 and v3)."""
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF" or version not in _GGUF_VERSIONS:
        raise ValueError(f"not a little-endian GGUF v2/v3 file (magic {magic!r}, version {version})")
    pos, align = 24, 32
    for _ in range(n_kv):
        key, pos = _string(buf, pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        if key == "general.alignment":
            (align,) = struct.unpack_from("<I", buf, pos + 4)
        pos = _skip(buf, pos + 4, vtype)
    table = []
    for _ in range(n_tensors):
        name, pos = _string(buf, pos)
        (ndim,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)  # innermost first
        kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndim)
        pos += 16 + 8 * ndim
        kind = gguf.GGMLQuantizationType(kind)
        block, size = gguf.GGML_QUANT_SIZES[kind]
        if dims[0] % block:
            raise ValueError(f"tensor {name}'s rows of {dims[0]} do not fill {kind.name} blocks of {block}")
        table.append(TensorInfo(name, tuple(reversed(dims)), kind, offset, math.prod(dims) // block * size))
    start = -(-pos // align) * align  # the data section; offsets count from it
    infos = [t._replace(offset=start + t.offset) for t in table]
    if bad := next((t for t in infos if t.offset + t.nbytes > len(buf)), None):
        raise ValueError(f"tensor {bad.name} runs past the end of the file")
    return infos


def read_tensors(gguf_path: Path) -> tuple[list[TensorInfo], np.ndarray]:
    """(the tensor table of gguf_path, the whole file as a copy-on-write uint8 memory map)."""
    if not gguf_path.is_file():
        raise WeightLoadError(f"GGUF file {gguf_path} does not exist; pass the path of a .gguf file")
    try:
        with open(gguf_path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return _parse(buf), np.frombuffer(buf, dtype=np.uint8)
    except (ValueError, KeyError, struct.error, OSError) as e:
        raise WeightLoadError(f"corrupt GGUF file {gguf_path}: {one_line(e)}; re-download it") from None


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Each block's 4-bit values in order: the low nibbles are its first half, the high ones its second."""
    out = torch.empty(qs.shape[0], 2 * qs.shape[1], dtype=torch.uint8)
    torch.bitwise_and(qs, 15, out=out[:, : qs.shape[1]])
    torch.bitwise_right_shift(qs, 4, out=out[:, qs.shape[1] :])
    return out


def dequantize(raw: torch.Tensor, kind: gguf.GGMLQuantizationType) -> torch.Tensor:
    """The float32 values of a tensor's raw bytes, flat: bit for bit gguf-py's dequantize, which
    transformers uses (each product and sum rounded to float32 alone, with no fused multiply-add)."""
    T = gguf.GGMLQuantizationType
    if kind in (T.F32, T.F16, T.BF16):
        return raw.view({T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[kind]).float()
    blocks = raw.view(-1, gguf.GGML_QUANT_SIZES[kind][1])
    if kind == T.Q8_0:
        return blocks[:, 2:].view(torch.int8).float().mul_(_half(blocks, 0)).flatten()
    if kind == T.Q4_0:
        return _nibbles(blocks[:, 2:]).float().sub_(8).mul_(_half(blocks, 0)).flatten()
    if kind == T.Q4_1:
        return _nibbles(blocks[:, 4:]).float().mul_(_half(blocks, 0)).add_(_half(blocks, 2)).flatten()
    return torch.from_numpy(gguf.quants.dequantize(raw.numpy(), kind)).flatten()


def _runs(infos: list[TensorInfo]) -> list[list[TensorInfo]]:
    """The tensors by type, in runs of up to RUN_VALUES values (one tensor alone may be larger)."""
    runs: dict[gguf.GGMLQuantizationType, list[list[TensorInfo]]] = {}
    for t in infos:
        kind = runs.setdefault(t.kind, [[]])
        if kind[-1] and sum(math.prod(u.shape) for u in kind[-1]) + math.prod(t.shape) > RUN_VALUES:
            kind.append([])
        kind[-1].append(t)
    return [run for kind in runs.values() for run in kind]


def _raw(t: TensorInfo, data: np.ndarray, n_head: int, n_kv_head: int) -> torch.Tensor:
    """t's bytes; q/k rows (each a whole number of blocks) back in HF's order before they are dequantized."""
    raw = torch.from_numpy(data[t.offset : t.offset + t.nbytes])
    if ".attn_q." in t.name or ".attn_k." in t.name:
        raw = unpermute(raw.view(t.shape[0], -1), n_head if ".attn_q." in t.name else n_kv_head).flatten()
    return raw


def _dequantize_run(
    run: list[TensorInfo], raw: list[torch.Tensor], gguf_path: Path
) -> Iterator[tuple[TensorInfo, torch.Tensor]]:
    """Each tensor of run with its float32 values: a run is dequantized in a few large ops."""
    try:
        flat = dequantize(raw[0] if len(raw) == 1 else torch.cat(raw), run[0].kind)
    except NotImplementedError:
        raise WeightLoadError(
            f"tensor {run[0].name} in {gguf_path} has type {run[0].kind.name}, which gguf cannot dequantize; "
            "upgrade it: pip install -U gguf"
        ) from None
    for t, w in zip(run, flat.split([math.prod(t.shape) for t in run])):
        yield t, w.view(t.shape)


def _llama_name(name: str, gguf_path: Path) -> str:
    if (hf := hf_name(name)) is None:
        raise WeightLoadError(
            f"tensor {name} in {gguf_path} has no llama equivalent; convert from the HF release instead"
        )
    return hf


def iter_gguf(gguf_path: Path, n_head: int, n_kv_head: int) -> Iterator[tuple[str, torch.Tensor]]:
    """A llama GGUF's tensors under their HF names, dequantized to float32 a run at a time, q/k rows in HF's
    order: exactly the tensors transformers loads from the file."""
    infos, data = read_tensors(Path(gguf_path))
    names = {t.name: _llama_name(t.name, gguf_path) for t in infos}
    for run in _runs(infos):
        raw = [_raw(t, data, n_head, n_kv_head) for t in run]
        for t, w in _dequantize_run(run, raw, gguf_path):
            yield names[t.name], w


def _marked_source(model_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """(the GGUF a cached folder reads its weights from, its config.json); None for another folder."""
    try:
        marker = json.loads((model_dir / CONVERT_MARKER).read_text())
        config = json.loads((model_dir / "config.json").read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise WeightLoadError(f"unreadable {model_dir}: {one_line(e)}; delete that folder") from None
    if not isinstance(marker, dict) or marker.get("version") != CONVERT_VERSION:
        return None
    source = Path(marker["source"])
    if not source.is_file() or source.stat().st_size != marker["source_size"]:
        raise WeightLoadError(
            f"{model_dir} reads its weights from {source}, which is gone or has changed; "
            "load that .gguf file again to re-convert it"
        )
    return source, config


def gguf_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]] | None:
    """The tensors of a GGUF's cached folder, read from the GGUF its marker names (the folder holds no
    weights); None for a folder without a marker of this converter."""
    if (marked := _marked_source(Path(model_dir))) is None:
        return None
    source, config = marked
    n_head = config["num_attention_heads"]
    return iter_gguf(source, n_head, config.get("num_key_value_heads", n_head))


def gguf_shapes(model_dir: str | Path) -> list[tuple[str, tuple[int, ...]]] | None:
    """(HF name, shape) of each tensor gguf_weights would read, from the GGUF's table alone; None likewise."""
    if (marked := _marked_source(Path(model_dir))) is None:
        return None
    return [(_llama_name(t.name, marked[0]), t.shape) for t in read_tensors(marked[0])[0]]


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
        "torch_dtype": CONFIG_DTYPE,
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
    """Write out_dir: gguf_path's config.json, generation_config.json and tokenizer, and a marker naming
    gguf_path, whose tensors gguf_weights reads at every load (the folder holds no copy of them)."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = _open(gguf_path)
    _check(reader, gguf_path)
    config = _config(reader)
    for t in reader.tensors:
        _llama_name(t.name, gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
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
