"""Gemma 3 text (1B, and the language model of 4B, 12B, 27B as Gemma3ForCausalLM): local layers attend
within a sliding window, every sliding_window_pattern-th layer globally, so the architecture declares the
window and selection picks a backend that serves it."""

from turnout import hookimpl
from turnout.models import ModelArchitecture


def layer_types(cfg: dict) -> list[str]:
    """Each layer's kind, "sliding_attention" (local) or "full_attention" (global): config.json's layer_types,
    or where an older config lacks them, layer i global when (i + 1) is a multiple of sliding_window_pattern
    (default 6: five local layers to one global), as HF's Gemma3TextConfig reads it."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    every = cfg.get("sliding_window_pattern") or 6
    return [
        "full_attention" if (i + 1) % every == 0 else "sliding_attention"
        for i in range(cfg["num_hidden_layers"])
    ]


def attention_features(cfg: dict) -> set[str]:
    """What the layers use for this checkpoint: a window on the local layers, a soft-cap where one is set."""
    used = set()
    if cfg.get("sliding_window") and "sliding_attention" in layer_types(cfg):
        used.add("sliding_window")
    if cfg.get("attn_logit_softcapping"):
        used.add("logits_soft_cap")
    return used


@hookimpl
def turnout_model_architectures() -> list[ModelArchitecture]:
    """Gemma3ForCausalLM, with tensor and pipeline parallelism."""
    target = "turnout_gemma3.model:Gemma3ForCausalLM"
    return [ModelArchitecture("Gemma3ForCausalLM", target, attention_features=attention_features)]
