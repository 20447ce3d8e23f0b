"""The CPU attention backend's kernels: torch ops (``torch_attention.py``, planned per step by
``attention_plan.py``) and the native C library (``csrc/``, built and loaded by ``native.py``,
called through ``ops.py``, ``quant_ops.py`` (the int4 and GGUF matmuls) and ``sampling_ops.py``)."""
