"""HF transformers' reading of a llama GGUF file, the reference for turnout's conversion: transformers' GGUF
config and llama un-permutation with gguf-py's dequantization and HF<->GGUF name map. transformers' full
load_gguf_checkpoint path gives the same tensors, and spends ~9 s more building its name map for 30 layers.
Each is read once a session (6-8 s on 2 cores, mostly gguf-py parsing the vocabulary) and shared: callers
only read the tensors and the model."""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np
import torch


@functools.cache
def hf_gguf_weights(gguf_path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(transformers' config of the file, {HF parameter name: float32 tensor})."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, load_gguf_checkpoint

    config = load_gguf_checkpoint(str(gguf_path))["config"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    processor, tensors = LlamaTensorProcessor(config=config), {}
    for t in gguf.GGUFReader(gguf_path).tensors:
        tensors[t.name] = torch.from_numpy(
            np.array(processor.process(gguf.quants.dequantize(t.data, t.tensor_type), t.name).weights)
        )
    return config, {hf: tensors.pop(names.get_name(hf, try_suffixes=(".weight",))) for hf in _names(config)}


@functools.cache
def hf_llama_from_gguf(gguf_path: Path) -> torch.nn.Module:
    """transformers' LlamaForCausalLM in float32 holding hf_gguf_weights, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config, weights = hf_gguf_weights(gguf_path)
    model = LlamaForCausalLM(LlamaConfig(**config)).float().eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model


def _names(config: dict) -> list[str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    return [k for k in model.state_dict() if k != "lm_head.weight" or not config["tie_word_embeddings"]]
