"""Architectures (``config.json``'s ``architectures``) -> the model class that implements them.

Classes are imported when first asked for, so a process loads only its model's module.
"""

from __future__ import annotations

import importlib
from typing import Any

from services.executor.models.hf_config import architectures_of, config_value

# architecture name in config.json -> "module:Class" under services.executor.models. Mistral,
# Qwen2 and Qwen3 are Llama with small differences (a sliding window, q/k/v biases, q/k norms).
MODEL_CLASSES: dict[str, str] = {
    "LlamaForCausalLM": "llama:LlamaForCausalLM",
    "MistralForCausalLM": "llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "llama:LlamaForCausalLM",
    "GPT2LMHeadModel": "gpt2:GPT2LMHeadModel",
    "OPTForCausalLM": "opt:OPTForCausalLM",
    "Phi3ForCausalLM": "phi3:Phi3ForCausalLM",
    "GPTNeoXForCausalLM": "gpt_neox:GPTNeoXForCausalLM",
    "FalconForCausalLM": "falcon:FalconForCausalLM",
    "GemmaForCausalLM": "gemma:GemmaForCausalLM",
    "Gemma2ForCausalLM": "gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "gemma:Gemma3ForCausalLM",
    "MixtralForCausalLM": "mixtral:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "qwen_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "qwen_moe:Qwen3MoeForCausalLM",
}


def supported_architectures() -> list[str]:
    """Every ``architectures`` value this engine loads, sorted."""
    return sorted(MODEL_CLASSES)


def get_model_class(hf_config: Any) -> type:
    """The model class for ``hf_config.architectures`` (without that entry: for its
    ``model_type``, as ``AutoModelForCausalLM`` picks it).

    Raises:
        ValueError: the architecture is not supported (the message names it and lists the
            supported ones).
    """
    archs = architectures_of(hf_config)
    for arch in archs:
        target = MODEL_CLASSES.get(arch)
        if target is not None:
            module, cls = target.split(":")
            return getattr(importlib.import_module(f"services.executor.models.{module}"), cls)
    supported = ", ".join(supported_architectures())
    if not archs:
        model_type = config_value(hf_config, "model_type")
        raise ValueError(f"the model's config.json has no 'architectures' entry, and model_type={model_type!r} "
                         f"is none of this engine's; supported architectures: {supported}")
    raise ValueError(f"unsupported model architecture {archs!r}; supported: {supported}")
