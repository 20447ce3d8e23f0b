"""GGUF blocks with their rows interleaved by 16: the layout of ``kernels/cpu/csrc/cpu_gguf_r16.c``
(the 32-element formats) and ``cpu_gguf_r16k.c`` (the K-quants), for every format of ``formats.py``
with ``r16``, kernel type ``| GGUF_R16``,
where one AVX512-VNNI instruction multiplies a block of 16 weight rows into the 16 lanes of a vector.

Rows ``16 g .. 16 g + 15`` of a weight ``[N, K]`` (``N`` a multiple of :data:`GROUP`) form group
``g``; block ``b`` (32 k; a K-quant's super-block: 256 k) of the group is ``16 * block_bytes``
bytes at ``(g * blocks_per_row + b) * 16 * block_bytes``: the 16 rows' fp16 fields, field by field
(row ``r``'s at byte ``2 r`` of its field's 32 bytes: the format's ``fp16_fields``), then the rest
of each row's block, in the file's
order, cut into 4-byte chunks: chunk ``c`` is a 64-byte vector whose 4-byte lane ``r`` holds row
``r``'s chunk ``c``. Chunks of quants hold 4 consecutive k of one row (nibble bytes; int8 quants,
``int8_quants``: ``q + 128``, stored XOR 0x80, so every weight byte is unsigned for ``vpdpbusd``); the
K-quants' 6-bit scales and mins, high bits (``qh``) and int8 scales are chunks as well, one row's
4 bytes per 32-bit lane, decoded with shifts in the lanes (``cpu_gguf_r16k.c``'s header lists
each format's chunks). The tensor keeps the file's size exactly
(``block_bytes`` per row and block) and the shape ``[N, K / block_size * block_bytes]`` of its rows
of blocks; a permutation of the bytes within each group-block, plus the int8 quants' XOR, so
:func:`unpack_rows` gives back the file's bytes exactly.
"""

from __future__ import annotations

import functools

import torch

from services.executor.layers.quantization.gguf.formats import BlockFormat

GROUP = 16  # rows per group (cpu_gguf_r16.c's RG)


def supports(fmt: BlockFormat, rows: int) -> bool:
    """Whether a weight of ``rows`` output rows in ``fmt`` can take the layout."""
    return fmt.r16 and rows % GROUP == 0 and rows > 0


@functools.cache
def _source(fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``src [16 bpb]``: the packed group-block's byte ``i`` is byte ``src[i]`` of the 16 file
    blocks laid end to end (row ``r``'s byte ``j`` at ``r * bpb + j``); ``flip [16 bpb]`` bool:
    the bytes stored XOR 0x80 (int8 quants)."""
    bpb, halves = fmt.block_bytes, fmt.fp16_fields
    src: list[int] = []
    for off in halves:  # the fp16 fields, field by field
        for r in range(GROUP):
            src += [r * bpb + off, r * bpb + off + 1]
    rest = [j for j in range(bpb) if all(j not in (off, off + 1) for off in halves)]  # in 4-byte chunks
    flip = [False] * len(src)
    for c in range(0, len(rest), 4):
        for r in range(GROUP):
            src += [r * bpb + j for j in rest[c:c + 4]]
            flip += [fmt.int8_quants] * 4
    assert sorted(src) == list(range(GROUP * bpb))
    return torch.tensor(src), torch.tensor(flip)


def pack(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The file's rows of blocks ``[N, K / block_size * bpb]`` uint8 -> the interleaved layout, same shape.

    Raises:
        ValueError: a type without the layout or ``N`` not a multiple of 16.
    """
    n = blocks.shape[0]
    if not supports(fmt, n):
        raise ValueError(f"GGUF type {fmt.name} with {n} rows has no 16-row interleaved layout")
    bpb = fmt.block_bytes
    src, flip = _source(fmt)
    grouped = blocks.reshape(n // GROUP, GROUP, -1, bpb).transpose(1, 2).reshape(n // GROUP, -1, GROUP * bpb)
    packed = grouped[..., src]
    packed[..., flip] ^= 0x80
    return packed.reshape(n, -1).contiguous()


@functools.cache
def _inverse(fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``where [16, bpb]``: row ``r``'s byte ``j`` lies at ``where[r, j]`` of its group-block;
    ``flipped [bpb]`` uint8: 0x80 at a row's bytes stored XOR 0x80 (the same offsets in every row), else 0."""
    src, flip = _source(fmt)
    bpb = fmt.block_bytes
    inverse = torch.empty_like(src)
    inverse[src] = torch.arange(src.numel())
    raw_flip = torch.zeros_like(flip)
    raw_flip[src] = flip
    return inverse.view(GROUP, bpb), raw_flip.view(GROUP, bpb)[0].to(torch.uint8) * 0x80


def unpack_rows(packed: torch.Tensor, fmt: BlockFormat, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The file's blocks of ``rows`` (``[R]`` int64 row indices; all rows when ``None``) from the
    interleaved layout ``[N, K / block_size * bpb]``: ``[R, K / block_size * bpb]`` uint8."""
    n = packed.shape[0]
    bpb = fmt.block_bytes
    inverse, flipped = _inverse(fmt)
    nb = packed.shape[1] // bpb
    rows = torch.arange(n) if rows is None else rows.reshape(-1).long()
    # byte j of block b of row r: group-block (r // 16) * nb + b, at where[r % 16, j] within it
    start = ((rows // GROUP) * nb)[:, None] + torch.arange(nb)  # [R, nb]
    index = start[:, :, None] * (GROUP * bpb) + inverse[rows % GROUP][:, None, :]  # [R, nb, bpb]
    out = packed.view(-1)[index]
    if fmt.int8_quants:
        out ^= flipped
    return out.reshape(rows.numel(), -1)
