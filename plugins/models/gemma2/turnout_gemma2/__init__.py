"""Gemma 2 (2B, 9B, 27B): attention layers alternate a sliding window with global attention and cap their
scores, so the architecture declares those per-layer features and selection picks a backend that serves
them."""

from turnout import hookimpl
from turnout.models import ModelArchitecture


def layer_types(cfg: dict) -> list[str]:
    """Each layer's kind, "sliding_attention" or "full_attention": config.json's layer_types, or Gemma 2's
    alternation (sliding first) where an older config lacks them."""
    n = cfg["num_hidden_layers"]
    return cfg.get("layer_types") or ["full_attention" if i % 2 else "sliding_attention" for i in range(n)]


def attention_features(cfg: dict) -> set[str]:
    """What the layers use for this checkpoint: a window on the sliding layers, a soft-cap on every layer."""
    used = set()
    if cfg.get("sliding_window") and "sliding_attention" in layer_types(cfg):
        used.add("sliding_window")
    if cfg.get("attn_logit_softcapping"):
        used.add("logits_soft_cap")
    return used


@hookimpl
def turnout_model_architectures() -> list[ModelArchitecture]:
    target = "turnout_gemma2.model:Gemma2ForCausalLM"
    return [ModelArchitecture("Gemma2ForCausalLM", target, attention_features=attention_features)]
