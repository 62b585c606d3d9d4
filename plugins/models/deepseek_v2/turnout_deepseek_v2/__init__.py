"""DeepSeek-V2 (DeepSeek-V2, -V2-Lite, -V2.5 and their chat models): multi-head latent attention in absorbed
form over the latent KV cache (kv_lora_rank + qk_rope_head_dim values a token and layer, the "mla" spec), and
shared plus routed experts on turnout's FusedMoE."""

from turnout import hookimpl
from turnout.models import ModelArchitecture


@hookimpl
def turnout_model_architectures() -> list[ModelArchitecture]:
    """DeepseekV2ForCausalLM, with tensor, pipeline and expert parallelism."""
    target = "turnout_deepseek_v2.model:DeepseekV2ForCausalLM"
    return [ModelArchitecture("DeepseekV2ForCausalLM", target, expert_parallel=True)]
