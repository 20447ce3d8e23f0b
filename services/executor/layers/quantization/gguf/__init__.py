"""GGUF files' quantization: the fifth registered method (``quant_method: "gguf"``), whose blocks
of the kept formats stay quantized in memory and are dequantized inside the matmul.

- ``formats.py``: the block formats, one :class:`BlockFormat` registry (``FORMATS``) that every
  consumer reads (the 16-row interleave, the methods, the loader, the Triton kernels and the C
  bindings, handed a format by their caller), and their dequantization in torch (the kernels'
  reference, the long-prefill path);
- ``r16.py``: the 16-row interleaved layout of the int8 VNNI kernels;
- ``linear.py``: :class:`GGUFLinearMethod`, :class:`GGUFShardedLinearMethod` (a merged layer
  of several formats);
- ``moe.py``: :class:`GGUFMoEMethod`, a ``FusedMoE``'s experts matmul by matmul;
- ``config.py``: :class:`GGUFConfig`, read from the file's header before the model is built
  (``services/executor/model_loader/``), which gives each layer its method at build time.

A format of another kind is added in ``formats.py``, with its kernels in
``kernels/cpu/csrc/cpu_gguf_*.c`` (an ABI bump) and ``kernels/triton/gemm_gguf.py``.
"""

from services.executor.layers.quantization.gguf.config import GGUFConfig
from services.executor.layers.quantization.gguf.formats import (
    FORMATS,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_0,
    BlockFormat,
    dequantize,
    kept,
)
from services.executor.layers.quantization.gguf.linear import (
    NATIVE_MAX_ROWS,
    GGUFLinearMethod,
    GGUFShardedLinearMethod,
)
from services.executor.layers.quantization.gguf.moe import GGUFMoEMethod, kept_formats

__all__ = ["FORMATS", "NATIVE_MAX_ROWS", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "BlockFormat", "GGUFConfig",
           "GGUFLinearMethod", "GGUFMoEMethod", "GGUFShardedLinearMethod", "dequantize", "kept", "kept_formats"]
