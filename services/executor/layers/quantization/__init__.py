"""Quantized weights: a :class:`QuantizationConfig` whose methods the models take for their layers
when they build them (:func:`linear_method_for`, :func:`moe_method_for`, :func:`layer_method_for`).

Five methods (:data:`QUANTIZATION_METHODS`), one module or package each: ``gptq.py``, ``awq.py``,
``compressed_tensors.py``, ``fp8.py`` read ``config.json``'s ``quantization_config`` (detected
from the checkpoint, as vLLM does; ``Settings.quantization``, vLLM's ``--quantization``, only
confirms it), and the int4 formats share ``int4.py``'s layout; ``gguf/`` keeps a GGUF file's
blocks, its config read from the file's header (``services/executor/model_loader/``).

Their kernels: ``kernels/cpu/quant_ops.py`` (the C library's int4 and GGUF matmuls,
``kernels/cpu/csrc/cpu_gemm_w4.c`` and ``cpu_gguf_*.c``) on CPU, ``kernels/triton/gemm_w4.py``
and ``kernels/triton/gemm_gguf.py`` on CUDA; their torch references are here (``int4.py``'s
``Int4Weights``, ``gguf/formats.py``'s ``dequantize``).
"""

from __future__ import annotations

from typing import Any

from services.executor.layers.linear import LinearMethodBase
from services.executor.layers.quantization.awq import AWQConfig
from services.executor.layers.quantization.base import QuantizationConfig, QuantizedLinearMethod
from services.executor.layers.quantization.compressed_tensors import CompressedTensorsConfig
from services.executor.layers.quantization.fp8 import Fp8Config
from services.executor.layers.quantization.gguf import GGUFConfig
from services.executor.layers.quantization.gptq import GPTQConfig

#: quant_method -> its config class
QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {
    cls.name: cls for cls in (GPTQConfig, AWQConfig, CompressedTensorsConfig, Fp8Config, GGUFConfig)
}

__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "QuantizedLinearMethod", "get_quantization_config",
           "layer_method_for", "linear_method_for", "moe_method_for"]


def get_quantization_config(hf_config: Any, requested: str | None = None) -> QuantizationConfig | None:
    """The checkpoint's quantization (None: not quantized), checked against ``requested``
    (``Settings.quantization``; None: whatever the checkpoint says).

    Raises:
        ValueError: a method this engine does not implement, a setting the checkpoint does not
            match, or a config its method refuses (bits, format, ...); the message names it.
    """
    # (not models/hf_config.config_value: the models package imports this one)
    config = (hf_config.get if isinstance(hf_config, dict) else lambda k: getattr(hf_config, k, None))(
        "quantization_config")
    if config is not None and not isinstance(config, dict):
        config = config.to_dict()
    supported = ", ".join(sorted(QUANTIZATION_METHODS))
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={requested!r} is not supported (supported: {supported})")
    if not config:
        if requested is not None:
            raise ValueError(f"quantization={requested!r} was asked for, but the checkpoint's config.json "
                             "has no quantization_config")
        return None
    method = str(config.get("quant_method", "")).lower()
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"the checkpoint's quantization method {method!r} is not supported (supported: {supported})")
    if requested is not None and requested != method:
        raise ValueError(f"quantization={requested!r} was asked for, but the checkpoint is quantized with {method!r}")
    return QUANTIZATION_METHODS[method].from_config(config)


def linear_method_for(quant_config: QuantizationConfig | None, prefix: str,
                      shard_names: list[str] | None = None) -> LinearMethodBase | None:
    """The linear method of layer ``prefix`` (its checkpoint shards ``shard_names``) under
    ``quant_config``; None: unquantized (the kernel choice serves it)."""
    if quant_config is None:
        return None
    return quant_config.linear_method(prefix, shard_names or [])


def moe_method_for(quant_config: QuantizationConfig | None, prefix: str) -> Any | None:
    """The method of the ``FusedMoE`` named ``prefix`` under ``quant_config``; None: unquantized experts."""
    return None if quant_config is None else quant_config.moe_method(prefix)


def layer_method_for(quant_config: QuantizationConfig | None, prefix: str) -> LinearMethodBase | None:
    """The method of layer ``prefix`` that checkpoint quantization leaves unquantized (embedding, LM
    head, MoE router or gate) under ``quant_config``; None: unquantized (a GGUF file may keep it)."""
    return None if quant_config is None else quant_config.layer_method(prefix)
