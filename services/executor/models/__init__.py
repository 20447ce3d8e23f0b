"""Model implementations of the executor, chosen by the Hugging Face ``architectures`` entry
(``registry.py``), built from the layer library (``services/executor/layers/``); ``hf_config.py``
reads the config, ``base.py`` holds what every architecture shares. The weights are read by
``services/executor/model_loader/`` (safetensors and GGUF)."""

from __future__ import annotations

from services.executor.models.hf_config import check_supported, kv_cache_bytes_per_block, kv_cache_shape
from services.executor.models.llama import LlamaForCausalLM
from services.executor.models.registry import MODEL_CLASSES, get_model_class

__all__ = ["MODEL_CLASSES", "LlamaForCausalLM", "check_supported", "get_model_class", "kv_cache_bytes_per_block",
           "kv_cache_shape"]
