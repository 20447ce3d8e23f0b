"""The GGUF block formats this engine keeps quantized: one registry (:data:`FORMATS`, by ggml type
id) that every consumer reads instead of naming a ggml type itself — dequantization
(``dequant.py``), the 16-row interleave (``r16.py``), the linear and MoE methods, the GGUF loader
(``model_loader/``), the Triton kernels (``kernels/triton/gemm_gguf.py``) and the C bindings
(``kernels/cpu/quant_ops.py``). ``kernels/`` imports only ``shared/`` and ``kernels/``: the
kernels are handed a :class:`BlockFormat` by their caller and read its fields.

A GGUF quantized tensor ``[N, K]`` (rows = output features) is stored row by row, each row as
blocks of consecutive input elements: ``K / 32`` blocks of 32 (ggml's ``block_q4_0`` /
``block_q4_1`` / ``block_q8_0``) or ``K / 256`` super-blocks of 256 (the K-quants; their
arithmetic is that of gguf-py's ``quants.py``). The byte layouts are checked against
``gguf.quants.dequantize`` in ``tests/executor/test_gguf.py``:

========  =====  ===========================================================  ===============
type      bytes  layout                                                       value
========  =====  ===========================================================  ===============
Q4_0      18     fp16 ``d``, 16 bytes: element j in the low nibble of byte j,  ``d * (q - 8)``
                 element j + 16 in its high nibble
Q4_1      20     fp16 ``d``, fp16 ``m``, 16 bytes of nibbles as Q4_0           ``d * q + m``
Q8_0      34     fp16 ``d``, 32 int8                                           ``d * q``
Q4_K      144    fp16 ``d``, fp16 ``dmin``, 12 bytes: 6-bit ``sc[8]``, ``m[8]``  ``d sc[j] q - dmin m[j]``
                 (sub-block ``j`` of 32), 128 bytes: sub-block ``2 i`` in the
                 low nibbles of bytes ``32 i .. 32 i + 31``, ``2 i + 1`` high
Q5_K      176    as Q4_K with 32 bytes ``qh`` before the nibbles: bit ``j`` of  as Q4_K, q < 32
                 ``qh[e]`` is bit 4 of element ``e`` of sub-block ``j``
Q6_K      210    128 bytes ``ql`` (low 4 bits), 64 bytes ``qh`` (high 2),       ``d sc[i/16] (q - 32)``
                 16 int8 ``sc``, fp16 ``d``; element ``128 g + 32 s + e``:
                 ``ql[64 g + 32 (s%2) + e] >> 4 (s/2)``, ``qh[32 g + e] >> 2 s``
========  =====  ===========================================================  ===============

Any other type of a file (F32, F16, BF16, Q5_0, ...) is not kept: the loader dequantizes it
into the model's dtype with gguf-py (:func:`kept` gives ``None``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockFormat:
    """A GGML quantization type: its name, its id in the GGUF file (``gguf.GGMLQuantizationType``),
    elements and bytes per block, and what the kernels need of it.

    ``kernel_type``: the type code of the C kernels (``GGUF_Q4_0`` ... in
    ``kernels/cpu/csrc/pagedllm_abi.h``) and the Triton kernels' ``GGML_TYPE`` constexpr (ggml's
    id); ``None``: no kernel reads it (a format only dequantized). ``fp16_fields``: the byte
    offsets of the block's fp16 fields (``d``; Q4_1's ``m``; the K-quants' ``dmin``; Q6_K's ``d``
    last), which the 16-row interleave gathers first. ``int8_quants``: the quants are int8 (Q8_0),
    stored XOR 0x80 in the interleaved layout. ``r16``: has the 16-row interleaved layout
    (``r16.py``; ``cpu_gguf_r16.c``, ``cpu_gguf_r16k.c``).
    """

    name: str
    ggml_type: int
    block_size: int
    block_bytes: int
    kernel_type: int | None = None
    fp16_fields: tuple[int, ...] = ()
    int8_quants: bool = False
    r16: bool = False

    @property
    def k_quant(self) -> bool:
        """Super-blocks of 256 elements (Q4_K, Q5_K, Q6_K): the Triton K-quant kernel."""
        return self.block_size == 256

    def row_bytes(self, elements: int) -> int:
        """Bytes of ``elements`` consecutive elements of a row (a multiple of ``block_size``)."""
        return elements // self.block_size * self.block_bytes


Q4_0 = BlockFormat("Q4_0", 2, 32, 18, kernel_type=2, fp16_fields=(0,), r16=True)
Q4_1 = BlockFormat("Q4_1", 3, 32, 20, kernel_type=3, fp16_fields=(0, 2), r16=True)
Q8_0 = BlockFormat("Q8_0", 8, 32, 34, kernel_type=8, fp16_fields=(0,), int8_quants=True, r16=True)
Q4_K = BlockFormat("Q4_K", 12, 256, 144, kernel_type=12, fp16_fields=(0, 2), r16=True)
Q5_K = BlockFormat("Q5_K", 13, 256, 176, kernel_type=13, fp16_fields=(0, 2), r16=True)
Q6_K = BlockFormat("Q6_K", 14, 256, 210, kernel_type=14, fp16_fields=(208,), r16=True)
#: ggml type id -> the formats kept quantized (every one with a C, Triton and torch path)
FORMATS: dict[int, BlockFormat] = {f.ggml_type: f for f in (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)}


def kept(ggml_type: int) -> BlockFormat | None:
    """The format of a file tensor of ``ggml_type`` when it is kept quantized, else ``None``."""
    return FORMATS.get(int(ggml_type))
