"""A tensor-parallel rank's share of a GGUF tensor, taken from its whole rows (blocks kept).

The shares are those of ``layers/linear.py`` and ``layers/embedding.py`` for a Hugging Face
checkpoint (vLLM's semantics), read off the layer built under the rank's group:

- a column-parallel layer (``QKVParallelLinear``, ``MergedColumnParallelLinear``) takes rows of
  each merged shard, ``layer.row_ranges[i]`` of shard ``i`` (q, k, v by the rank's heads; gate, up
  by balanced ranges); a fused file tensor holding every shard's rows (Phi-3's ``attn_qkv``,
  ``ffn_up``) is cut into its shards (``layer.output_sizes``) first. Biases likewise;
- a row-parallel layer (``o_proj``, ``down_proj``) takes the input columns ``layer.input_range``:
  whole blocks of each row, so the range must start and end on a block boundary (the format's
  ``block_size``), else :class:`ValueError`. Its bias stays whole;
- a vocabulary-parallel embedding or LM head takes the vocabulary rows
  ``[vocab_start, vocab_start + num_embeddings_per_partition)`` (balanced, no padding rows);
  ``VocabParallelEmbedding.forward`` already shifts the ids to the rank's rows and zeroes the
  others, and ``ParallelLMHead.compute_logits`` gathers each rank's logits, so the GGUF
  method's ``embed`` / ``apply_logits`` need nothing more;
- a MoE layer's stacked experts (``FusedMoE``) take the rows ``moe.intermediate_range`` of every
  expert's gate and up and the same input columns of every expert's down (whole blocks, as a
  row-parallel layer's, or values where down is dequantized: each matmul is kept on its own);
- anything else (norms, a MoE router) is whole on every rank.

A GGUF block row is whole runs of blocks (``[N, K / block_size * block_bytes]`` uint8), so rows
are sliced as any tensor's and a column range of ``c`` elements is ``c / block_size *
block_bytes`` bytes. The q / k rows are put back in Hugging Face's order (whole heads) before
any of this. Every share is a copy: the rank keeps only its part of the file's tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from services.executor.layers.embedding import VocabParallelEmbedding
from services.executor.layers.fused_moe import FusedMoE
from services.executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from services.executor.layers.quantization.gguf.formats import BlockFormat


def _copy(t: torch.Tensor) -> torch.Tensor:  # a view's values in their own (contiguous) storage
    return t.clone(memory_format=torch.contiguous_format)


def column_shares(layer: ColumnParallelLinear, parts: list[torch.Tensor], names: list[str]) -> list[torch.Tensor]:
    """This rank's rows of each file tensor ``parts[j]`` (``[rows_j, ...]``, whole, Hugging Face's
    row order): one tensor per part. ``len(parts)`` is the layer's shard count, or 1 for a fused
    tensor of every shard's rows (its shares concatenated in shard order).

    Raises:
        ValueError: the parts do not match the layer's shards (``names`` named).
    """
    sizes, ranges = layer.output_sizes, layer.row_ranges
    if len(parts) == len(sizes):
        for part, whole, name in zip(parts, sizes, names, strict=True):
            if part.shape[0] != whole:
                raise ValueError(f"{name}: GGUF shape {tuple(part.shape)} does not have the layer's {whole} rows")
        return [_copy(p.narrow(0, start, size)) for p, (start, size) in zip(parts, ranges, strict=True)]
    if len(parts) == 1 and parts[0].shape[0] == sum(sizes):  # one tensor of every shard's rows
        firsts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [torch.cat([parts[0].narrow(0, first + start, size)
                           for first, (start, size) in zip(firsts, ranges, strict=True)])]
    raise ValueError(f"{names}: GGUF shapes {[tuple(p.shape) for p in parts]} do not split into the layer's "
                     f"shards of {sizes} rows")


def _columns(t: torch.Tensor, fmt: BlockFormat | None, start: int, size: int, whole: int, name: str,
             tp_size: int, tp_rank: int) -> torch.Tensor:
    """The input columns ``[start, start + size)`` of ``t``'s last dimension: block rows (``fmt``) or values."""
    if fmt is None:
        return _copy(t.narrow(-1, start, size))
    bs = fmt.block_size
    if start % bs or size % bs:
        raise ValueError(f"{name}: tensor_parallel_size={tp_size} gives rank {tp_rank} the input columns "
                         f"[{start}, {start + size}) of {whole}, which cut {fmt.name}'s blocks of "
                         f"{bs} elements (each rank's share must be whole blocks: a multiple of {bs})")
    return _copy(t.narrow(-1, fmt.row_bytes(start), fmt.row_bytes(size)))


def row_share(layer: RowParallelLinear, rows: torch.Tensor, fmt: BlockFormat | None, name: str) -> torch.Tensor:
    """This rank's input columns ``layer.input_range`` of ``rows``: block rows
    ``[N, K / block_size * block_bytes]`` uint8 of ``fmt``, or values ``[N, K]`` (``fmt`` None).

    Raises:
        ValueError: the rank's columns do not start and end on a block boundary (the layer
            ``name``, the tensor-parallel size and the block size named).
    """
    start, size = layer.input_range
    return _columns(rows, fmt, start, size, layer.full_input_size, name, layer.tp_size, layer.tp_rank)


def expert_shares(moe: FusedMoE, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                  down_fmt: BlockFormat | None, names: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's part of a MoE layer's stacked experts (``FusedMoE``'s balanced range
    ``moe.intermediate_range`` of each expert's intermediate size): the rows of every expert's
    ``gate`` / ``up`` (``[E, I, ...]``: blocks or values alike) and the input columns of every
    expert's ``down`` (``[E, hidden, I / block_size * block_bytes]`` blocks of ``down_fmt``, or
    ``[E, hidden, I]`` values where ``down_fmt`` is ``None``). All of them at one rank.

    Raises:
        ValueError: the rank's columns of ``down`` cut its blocks (``names[2]`` named).
    """
    if moe.tp.world_size == 1:
        return gate, up, down
    start, size = moe.intermediate_range
    return (_copy(gate.narrow(1, start, size)), _copy(up.narrow(1, start, size)),
            _columns(down, down_fmt, start, size, moe.intermediate_size, names[2], moe.tp.world_size, moe.tp.rank))


def vocab_share(layer: VocabParallelEmbedding, rows: torch.Tensor) -> torch.Tensor:
    """This rank's vocabulary rows of the table ``rows`` ``[vocab, ...]`` (blocks or values)."""
    return _copy(rows.narrow(0, layer.vocab_start, layer.num_embeddings_per_partition))


def is_split(module: nn.Module) -> bool:
    """Whether ``module`` holds one rank's part of its weight (a parallel layer of a group of
    more than one rank)."""
    parallel = isinstance(module, ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding)
    return parallel and module.tp_size > 1
