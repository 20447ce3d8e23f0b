"""The executor's layer library, with the field's names (vLLM / nano-vllm), which the models are built from.

- ``linear.py``: ``ReplicatedLinear``, ``ColumnParallelLinear``, ``MergedColumnParallelLinear``
  (gate | up), ``QKVParallelLinear`` (q | k | v), ``RowParallelLinear``, and the linear
  method behind each (``LinearMethodBase``; the plain ``UnquantizedLinearMethod``); every
  parameter carries a ``weight_loader`` that knows where each checkpoint shard goes.
- ``embedding.py``: ``VocabParallelEmbedding``, ``ParallelLMHead`` (``compute_logits``).
- ``rotary_embedding.py``: ``get_rope`` (default and Llama 3.1 RoPE), ``apply_rope``.
- ``layernorm.py``: ``RMSNorm`` in its forms; ``activation.py``: ``SiluAndMul``;
  ``attention.py``: ``Attention`` over the step's attention backend.
- ``fused_moe.py``: ``FusedMoE`` (top-k routing, the experts' SwiGLU MLPs) and its ``quant_method``.
- ``quantization/``: the quantization methods the models take for their layers at build time
  (GPTQ, AWQ, compressed-tensors, FP8, and GGUF in ``quantization/gguf/``).
- ``cpu/``: the CPU fast path (oneDNN-prepacked and native-GEMM linear methods, every
  decoder layer in one C call); ``selection.py``: the one strategy that picks, per model at
  load time, which linear method, norm form and fast path serve.
- ``utils.py``: ``FastModule`` (no per-call module overhead) and the default weight loader.
"""
