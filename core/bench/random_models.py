"""Random-weight checkpoints in real model shapes, made on the machine that runs them (no downloads)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("turnout")

# name -> (architecture, HF config keys): each shape's numbers below, in this order, then its own keys
DIMS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "vocab_size", "tie_word_embeddings", "rope_theta")  # fmt: skip
SHAPES = {name: (arch, dict(zip(DIMS, dims), **kw)) for name, (arch, dims, kw) in {
    "qwen3-0.6b": ("qwen3", (1024, 3072, 28, 16, 8, 151936, True, 1e6), dict(head_dim=128)),
    "qwen3-8b": ("qwen3", (4096, 12288, 36, 32, 8, 151936, False, 1e6), dict(head_dim=128)),
    "llama-3-8b": ("llama", (4096, 14336, 32, 32, 8, 128256, False, 5e5), {}),
    "llama-360m": ("llama", (960, 2560, 32, 15, 5, 49152, True, 1e5), {}),  # SmolLM2-360M's
    "mistral-7b": ("mistral", (4096, 14336, 32, 32, 8, 32768, False, 1e6),  # Mistral-7B-v0.3's, no window
                   dict(sliding_window=None, rms_norm_eps=1e-5)),
    # Gemma-3-12B's language model: heads of 256; five local layers (window 1024, rope base 10000) to one
    # global (base 1e6, linear scaling by 8)
    "gemma-3-12b": ("gemma3", (3840, 15360, 48, 16, 8, 262208, True, 1e6), dict(
        head_dim=256, query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6,
        rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0})),
    # DeepSeek-V2-Lite: 16 heads of MLA (latent 512 + rope 64, nope 128, v 128), the first layer dense, then
    # 64 routed experts (6 a token, greedy) plus 2 shared; YaRN by 40
    "deepseek-v2-lite": ("deepseek_v2", (2048, 10944, 27, 16, 16, 102400, False, 1e4), dict(
        kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
        routed_scaling_factor=1.0, rope_scaling={"type": "yarn", "factor": 40.0, "mscale": 0.707,
        "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1})),
}.items()}  # fmt: skip
# FP8 variants of every shape ("qwen3-8b-fp8"): the shape's bf16 checkpoint quantized by quantize_checkpoint
FP8_VARIANTS = {
    "fp8": dict(fmt="fp8", block=(128, 128)),  # HF's fine-grained FP8: 128x128 block scales
    "fp8-dynamic": dict(fmt="compressed-tensors", weights="channel", activations="dynamic"),
}
RANDOM_MODELS = (*SHAPES, *(f"{s}-{v}" for s in SHAPES for v in FP8_VARIANTS))
SHARD_BYTES = 4 << 30
MAX_POSITIONS = 40960  # Qwen3's max_position_embeddings, in every shape: a 32k-token prompt fits
CHARS = [chr(c) for c in range(32, 127)]  # the tokenizer's last ids, one printable ASCII character each


def random_model_dir(shape: str) -> Path:
    from turnout.loader.default_model import cache_dir

    return cache_dir() / "models" / f"random-{shape}"


def random_model(shape: str) -> Path:
    """The random-weight checkpoint of `shape` in turnout's cache dir, made on first use."""
    return make_random_model(random_model_dir(shape), shape)


def random_config(shape: str) -> Any:
    """The HF config of a shape, with MAX_POSITIONS positions and the ids of write_tokenizer's <s> and </s>;
    transformers writes it as it writes that architecture's (Gemma 3's layer_types and nested rope)."""
    from transformers import AutoConfig

    arch, kw = SHAPES[shape]
    defaults = dict(max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    model_type = "gemma3_text" if arch == "gemma3" else arch  # Gemma 3's language model alone
    return AutoConfig.for_model(model_type, **{**defaults, **kw})


def make_random_model(path: Path, shape: str, seed: int = 0) -> Path:
    """bf16 weights: matrices N(0, 0.02) like HF's init, norms 1 (Gemma's 0, applied as 1 + w). Written
    tensor by tensor as safetensors shards, then a word-level tokenizer over the whole vocabulary, then
    config.json last: a folder with a config.json is complete, and is reused (a folder with fewer positions
    has them raised to MAX_POSITIONS in its config: positions carry no weights; one whose tokenizer cannot
    spell JSON gets write_tokenizer's, its weights untouched)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    path, config = Path(path), Path(path) / "config.json"
    if config.exists():
        cfg = json.loads(config.read_text())
        if cfg.get("max_position_embeddings", 0) < MAX_POSITIONS:
            cfg["max_position_embeddings"] = MAX_POSITIONS
            config.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        if not spells_json(path):
            write_tokenizer(path, cfg["vocab_size"])
        return path
    base, _, variant = shape.rpartition("-fp8")  # "qwen3-8b-fp8-dynamic": "qwen3-8b", "-dynamic"
    if base in SHAPES:  # an FP8 variant: its shape's bf16 checkpoint, quantized
        bf16 = make_random_model(random_model_dir(base), base, seed)
        return quantize_checkpoint(bf16, path, **FP8_VARIANTS[f"fp8{variant}"])
    cfg = random_config(shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    names = checkpoint_names({k: v.shape for k, v in model.state_dict().items()})
    cfg.architectures, cfg.dtype = [type(model).__name__], "bfloat16"
    if cfg.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    logger.info("writing a random %s checkpoint to %s", shape, path)
    path.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device).manual_seed(seed)
    norm = 0.0 if cfg.model_type.startswith("gemma") else 1.0
    shards: list[dict] = [{}]
    for name, shp in names.items():
        if len(shp) > 1:
            t = torch.empty(shp, dtype=torch.bfloat16, device=device).normal_(0, 0.02, generator=gen)
        else:
            t = torch.full(shp, norm, dtype=torch.bfloat16, device=device)
        if shards[-1] and sum(x.nbytes for x in shards[-1].values()) + t.nbytes > SHARD_BYTES:
            shards.append({})
        shards[-1][name] = t.cpu()
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    write_tokenizer(path, cfg.vocab_size)
    cfg.save_pretrained(path)
    return path


def checkpoint_names(names: dict[str, Any]) -> dict[str, Any]:
    """Tensor shapes by checkpoint name: transformers' fused expert tensors (`experts.gate_up_proj`
    [E, 2I, H], `experts.down_proj` [E, H, I]) as the per-expert matrices MoE checkpoints store
    (`experts.{e}.gate_proj.weight` [I, H], `up_proj`, `down_proj` [H, I]); every other name as it is."""
    out = {}
    for name, shape in names.items():
        prefix, _, leaf = name.rpartition("experts.")
        if len(shape) != 3 or leaf not in ("gate_up_proj", "down_proj"):
            out[name] = shape
            continue
        num_experts, rows, cols = shape
        halves = {"gate_proj": (rows // 2, cols), "up_proj": (rows // 2, cols)}
        parts = halves if leaf == "gate_up_proj" else {"down_proj": (rows, cols)}
        for e in range(num_experts):
            for proj, shp in parts.items():
                out[f"{prefix}experts.{e}.{proj}.weight"] = shp
    return out


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one token per id: "<unk>", "<s>", "</s>", then "w3", "w4", ..., and the
    last 95 ids the printable ASCII characters " " to "~", so that JSON can be spelled. Decoding joins the
    tokens' strings as they are, which is how a grammar backend spells them. vocab_size is at least 98."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size - len(CHARS))}}
    vocab = words | {c: vocab_size - len(CHARS) + i for i, c in enumerate(CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)


def spells_json(path: Path) -> bool:
    """The folder's tokenizer.json has the single-character tokens JSON needs (a missing one counts as
    spelling it: the folder is not one write_tokenizer made)."""
    f = Path(path) / "tokenizer.json"
    return not f.exists() or "{" in json.loads(f.read_text())["model"]["vocab"]


LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_checkpoint(
    src: Path,
    dst: Path,
    fmt: str = "fp8",
    block: tuple[int, int] | None = (128, 128),
    weights: str = "channel",
    activations: str = "dynamic",
    input_scale: float = 8 / 448,
    linear_names: tuple[str, ...] = LINEAR_NAMES,
) -> Path:
    """Write src's checkpoint to dst with its decoder linear weights (the modules named in linear_names) in
    FP8 e4m3, and config.json's quantization_config saying how (a tile's, row's or tensor's scale is its
    amax / 448; w = q * scale):

    - fmt "fp8": HF's fine-grained format, `weight_scale_inv` [N / bn, K / bk] for block (dynamic
      activations), or per-tensor `weight_scale` without a block (`activations` "dynamic" or "static");
    - fmt "compressed-tensors": `weight_scale` per tensor ([1]) or per channel ([N, 1]) by `weights`,
      activations "dynamic" (per token) or "static" (an `input_scale` of input_scale).

    Other tensors are copied as they are. config.json is written last, so a folder with one is complete."""
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from turnout.loader.weights import weight_files

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    static = activations == "static"
    weight_map = {}
    for path in weight_files(src):
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if not (name.endswith(".weight") and name.split(".")[-2] in linear_names and t.dim() == 2):
                    out[name] = t
                    continue
                stem = name.removesuffix(".weight")
                if fmt == "fp8" and block is not None:
                    q, scale = _quantize(t, block)
                    out[f"{stem}.weight_scale_inv"] = scale
                else:
                    per_row = fmt != "fp8" and weights == "channel"
                    q, scale = _quantize(t, (1, t.shape[1]) if per_row else None)
                    shape = (-1, 1) if per_row else () if fmt == "fp8" else (1,)
                    out[f"{stem}.weight_scale"] = scale.reshape(shape)
                if static:
                    x = torch.tensor(input_scale)
                    out[f"{stem}.input_scale"] = x.reshape(() if fmt == "fp8" else (1,))
                out[name] = q
        save_file(out, str(dst / path.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, path.name))
    if (src / "model.safetensors.index.json").exists():
        index = {"metadata": {}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = _quant_config(fmt, block, weights, static)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return dst


def _quantize(w: Any, block: tuple[int, int] | None) -> tuple[Any, Any]:
    """w [N, K] -> (q e4m3, float32 scale [ceil(N / bn), ceil(K / bk)]); block None: one scale."""
    import torch

    w = w.to("cuda" if torch.cuda.is_available() else "cpu").double()
    n, k = w.shape
    bn, bk = block or (n, k)
    pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk, dtype=torch.float64, device=w.device)
    pad[:n, :k] = w
    tiles = pad.view(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk)
    scale = (tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448).float()
    full = scale.double().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.cpu(), scale.cpu()


def _quant_config(fmt: str, block: tuple[int, int] | None, weights: str, static: bool) -> dict[str, Any]:
    if fmt == "fp8":
        qc: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3"}
        qc["activation_scheme"] = "static" if static else "dynamic"
        return qc | ({"weight_block_size": list(block)} if block else {})
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    act = {**fp8, "dynamic": not static, "strategy": "tensor" if static else "token"}
    wts = {**fp8, "dynamic": False, "strategy": weights}
    group = {"targets": ["Linear"], "weights": wts, "input_activations": act}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
    }
