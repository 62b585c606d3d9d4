"""On a CUDA machine only: the bundled Mistral, Mixtral, Gemma 2, Gemma 3 and DeepSeek-V2 plugins agree with
HF transformers (bf16, the same GPU) step by step on the same history, under the default selection, over
prompts longer than every sliding window. DeepSeek-V2 runs at DeepSeek-V2-Lite's attention widths, so its
latent KV cache goes through the Triton kernels' latent tiles (512 + 64 values a token)."""

from __future__ import annotations

import random

import pytest
import torch

from turnout import LLM, SamplingParams

from tiny_models import TOKENIZER_VOCAB, write_tokenizer

pytestmark = pytest.mark.gpu

WINDOW = 32
COMMON = dict(
    vocab_size=TOKENIZER_VOCAB, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
    max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, sliding_window=WINDOW,
    tie_word_embeddings=False,
)  # fmt: skip
MLA = dict(
    vocab_size=TOKENIZER_VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    topk_method="greedy", first_k_dense_replace=1, max_position_embeddings=1024, bos_token_id=1,
    eos_token_id=2, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
)  # fmt: skip
CONFIGS = {  # the model's HF config class and its keys
    "mistral": ("MistralConfig", COMMON | dict(intermediate_size=512, num_hidden_layers=2)),
    "mixtral": ("MixtralConfig", COMMON | dict(intermediate_size=128, num_hidden_layers=2,
                                               num_local_experts=4, num_experts_per_tok=2)),
    "gemma2": ("Gemma2Config", COMMON | dict(intermediate_size=512, num_hidden_layers=3,
                                             query_pre_attn_scalar=128, attn_logit_softcapping=30.0,
                                             final_logit_softcapping=20.0)),
    "gemma3": ("Gemma3TextConfig", COMMON | dict(intermediate_size=512, num_hidden_layers=3,
                                                 query_pre_attn_scalar=128,
                                                 layer_types=["sliding_attention"] * 2 + ["full_attention"])),
    "deepseek_v2": ("DeepseekV2Config", MLA),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    import transformers

    cls, keys = CONFIGS[request.param]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**keys))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path


def test_model_agrees_with_hf_step_by_step(checkpoint) -> None:
    from transformers import AutoModelForCausalLM

    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, TOKENIZER_VOCAB) for _ in range(rng.randint(WINDOW + 8, 200))] for _ in range(8)
    ]
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).cuda().eval()
    forced, want = [], []
    with torch.no_grad():
        for p in prompts:
            gen = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=16, min_new_tokens=16,
                              do_sample=False, pad_token_id=0)[0]  # fmt: skip
            cont = gen[len(p) :].tolist()
            forced += [p + cont[:i] for i in range(len(cont))]
            want += cont
    llm = LLM(str(checkpoint), dtype="bfloat16", gpu_memory_utilization=0.3, max_num_batched_tokens=256)
    got = [
        o.token_ids[0]
        for o in llm.generate(forced, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    ]
    llm.shutdown()
    rate = sum(a == b for a, b in zip(got, want)) / len(want)
    assert rate >= 0.95, rate
