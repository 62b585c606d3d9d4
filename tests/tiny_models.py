"""Tiny random-weight checkpoints written with HF transformers: the reference for parity tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TOKENIZER_VOCAB = 512


def write_tokenizer(path: Path) -> None:
    """Write a small word-level tokenizer to path, so text prompts work without network access."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(TOKENIZER_VOCAB - len(vocab)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)


def save_random_model(path: Path, config, wide_norms: bool = False) -> None:
    """A random-weight checkpoint of `config` (a transformers config) at path, seed 0: weights N(0, 0.2), so
    that logits are far from ties, and where wide_norms 1-D ones N(0, 0.1) (GemmaRMSNorm scales by 1 + w, w
    initialised to 0)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            elif wide_norms:
                p.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)


def make_tiny_model(
    path: Path, arch: str = "llama", num_kv_heads: int = 2, seed: int = 0, **overrides
) -> Path:
    """Write config.json + model.safetensors (float32) + tokenizer for a 2-layer random model."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    configs = {"llama": LlamaConfig, "qwen3": Qwen3Config, "qwen2": Qwen2Config, "qwen3_moe": Qwen3MoeConfig}
    cls = configs[arch]
    if arch in ("qwen3", "qwen3_moe"):
        common.setdefault("head_dim", 16)
    config = cls(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; widen it so logits are far from ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int, **load) -> list[list[int]]:
    """Each prompt alone through HF's forward, float32, argmax at every step, EOS not special: the
    reference for `ignore_eos=True` greedy runs. load: from_pretrained's further arguments."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load).eval()
    outs = []
    for p in prompts:
        ids = list(p)
        with torch.no_grad():
            for _ in range(max_new_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        outs.append(ids[len(p) :])
    return outs


def hf_greedy_cached(path: Path, prompts: list[list[int]], max_new_tokens: int, **load) -> list[list[int]]:
    """HF's greedy tokens through its KV cache, float32, EOS not special: the prefill, then one token a
    forward, prompts of one length as one batch. The reference where rope depends on the forward's last
    position (dynamic NTK, LongRoPE); `load` goes to from_pretrained (attn_implementation=...)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load).eval()
    outs: dict[int, list[int]] = {}
    for n in sorted({len(p) for p in prompts}):
        rows = [i for i, p in enumerate(prompts) if len(p) == n]
        ids, cache, new = torch.tensor([prompts[i] for i in rows]), None, []
        with torch.no_grad():
            for _ in range(max_new_tokens):
                res = model(ids, cache=cache, use_cache=True)
                cache, ids = res.past_key_values, res.logits[:, -1:].argmax(-1)
                new.append(ids)
        outs.update(zip(rows, torch.cat(new, 1).tolist()))
    return [outs[i] for i in range(len(prompts))]


def chat_prompts(llm, questions: list[str]) -> list[list[int]]:
    """Each question as one user turn through llm's chat template, as token ids."""
    tok = llm.get_tokenizer()
    chats = [[{"role": "user", "content": q}] for q in questions]
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def teacher_forced_agreement(llm, prompts: list[list[int]], conts: list[list[int]]) -> tuple[int, int]:
    """(steps where llm's argmax is the next token of conts, steps), each of conts
    teacher-forced after its prompt through prompt_logprobs."""
    from turnout import SamplingParams

    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([p + c for p, c in zip(prompts, conts)], score, use_tqdm=False)
    steps = [
        (max(o.prompt_logprobs[len(p) + i].items(), key=lambda kv: kv[1].logprob)[0], t)
        for p, c, o in zip(prompts, conts, outs)
        for i, t in enumerate(c)
    ]
    return sum(a == b for a, b in steps), len(steps)


def checkpoints(mktemp, write, reference):
    """checkpoint(case) -> (write(folder, case), reference(that path)), each case written once."""
    made: dict[str, tuple[Path, list[list[int]]]] = {}

    def get(case: str) -> tuple[Path, list[list[int]]]:
        if case not in made:
            path = write(mktemp(case), case)
            made[case] = path, reference(path)
        return made[case]

    return get


def assert_matches_reference(llm, path: Path, ref: list[list[int]], prompts: list[list[int]], greedy, **kw):
    """llm's greedy tokens for prompts equal ref: batched, then each prompt again alone (every one a prefix
    hit), then in a second engine on path with chunked prefill (a 16-token budget)."""
    from turnout import LLM

    tokens = lambda e: [o.token_ids for o in e.generate(prompts, greedy, use_tqdm=False)]  # noqa: E731
    assert tokens(llm) == ref
    for p, r in zip(prompts, ref):
        out = llm.generate([p], greedy, use_tqdm=False)[0]
        assert out.token_ids == r and out.num_cached_tokens >= len(p) - 4, out.num_cached_tokens
    chunked = LLM(str(path), max_num_batched_tokens=16, max_num_seqs=4, **kw)
    assert max(map(len, prompts)) > 16 and tokens(chunked) == ref


def assert_parallel_matches_reference(path: Path, ref, prompts, greedy, parallel: dict, **kw) -> None:
    """Under parallel (ranks over gloo), chunked prefill on four prompts equals ref, then two of them again
    as prefix hits."""
    from turnout import LLM

    llm = LLM(str(path), max_num_batched_tokens=16, **parallel, **kw)
    try:
        assert [o.token_ids for o in llm.generate(prompts[:4], greedy, use_tqdm=False)] == ref[:4]
        again = llm.generate(prompts[:2], greedy, use_tqdm=False)
        assert [o.token_ids for o in again] == ref[:2] and all(o.num_cached_tokens >= 8 for o in again)
    finally:
        llm.shutdown()


def dequantized_checkpoint(src: Path, dst: Path) -> Path:
    """The independent reference of an FP8 checkpoint: every FP8 weight times its scale by the format's
    formula in float64 (w[i, j] = q[i, j] * s[i // bn, j // bk], or a row's or the tensor's scale),
    written as float32 without quantization_config, for HF transformers to load."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from turnout.loader.weights import weight_files

    src, dst = Path(src), Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    block = qc.get("weight_block_size")
    if qc["quant_method"] == "compressed-tensors":
        w = next(iter(qc["config_groups"].values()))["weights"]
        block = w.get("block_structure") if w["strategy"] == "block" else None
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path in weight_files(src):
        with safe_open(str(path), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    out = {}
    for name, t in tensors.items():
        if name.endswith(("_scale", "_scale_inv")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            stem = name.removesuffix(".weight")
            s = tensors.get(f"{stem}.weight_scale_inv", tensors.get(f"{stem}.weight_scale")).double()
            n, k = t.shape
            if block:
                s = s.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
            else:
                s = s.reshape(-1, 1) if s.numel() == n and n > 1 else s.reshape(1, 1)
            t = t.double() * s
        out[name] = t.float()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "generation")):
            (dst / f.name).write_bytes(f.read_bytes())
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return dst
