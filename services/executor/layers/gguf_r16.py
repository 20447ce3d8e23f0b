"""GGUF Q4_0 / Q4_1 / Q8_0 blocks with their rows interleaved by 16: the layout of
``kernels/cpu/csrc/cpu_gguf_r16.c`` (type ``| GGUF_R16``), where one AVX512-VNNI instruction
multiplies a block of 16 weight rows into the 16 lanes of a vector.

Rows ``16 g .. 16 g + 15`` of a weight ``[N, K]`` (``N`` a multiple of :data:`GROUP`) form group
``g``; block ``b`` (32 k) of the group is ``16 * block_bytes`` bytes at ``(g * K/32 + b) * 16 *
block_bytes``: the 16 rows' fp16 ``d`` (row ``r`` at byte ``2 r``), for Q4_1 then their 16 fp16
``m``, then the quants as 64-byte vectors whose 4-byte lane ``r`` holds row ``r``'s bytes ``4 p ..
4 p + 3`` of the file's block (Q4: 4 vectors of nibble bytes; Q8_0: 8 vectors of ``q + 128``, the
int8 stored XOR 0x80, so every weight byte is unsigned for ``vpdpbusd``). The tensor keeps the
file's size and the shape ``[N, K / 32 * block_bytes]`` of its rows of blocks; a permutation of the
bytes within each group-block, plus the XOR, so :func:`unpack_rows` gives back the file's bytes
exactly.
"""

from __future__ import annotations

import functools

import torch

GROUP = 16  # rows per group (cpu_gguf_r16.c's RG)
TYPES = {2: 18, 3: 20, 8: 34}  # ggml type -> block bytes: Q4_0, Q4_1, Q8_0
R16_FLAG = 0x100  # GGUF_R16 in kernels/cpu/csrc/pagedllm_abi.h


def supports(ggml_type: int, rows: int) -> bool:
    """Whether a weight of ``rows`` output rows in ``ggml_type`` can take the layout."""
    return ggml_type in TYPES and rows % GROUP == 0 and rows > 0


@functools.cache
def _source(ggml_type: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``src [16 bpb]``: the packed group-block's byte ``i`` is byte ``src[i]`` of the 16 file
    blocks laid end to end (row ``r``'s byte ``j`` at ``r * bpb + j``); ``flip [16 bpb]`` bool:
    the bytes stored XOR 0x80 (Q8_0's quants)."""
    bpb = TYPES[ggml_type]
    src: list[int] = []
    for r in range(GROUP):  # the fp16 d
        src += [r * bpb, r * bpb + 1]
    if ggml_type == 3:  # Q4_1's fp16 m
        for r in range(GROUP):
            src += [r * bpb + 2, r * bpb + 3]
    q_off = 4 if ggml_type == 3 else 2
    flip = [False] * len(src)
    for v in range((bpb - q_off) // 4):
        for r in range(GROUP):
            src += [r * bpb + q_off + 4 * v + t for t in range(4)]
            flip += [ggml_type == 8] * 4
    assert sorted(src) == list(range(GROUP * bpb))
    return torch.tensor(src), torch.tensor(flip)


def pack(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The file's rows of blocks ``[N, K/32 * bpb]`` uint8 -> the interleaved layout, same shape.

    Raises:
        ValueError: a type without the layout or ``N`` not a multiple of 16.
    """
    n = blocks.shape[0]
    if not supports(ggml_type, n):
        raise ValueError(f"GGUF type {ggml_type} with {n} rows has no 16-row interleaved layout")
    bpb = TYPES[ggml_type]
    src, flip = _source(ggml_type)
    grouped = blocks.reshape(n // GROUP, GROUP, -1, bpb).transpose(1, 2).reshape(n // GROUP, -1, GROUP * bpb)
    packed = grouped[..., src]
    packed[..., flip] ^= 0x80
    return packed.reshape(n, -1).contiguous()


def unpack_rows(packed: torch.Tensor, ggml_type: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The file's blocks of ``rows`` (``[R]`` int64 row indices; all rows when ``None``) from the
    interleaved layout ``[N, K/32 * bpb]``: ``[R, K/32 * bpb]`` uint8."""
    n = packed.shape[0]
    bpb = TYPES[ggml_type]
    src, flip = _source(ggml_type)
    groups = packed.view(n // GROUP, -1, GROUP * bpb)  # [G, nb, 16 bpb]
    rows = torch.arange(n) if rows is None else rows.reshape(-1).long()
    inverse = torch.empty_like(src)
    inverse[src] = torch.arange(src.numel())
    where = inverse.view(GROUP, bpb)[rows % GROUP]  # [R, bpb]: each byte's place in its group-block
    sel = groups[rows // GROUP]  # [R, nb, 16 bpb]
    out = sel.gather(2, where[:, None, :].expand(-1, sel.shape[1], -1))
    raw_flip = torch.zeros_like(flip)
    raw_flip[src] = flip
    out[..., raw_flip.view(GROUP, bpb)[0]] ^= 0x80  # the same byte offsets in every row
    return out.reshape(rows.numel(), -1)
