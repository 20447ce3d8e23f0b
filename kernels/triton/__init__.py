"""Triton kernels of the CUDA backend: ``cache.py`` (``reshape_and_cache``), ``attention.py``
(paged attention launches) over ``attention_kernels.py`` (the jit kernels), ``fused_moe.py``
(the mixture-of-experts grouped GEMM), ``utils.py`` (planned launches, compiling them for a
GPU target without one)."""
