from turnout.models import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    qk_norm = True


class Qwen2ForCausalLM(DecoderForCausalLM):
    qkv_bias = True
