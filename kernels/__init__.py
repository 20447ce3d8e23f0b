"""Paged-attention and CPU kernels, one folder per backend.

- ``reference.py``: the torch reference of paged attention (the test oracle).
- ``triton/``: the CUDA kernels (``reshape_and_cache``, paged attention).
- ``cpu/``: the CPU path: ``torch_attention.py`` over ``attention_plan.py`` (torch ops and the
  step's plan), ``native.py`` (builds and loads the C library from ``csrc/``) and ``ops.py``
  (its attention, RMSNorm and GEMM wrappers and the weight packing).

``kernels/`` imports only ``shared/`` and ``kernels/``. Nothing here queries CUDA at import time.
"""
