"""Triton kernels of the CUDA backend: ``cache.py`` (``reshape_and_cache``), ``attention.py``
(paged attention launches) over ``attention_kernels.py`` (the jit kernels), ``fused_moe.py``
(the mixture-of-experts grouped GEMM), the quantized matmuls ``gemm_w4.py`` (int4 groups: GPTQ,
AWQ, compressed-tensors W4A16) and ``gemm_gguf.py`` (GGUF blocks, of the format its caller hands
in), ``utils.py`` (planned launches, compiling them for a GPU target without one). The CPU
side of the quantized matmuls is ``kernels/cpu/quant_ops.py``; the sampling kernels are
``kernels/cpu/sampling_ops.py``'s (CPU only)."""
