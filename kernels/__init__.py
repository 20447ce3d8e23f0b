"""Paged-attention, matmul, quantization and sampling kernels, one folder per backend.

- ``reference.py``: the torch reference of paged attention (the test oracle; the quantization
  kernels' references are the layers': ``layers/quantization/int4.py``'s ``Int4Weights``,
  ``layers/quantization/gguf/formats.py``'s ``dequantize``).
- ``triton/``: the CUDA kernels (``reshape_and_cache``, paged attention, the fused MoE GEMM, and
  the quantized matmuls ``triton/gemm_w4.py`` (int4 groups) and ``triton/gemm_gguf.py`` (GGUF
  blocks)).
- ``cpu/``: the CPU path: ``torch_attention.py`` over ``attention_plan.py`` (torch ops and the
  step's plan), ``native.py`` (builds and loads the C library from ``csrc/``), ``ops.py``
  (its attention, RMSNorm and GEMM wrappers and the weight packing), ``cpu/quant_ops.py`` (its
  int4 and GGUF matmuls: ``csrc/cpu_gemm_w4.c``, ``csrc/cpu_gguf_*.c``) and
  ``cpu/sampling_ops.py`` (its sampling kernels).

A GGUF kernel is handed its block format (a ``BlockFormat`` of
``services/executor/layers/quantization/gguf/formats.py``, the one table of them) by its caller.

``kernels/`` imports only ``shared/`` and ``kernels/``. Nothing here queries CUDA at import time.
"""
