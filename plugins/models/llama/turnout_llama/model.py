from turnout.models import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Plain pre-norm decoder; `attention_bias` in config.json turns on qkv bias."""
