"""The linear method of GGUF blocks kept quantized (:class:`GGUFLinearMethod`), and of a merged
layer whose shards come in different formats (:class:`GGUFShardedLinearMethod`).

The model asks :class:`~services.executor.layers.quantization.gguf.config.GGUFConfig` for a
layer's method when it builds the layer, as it asks GPTQ's; the method registers an empty uint8
``weight`` then, and the GGUF loader hands it the file's blocks (:meth:`GGUFLinearMethod.load`:
this rank's rows, in ``formats.py``'s layouts).

The layer's ``weight`` is a uint8 parameter ``[N, K / block_size * block_bytes]``: whole rows, so
merged layers (q | k | v, gate | up) concatenate their shards' rows and rows can be permuted
without dequantizing (the loader does so before :meth:`GGUFLinearMethod.load`, which, with
the native kernels and AVX512-VNNI, may then interleave the rows by 16: ``r16.py``). A merged
layer whose shards come in different formats (llama.cpp's Q4_K_M files keep some layers'
``attn_v`` in a 6-bit K-quant beside 4-bit ``attn_q`` / ``attn_k``) keeps each shard's blocks apart, one
matmul per shard (in the all-layers C call too: ``layers/cpu/native_layers.py``).

:meth:`GGUFLinearMethod.apply` runs the native kernel (``kernels/cpu/csrc/cpu_gguf_gemm.c``: each
block dequantized in registers, float32 sums) for up to ``NATIVE_MAX_ROWS`` rows, or any row
count of bf16 activations on interleaved rows, on CPU where the native kernels are allowed
(numerics: float32 activations are multiplied as they are; where the library has int8 dot
products (AVX512-VNNI: ``quant_ops.gguf_int8_dot``; elsewhere they are widened to float32), bf16
activations with 32-element blocks, or weights of any format in the interleaved layout, are
quantized to int8 per 32-element block, ``d_a = max|x| / 127``, ``q = round-half-even(x * (127 /
max|x|))``, as llama.cpp quantizes activations, and each block's (or 16-element scale's) integer dot product
is exact, scaled in float32: ``cpu_gguf_q8.c``, ``cpu_gguf_r16.c``, ``cpu_gguf_r16k.c``; the
error against the unquantized activations is at most ``d_a / 2`` per element times ``|w|``;
K-quants in the file's layout keep float32 sums), the Triton kernel
(``kernels/triton/gemm_gguf.py``, the same contract) on CUDA, else dequantizes the whole weight
into the activation dtype and calls ``F.linear`` (``formats.dequantize``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import quant_ops
from services.executor.layers.linear import LinearMethodBase
from services.executor.layers.quantization.gguf import r16
from services.executor.layers.quantization.gguf.formats import BlockFormat, dequantize

# above (float32 activations, or K-quants in the file's layout): dequantize once per call, torch's GEMM
NATIVE_MAX_ROWS = 16


def _set_blocks(layer: nn.Module, blocks: torch.Tensor) -> None:
    """``blocks`` as ``layer.weight``: into its parameter where it has one (a tied LM head shares
    that parameter, so it sees them too), else a new one."""
    param = getattr(layer, "weight", None)
    if isinstance(param, nn.Parameter):
        param.data = blocks
    else:
        layer.weight = nn.Parameter(blocks, requires_grad=False)


class GGUFLinearMethod(LinearMethodBase):
    """A linear layer (or an embedding / LM head) whose ``weight`` holds GGUF blocks of ``fmt``.

    ``dtype``: the model's activation dtype (an embedding lookup's output; default: the layer's
    ``params_dtype`` at :meth:`create_weights`); ``native``: the C kernel may serve small row
    counts on CPU (the native kernels are allowed and the library loads; the loader sets it from
    the model's kernel request). With ``native`` and int8 dot products in the library
    (``quant_ops.gguf_int8_dot``: AVX512-VNNI), blocks of any format with ``r16`` of a multiple
    of 16 rows are kept in ``r16.py``'s interleaved layout (``r16``, the file's size), whose int8
    kernels serve bf16 activations of any row count; without VNNI the file's layout is kept (its
    float32 path is faster there). One method per layer (a tied LM head shares its embedding's).
    The model keeps this method when the kernels are chosen (``quantized``: ``layers/selection.py``
    leaves it in place).
    """

    quantized = True

    def __init__(self, fmt: BlockFormat, dtype: torch.dtype | None = None, native: bool = False) -> None:
        self.fmt, self.dtype, self.native = fmt, dtype, native
        self.r16 = False
        self.rows = self.input_size = 0  # the layer's, from create_weights or install

    @property
    def kernel_type(self) -> int:
        """The type code of ``quant_ops.gemm_gguf`` for the blocks as held (``| GGUF_R16`` when interleaved)."""
        return self.fmt.kernel_type | (quant_ops.GGUF_R16 if self.r16 else 0)

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype, bias: bool) -> None:
        """An empty uint8 ``weight`` (the blocks come at :meth:`load`) and ``bias`` ``[N]`` (or
        ``None``) in ``params_dtype`` with the layer's loader."""
        self.dtype = self.dtype or params_dtype
        self.rows, self.input_size = sum(output_partition_sizes), input_size
        layer.register_parameter("weight", nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False))
        self.register_bias(layer, self.rows, params_dtype, bias)

    def load(self, layer: nn.Module, shards: list[torch.Tensor], native: bool) -> None:
        """The file's blocks of ``layer`` at load: each shard's rows ``[N_i, K / block_size *
        block_bytes]`` uint8 (this rank's), concatenated; ``native``: as the constructor's.

        Raises:
            ValueError: blocks that are not whole rows of the layer's input in ``fmt``.
        """
        self.native = native
        self.install(layer, torch.cat(shards), self.input_size)

    def install(self, layer: nn.Module, blocks: torch.Tensor, input_size: int) -> None:
        """Make ``blocks`` ``[N, K / block_size * block_bytes]`` uint8 ``layer``'s weight, served by this method.

        Raises:
            ValueError: ``blocks`` is not whole rows of ``input_size`` elements in this format.
        """
        if input_size % self.fmt.block_size or blocks.dtype != torch.uint8 or blocks.dim() != 2 \
                or blocks.shape[1] != self.fmt.row_bytes(input_size):
            raise ValueError(f"{self.fmt.name} blocks {tuple(blocks.shape)} {blocks.dtype} are not rows of "
                             f"{input_size} elements")
        self.r16 = self.native and r16.supports(self.fmt, blocks.shape[0]) and quant_ops.gguf_int8_dot()
        if self.r16:
            blocks = r16.pack(blocks, self.fmt)
        _set_blocks(layer, blocks.contiguous())
        self.rows, self.input_size = blocks.shape[0], input_size
        layer.quant_method = self

    def file_blocks(self, layer: nn.Module, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's blocks of ``rows`` (``[R]`` int64; all when ``None``) in the file's row layout."""
        if self.r16:
            return r16.unpack_rows(layer.weight, self.fmt, rows)
        return layer.weight if rows is None else layer.weight[rows]

    def weight(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:  # [N, K] dtype
        """The layer's weight, dequantized."""
        return dequantize(self.file_blocks(layer), self.fmt, dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, K] -> [T, N] in x's dtype
        return self._matmul(layer, x, bias, x.dtype)

    def apply_logits(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K] -> [T, vocab] float32 (nothing for ParallelLMHead to refine)
        return self._matmul(layer, x, None, torch.float32)

    def embed(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, K]
        """The rows of ``input_ids``, dequantized into the model's dtype."""
        return dequantize(self.file_blocks(layer, input_ids), self.fmt, self.dtype).reshape(*input_ids.shape, -1)

    def _matmul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
        if (self.native and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
                and x.stride(-1) == 1 and (x.shape[0] <= NATIVE_MAX_ROWS or (self.r16 and x.dtype == torch.bfloat16))):
            out = quant_ops.gemm_gguf(x, layer.weight, self.fmt, self.input_size, out_dtype, validate=False,
                                      r16=self.r16)
            return out if bias is None else out.add_(bias)
        if x.is_cuda and x.dim() == 2 and x.dtype in (torch.float32, torch.float16, torch.bfloat16):
            from kernels.triton.gemm_gguf import gemm_gguf  # imports triton: only where it runs

            out = gemm_gguf(x, layer.weight, self.fmt, out_dtype)
            return out if bias is None else out.add_(bias)
        compute = torch.float32 if out_dtype == torch.float32 else x.dtype
        return F.linear(x.to(compute), self.weight(layer, compute), None if bias is None else bias.to(compute))


class GGUFShardedLinearMethod(LinearMethodBase):
    """A merged linear layer (q | k | v, gate | up) whose shards are GGUF blocks of different
    formats ``fmts``: shard ``i``'s rows ``[N_i, K / block_size_i * block_bytes_i]`` are held by
    the sub-module ``layer.gguf_shards[i]`` and multiplied by its :class:`GGUFLinearMethod`
    (``parts[i]``); the outputs are concatenated in shard order (``[T, sum N_i]``). The layer's
    own ``weight`` is left empty. The all-layers C call (``NativeLayers``) reads the parts'
    blocks in place and multiplies each into its columns of the output, as :meth:`apply` does."""

    quantized = True

    def __init__(self, fmts: list[BlockFormat], dtype: torch.dtype | None = None, native: bool = False) -> None:
        self.parts = [GGUFLinearMethod(fmt, dtype, native) for fmt in fmts]

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype, bias: bool) -> None:
        """One sub-module per shard (``layer.gguf_shards``, each its part's empty ``weight`` of
        ``output_partition_sizes[i]`` rows), an empty ``weight`` and ``bias`` ``[sum N_i]`` (or ``None``)."""
        layer.gguf_shards = nn.ModuleList()
        for method, rows in zip(self.parts, output_partition_sizes, strict=True):
            part = nn.Module()
            method.create_weights(part, input_size, [rows], params_dtype, bias=False)
            layer.gguf_shards.append(part)
        layer.register_parameter("weight", nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False))
        self.register_bias(layer, sum(output_partition_sizes), params_dtype, bias)

    @property
    def rows(self) -> int:
        return sum(m.rows for m in self.parts)

    def load(self, layer: nn.Module, shards: list[torch.Tensor], native: bool) -> None:
        """Each shard's blocks (this rank's rows, in its part's format) at load; ``native``: as
        :meth:`GGUFLinearMethod.load`'s.

        Raises:
            ValueError: a shard that is not whole rows of the layer's input in its format.
        """
        for method, part, blocks in zip(self.parts, layer.gguf_shards, shards, strict=True):
            method.native = native
            method.install(part, blocks, method.input_size)

    def install(self, layer: nn.Module, shards: list[torch.Tensor], input_size: int) -> None:
        """Make each of ``shards`` (uint8 block rows, in this method's formats) one part of ``layer``.

        Raises:
            ValueError: a shard that is not whole rows of ``input_size`` elements in its format.
        """
        layer.gguf_shards = nn.ModuleList()
        for method, blocks in zip(self.parts, shards, strict=True):
            part = nn.Module()
            method.install(part, blocks, input_size)
            layer.gguf_shards.append(part)
        _set_blocks(layer, torch.empty(0, dtype=torch.uint8))
        layer.quant_method = self

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, K] -> [T, sum N_i] in x's dtype
        out = torch.cat([m.apply(part, x) for m, part in zip(self.parts, layer.gguf_shards, strict=True)], dim=-1)
        return out if bias is None else out.add_(bias)
