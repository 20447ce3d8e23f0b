"""Triton kernels of the CUDA attention backend: ``cache.py`` (``reshape_and_cache``),
``attention.py`` (paged attention launches) over ``attention_kernels.py`` (the jit kernels),
``utils.py`` (planned launches, compiling them for a GPU target without one)."""
