"""The CPU fast path: linear methods that keep bf16 weights prepacked for oneDNN (``onednn.py``) or
in the native GEMM's panels (``panels.py``), and every decoder layer of a bf16 Llama-family model
in one C call (``native_layers.py``). ``layers/selection.py`` decides, once per model, which serve."""
