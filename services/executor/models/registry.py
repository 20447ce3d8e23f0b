"""Architectures (``config.json``'s ``architectures``) -> the model class that implements them."""

from __future__ import annotations

from typing import Any

from services.executor.models.hf_config import architectures_of, check_supported, config_value
from services.executor.models.llama import LlamaForCausalLM

# architecture name in config.json -> our class (Mistral and Qwen2 are Llama with small differences:
# Qwen2 has q/k/v biases, Mistral's sliding window is refused by check_supported)
MODEL_CLASSES: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def get_model_class(hf_config: Any) -> type:
    """The model class for ``hf_config.architectures`` (without that entry: for its
    ``model_type``, as ``AutoModelForCausalLM`` picks it).

    Raises:
        ValueError: the architecture is not supported (the message names it), or the config
            asks for something the implementation does not do (e.g. Mistral sliding window).
    """
    archs = architectures_of(hf_config)
    for arch in archs:
        cls = MODEL_CLASSES.get(arch)
        if cls is not None:
            check_supported(hf_config)
            return cls
    if not archs:
        model_type = config_value(hf_config, "model_type")
        raise ValueError(f"the model's config.json has no 'architectures' entry, and model_type={model_type!r} "
                         f"is none of this engine's; supported architectures: {sorted(MODEL_CLASSES)}")
    raise ValueError(f"unsupported model architecture {archs!r}; supported: {sorted(MODEL_CLASSES)}")
