"""Reading a model's weights from disk into the model built for them (vLLM's ``model_loader``):

- ``loader.py``: a Hugging Face safetensors checkpoint, read with ``pread`` in chunks through each
  parameter's ``weight_loader``;
- ``gguf_loader.py``: a GGUF file, its blocks handed to the GGUF methods the model was built
  with; ``gguf_tensors.py`` maps each GGUF architecture's tensors onto our modules and reads the
  file's formats into a ``GGUFConfig`` (:func:`quantization_config`) from its header
  (``gguf_header.py``: the tensor types alone, in milliseconds); ``gguf_shards.py`` takes a
  tensor-parallel rank's share of a tensor, blocks kept.

The models (``services/executor/models/``) call :func:`loader.load_weights` or
:func:`gguf_loader.load_gguf_weights` from their ``load_weights``; whoever builds a model first
asks :func:`quantization_config` for the ``quant_config`` it is built with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.executor.layers.quantization import QuantizationConfig, get_quantization_config
from services.executor.model_loader.gguf_loader import gguf_file
from services.executor.model_loader.gguf_tensors import gguf_quant_config

__all__ = ["gguf_quant_config", "quantization_config"]


def quantization_config(model_dir: Path | str, hf_config: Any, requested: str | None = None) -> QuantizationConfig | None:
    """The quantization the model of ``model_dir`` is built with: the GGUF file's formats when the
    directory is served from one (``model.gguf``), else the checkpoint's ``quantization_config``
    (None: not quantized), checked against ``requested`` (``Settings.quantization``).

    Raises:
        ValueError: as :func:`get_quantization_config`; a GGUF file asked to be read as another
            quantization, or of an architecture not served from GGUF.
    """
    gguf = gguf_file(model_dir)
    if gguf is None:
        return get_quantization_config(hf_config, requested)
    if requested not in (None, "gguf"):
        raise ValueError(f"quantization={requested!r} was asked for, but the model is a GGUF file ({gguf})")
    return gguf_quant_config(gguf)
