"""The bundled Mistral, Mixtral and Gemma 2 plugins generate like HF transformers (float32, each prompt alone,
eager attention): greedy tokens exactly, over prompts longer than every sliding window, batched and one at
a time, with and without chunked prefill, on prefix-cache hits, and under tensor parallelism (Mixtral's
experts split over the ranks by expert parallelism)."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from turnout import LLM, SamplingParams, TurnoutError

from tiny_models import TOKENIZER_VOCAB, _tokenizer

WINDOW = 8
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
KW = {"dtype": "float32", "cpu_kv_cache_bytes": 1 << 22, "block_size": 4}
COMMON = dict(
    vocab_size=TOKENIZER_VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=512, bos_token_id=1, eos_token_id=2, sliding_window=WINDOW,
    tie_word_embeddings=False,
)  # fmt: skip
CONFIGS = {  # plugin -> (HF config class, its own keys); Gemma 2's 3 layers: sliding, full, sliding
    "mistral": ("MistralConfig", dict(intermediate_size=128, num_hidden_layers=2)),
    "mixtral": ("MixtralConfig", dict(intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                                      num_experts_per_tok=2)),
    "gemma2": ("Gemma2Config", dict(intermediate_size=128, num_hidden_layers=3, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=3.0, final_logit_softcapping=5.0)),
}  # fmt: skip
ARCH = {"mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM", "gemma2": "Gemma2ForCausalLM"}

_rng = random.Random(7)
PROMPTS = [[_rng.randrange(3, TOKENIZER_VOCAB) for _ in range(_rng.randrange(10, 40))] for _ in range(8)]
assert min(map(len, PROMPTS)) > WINDOW


def _write(path: Path, plugin: str) -> Path:
    """A tiny random checkpoint, weights (and Gemma's norms) widened so that logits are far from ties."""
    import transformers

    cls, own = CONFIGS[plugin]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**COMMON, **own))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            elif plugin == "gemma2":  # GemmaRMSNorm scales by 1 + w, w initialised to 0
                p.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer(path)
    return path


def _hf_greedy(path: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    outs = []
    for p in PROMPTS:
        ids = list(p)
        with torch.no_grad():
            for _ in range(MAX_NEW):
                ids.append(int(model.eval()(torch.tensor([ids])).logits[0, -1].argmax()))
        outs.append(ids[len(p) :])
    return outs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """checkpoint(plugin) -> (its tiny checkpoint, HF's greedy tokens for PROMPTS), each written once."""
    made: dict[str, tuple[Path, list[list[int]]]] = {}

    def get(plugin: str) -> tuple[Path, list[list[int]]]:
        if plugin not in made:
            path = _write(tmp_path_factory.mktemp(plugin), plugin)
            made[plugin] = path, _hf_greedy(path)
        return made[plugin]

    return get


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("plugin", list(CONFIGS))
def test_greedy_matches_hf(checkpoint, plugin: str) -> None:
    """Batched, then each prompt again alone (every one a prefix hit), then chunked by a 16-token budget."""
    path, ref = checkpoint(plugin)
    llm = LLM(str(path), **KW)
    assert (llm.selection.model.chosen.name, llm.selection.model.chosen.plugin) == (ARCH[plugin], plugin)
    assert _tokens(llm, PROMPTS) == ref
    for p, r in zip(PROMPTS, ref):
        out = llm.generate([p], GREEDY, use_tqdm=False)[0]
        assert out.token_ids == r and out.num_cached_tokens >= len(p) - 4, out.num_cached_tokens
    chunked = LLM(str(path), max_num_batched_tokens=16, max_num_seqs=4, **KW)
    assert max(map(len, PROMPTS)) > 16 and _tokens(chunked, PROMPTS) == ref


PARALLEL = [  # the parallelism each model adds to the shared decoder's (test_multiproc runs its TP 2)
    pytest.param("mixtral", dict(tensor_parallel_size=2, enable_expert_parallel=True), id="mixtral-tp2-ep"),
    pytest.param("gemma2", dict(tensor_parallel_size=2), id="gemma2-tp2"),
    pytest.param("gemma2", dict(pipeline_parallel_size=2), id="gemma2-pp2"),
]


@pytest.mark.parametrize("plugin,parallel", PARALLEL)
def test_parallel_matches_hf(checkpoint, plugin: str, parallel: dict) -> None:
    """Two ranks over gloo, chunked prefill on four prompts, then two of them again as prefix hits."""
    path, ref = checkpoint(plugin)
    llm = LLM(str(path), max_num_batched_tokens=16, **parallel, **KW)
    try:
        assert _tokens(llm, PROMPTS[:4]) == ref[:4]
        again = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        assert [o.token_ids for o in again] == ref[:2] and all(o.num_cached_tokens >= 8 for o in again)
    finally:
        llm.shutdown()


WRONG = [  # config.json key, a value Gemma2ForCausalLM does not implement, the line that says so
    ("hidden_activation", "relu", "sets hidden_activation = 'relu', which Gemma2ForCausalLM does not"),
    ("rope_parameters", {"rope_type": "proportional"}, "config.json's rope_parameters: .*'proportional'"),
]


@pytest.mark.parametrize("key,value,why", WRONG, ids=[w[0] for w in WRONG])
def test_gemma2_refuses_what_it_does_not_implement(checkpoint, tmp_path: Path, key, value, why) -> None:
    """One line naming the config key, before any weight loads."""
    path = Path(shutil.copytree(checkpoint("gemma2")[0], tmp_path / "ckpt"))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, key: value}))
    with pytest.raises(TurnoutError, match=why):
        LLM(str(path), **KW)


MISSING = [  # a checkpoint tensor that fills part of a fused parameter: taken out, start-up names it
    ("mixtral", "model.layers.1.block_sparse_moe.experts.2.w3.weight"),
    ("gemma2", "model.layers.0.self_attn.k_proj.weight"),
]


@pytest.mark.parametrize("plugin,tensor", MISSING, ids=[m[0] for m in MISSING])
def test_a_checkpoint_missing_a_part_is_refused_naming_it(checkpoint, tmp_path: Path, plugin, tensor) -> None:
    from safetensors.torch import load_file, save_file

    path = Path(shutil.copytree(checkpoint(plugin)[0], tmp_path / "ckpt"))
    tensors = load_file(path / "model.safetensors")
    del tensors[tensor]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TurnoutError, match=f"the checkpoint lacks {re.escape(tensor)}, "):
        LLM(str(path), **KW)
