"""FP8 KV cache scales from the checkpoint (compressed-tensors' kv_cache_scheme): a tiny Llama whose
checkpoint holds a k_scale and a v_scale a layer (not 1.0) runs an FP8 cache with them, against HF
transformers on the checkpoint dequantized, its attention fed K (after rope) and V as the cache returns
them: e4m3(clamp(x / scale, -448, 448)) * scale. Bad scales are one error line naming the tensor."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from turnout import LLM, SamplingParams
from turnout.bench.random_models import quantize_checkpoint
from turnout.cli import main
from turnout.errors import TurnoutError

from tiny_models import dequantized_checkpoint, make_tiny_model

# per layer (k_scale, v_scale): K after rope reaches ~3.9 and V ~4.5 on these prompts, so x / scale spans
# most of e4m3's range (448), and none is a power of two (a power of two rounds as scale 1.0 does)
SCALES = [(0.0071, 0.0113), (0.0093, 0.0127)]
KV_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}
NAMES = {  # how the checkpoint names layer i's scales: vLLM's, and llm-compressor's older ones
    "vllm": ("model.layers.{i}.self_attn.k_scale", "model.layers.{i}.self_attn.v_scale"),
    "output_scale": (
        "model.layers.{i}.self_attn.k_proj.output_scale",
        "model.layers.{i}.self_attn.v_proj.output_scale",
    ),
}  # fmt: skip
PROMPTS = [[random.Random(i).randrange(3, 512) for _ in range(6 + 9 * i)] for i in range(4)]
NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=1)


def with_kv_scales(src: Path, dst: Path, scales=SCALES, names: str = "vllm", edit=None) -> Path:
    """src (a compressed-tensors FP8 checkpoint, or an unquantized one: then only its KV cache is) copied
    to dst with per-layer KV scales and a kv_cache_scheme; edit(tensors, config) changes them before they
    are written."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for i, (k, v) in enumerate(scales):
        kn, vn = NAMES[names]
        tensors[kn.format(i=i)], tensors[vn.format(i=i)] = torch.tensor([k]), torch.tensor([v])
    cfg = json.loads((dst / "config.json").read_text())
    qc = cfg.setdefault("quantization_config", {"quant_method": "compressed-tensors", "config_groups": {}})
    qc["kv_cache_scheme"] = dict(KV_SCHEME)
    if edit is not None:
        edit(tensors, cfg)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def src_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("kv-scales-src"), "llama", seed=3)


@pytest.fixture(scope="module")
def fp8_ckpt(src_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(an FP8 checkpoint without KV scales, HF's float32 reference of its weights)."""
    tmp = tmp_path_factory.mktemp("kv-scales")
    fp8 = quantize_checkpoint(src_ckpt, tmp / "fp8", fmt="compressed-tensors", weights="channel")
    return fp8, dequantized_checkpoint(fp8, tmp / "ref")


def _as_cached(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as an FP8 cache with scale gives it back, computed apart from turnout: float64 after the cast."""
    q = (x.double() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (q.double() * scale).to(x.dtype)


def hf_fp8_kv_reference(ref: Path, scales):
    """HF's model of ref's weights in float32 whose eager attention takes K (after rope) and V through an
    FP8 cache of each layer's scales, as turnout's cache stores them (its current token's too)."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    def attention(module, q, k, v, mask, **kw):
        ks, vs = scales[module.layer_idx]
        return eager_attention_forward(module, q, _as_cached(k, ks), _as_cached(v, vs), mask, **kw)

    name = f"fp8_kv_{'_'.join(f'{s:g}' for pair in scales for s in pair)}"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, eager_mask)  # the causal mask eager attention takes
    return AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32, attn_implementation=name).eval()


def hf_greedy_logprobs(model, prompt: list[int], new: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens (one full forward a step) and the logprob of each, in float64."""
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(new):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
            ids.append(int(logp.argmax()))
            lps.append(float(logp.max()))
    return ids[len(prompt) :], torch.tensor(lps, dtype=torch.float64)


def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The logprob of each of tokens after prompt and the tokens before it (one forward), in float64."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].double(), -1)
    return logp[len(prompt) - 1 : -1].gather(1, torch.tensor(tokens)[:, None])[:, 0]


def engine_greedy_logprobs(path: Path, **kw) -> tuple[list[list[int]], list[torch.Tensor]]:
    llm = LLM(str(path), dtype="float32", cpu_kv_cache_bytes=1 << 22, **kw)
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    lps = [torch.tensor([lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.token_ids)]) for o in outs]
    return [o.token_ids for o in outs], [x.double() for x in lps]


@pytest.mark.parametrize("names,weights", [("vllm", "fp8"), ("output_scale", "fp8"), ("vllm", "kv-only")])
def test_checkpoint_kv_scales_match_hf_through_the_same_fp8_cache(
    names: str, weights: str, fp8_ckpt: tuple[Path, Path], src_ckpt: Path, tmp_path: Path
) -> None:
    """FP8 weights with KV scales, and (kv-only) a checkpoint that quantizes its KV cache alone: greedy
    tokens equal HF's and their logprobs agree to 1e-4 (measured: ~4e-6). HF with scale 1.0 in place of
    the checkpoint's, teacher-forced on the same tokens, is off by more than 1e-3 (measured: ~0.3), so the
    bound sees a scale left unused."""
    base, ref = fp8_ckpt if weights == "fp8" else (src_ckpt, src_ckpt)
    path = with_kv_scales(base, tmp_path / "ckpt", names=names)
    tokens, lps = engine_greedy_logprobs(path)
    model = hf_fp8_kv_reference(ref, SCALES)
    unscaled = hf_fp8_kv_reference(ref, [(1.0, 1.0)] * len(SCALES))
    worst, worst_unscaled = 0.0, 0.0
    for prompt, got, lp in zip(PROMPTS, tokens, lps):
        want, want_lp = hf_greedy_logprobs(model, prompt, NEW)
        assert got == want, (prompt, got, want)
        worst = max(worst, float((lp - want_lp).abs().max()))
        worst_unscaled = max(worst_unscaled, float((lp - hf_logprobs(unscaled, prompt, got)).abs().max()))
    assert worst < 1e-4, worst
    assert worst_unscaled > 1e-3, worst_unscaled


def test_the_checkpoint_scale_changes_the_cache(fp8_ckpt: tuple[Path, Path], tmp_path: Path) -> None:
    """Scales s and 1.0 store different bytes in every layer; in the first layer, whose keys and values
    are the same in both runs, each cache read back (bytes times its scale) approximates the other,
    saturated at 448 * scale, within e4m3's rounding (2^-4 relative each, 2^-3 together, plus scale 1.0's
    subnormal step 2^-9 below 2^-6): the scale divides on store and multiplies on read."""
    fp8, _ = fp8_ckpt
    caches = []
    for name, scales in (("s", SCALES), ("one", [(1.0, 1.0)] * len(SCALES))):
        llm = LLM(
            str(with_kv_scales(fp8, tmp_path / name, scales)), dtype="float32", cpu_kv_cache_bytes=1 << 22
        )
        llm.generate(PROMPTS[3:], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        caches.append([c.clone() for c in llm.engine.executor.worker.runner.kv_caches])
        llm.shutdown()
    for layer, ((ks, vs), c_s, c_1) in enumerate(zip(SCALES, *caches)):
        assert c_s.dtype == torch.float8_e4m3fn
        used = c_1.float().abs().sum(dim=(0, 2, 3, 4)) > 0  # the blocks the prompt wrote
        for kind, scale in ((0, ks), (1, vs)):
            a, b = c_s[kind][used].double() * scale, c_1[kind][used].double().clamp(-448 * scale, 448 * scale)
            assert not torch.equal(c_s[kind].view(torch.uint8), c_1[kind].view(torch.uint8)), layer
            if layer > 0:  # its keys and values come from the layer before, whose cache differed
                continue
            assert ((a - b).abs() <= 0.13 * b.abs() + 2**-9).all(), (layer, kind, (a - b).abs().max())


def _set(name: str, value):
    return lambda tensors, cfg: tensors.__setitem__(name, value)


def _scheme(**update):
    return lambda tensors, cfg: cfg["quantization_config"]["kv_cache_scheme"].update(update)


K0, V1 = "model.layers.0.self_attn.k_scale", "model.layers.1.self_attn.v_scale"
REFUSED = {  # edit -> what the one line names
    "missing": (lambda tensors, cfg: tensors.pop(V1), f"lacks {V1}"),
    "zero": (_set(K0, torch.tensor([0.0])), f"{K0} (shape [1]) does not fit"),
    "negative": (_set(K0, torch.tensor([-0.01])), "positive and finite, not -0.01"),
    "nan": (_set(K0, torch.tensor([float("nan")])), "positive and finite, not nan"),
    "per-head": (_set(K0, torch.tensor([0.01, 0.02])), f"{K0} (shape [2]) does not fit"),
    "both names": (_set("model.layers.0.self_attn.k_proj.output_scale", torch.tensor([0.01])), "one tensor"),
    "dynamic": (_scheme(dynamic=True), "kv_cache_scheme.dynamic is true"),
    "per-head scheme": (_scheme(strategy="attn_head"), "kv_cache_scheme.strategy is 'attn_head'"),
    "int8": (_scheme(type="int"), "kv_cache_scheme is 8-bit int"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_bad_kv_scales_fail_start_up_in_one_line(
    case: str, fp8_ckpt: tuple[Path, Path], tmp_path: Path
) -> None:
    edit, needle = REFUSED[case]
    path = with_kv_scales(fp8_ckpt[0], tmp_path / "bad", edit=edit)
    with pytest.raises(TurnoutError) as e:
        LLM(str(path), dtype="float32", cpu_kv_cache_bytes=1 << 22)
    msg = str(e.value)
    assert "\n" not in msg and needle in msg, msg


@pytest.mark.parametrize("requested", ["auto", "fp8"])
def test_explain_says_where_the_fp8_cache_comes_from(
    requested: str, fp8_ckpt: tuple[Path, Path], tmp_path: Path, capsys
) -> None:
    """kv_cache_dtype auto becomes fp8 for such a checkpoint, as in vLLM, and explain says why; fp8 stays,
    with the checkpoint's scales; the model-dtype cache of an FP8 checkpoint without them stays auto."""
    path = str(with_kv_scales(fp8_ckpt[0], tmp_path / "ckpt"))
    assert main(["explain", "--model", path, "--kv-cache-dtype", requested, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    kv = doc["kv_cache_dtype"]
    assert (kv["requested"], kv["chosen"], kv["dtype"]) == (requested, "fp8", "float8_e4m3fn"), kv
    assert "k_scale / v_scale from the checkpoint" in kv["why"]
    assert ("kv_cache_scheme" in kv["why"]) == (requested == "auto"), kv
    assert any("checkpoint's per-layer k_scale / v_scale" in n for n in doc["quantization"]["layers"])
    if requested == "auto":
        assert doc["settings"]["kv_cache_dtype"]["source"].startswith("fitted: auto: the checkpoint's")
    assert main(["explain", "--model", path, "--kv-cache-dtype", requested]) == 0
    assert "KV cache: float8_e4m3fn (kv_cache_dtype fp8: " in capsys.readouterr().out
    assert main(["explain", "--model", str(fp8_ckpt[0]), "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["kv_cache_dtype"]
    assert (plain["chosen"], plain["why"]) == ("auto", None), plain
