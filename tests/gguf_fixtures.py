"""GGUF blocks written by our own code: random but valid blocks of any kept format
(:func:`random_blocks`) and K-quant packers from float weights (:func:`pack_k`: round to nearest,
simpler than llama.cpp's search, the layouts of gguf-py's ``quants.py``, whose ``quantize`` lacks
the K-quants). Whole GGUF files: ``gguf_files.py``.
"""

from __future__ import annotations

import numpy as np
import torch

from services.executor.layers.quantization import gguf as G

#: byte offsets of each format's fp16 fields (scales, mins), the rest of a block being free bits
FP16_FIELDS = {2: (0,), 3: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}


def random_blocks(fmt: G.BlockFormat, n: int, k: int, seed: int, scale: float = 0.002) -> torch.Tensor:
    """``[n, k / block_size * block_bytes]`` uint8 rows of ``fmt`` blocks: random bytes, with
    finite fp16 scales in ``[0, scale)`` (Q4_1's minimum: normal, 0.1 std)."""
    gen = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (n, k // fmt.block_size, fmt.block_bytes), generator=gen, dtype=torch.uint8)
    for i, off in enumerate(FP16_FIELDS[fmt.ggml_type]):
        values = torch.randn if fmt is G.Q4_1 and i == 1 else torch.rand
        factor = 0.1 if fmt is G.Q4_1 and i == 1 else scale
        b[..., off:off + 2] = (values(n, k // fmt.block_size, 1, generator=gen) * factor).half().view(torch.uint8)
    return b.view(n, -1)


def _fp16(v: np.ndarray) -> np.ndarray:  # [B] float -> [B, 2] uint8
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _pack_q4_q5_k(x: np.ndarray, bits: int) -> np.ndarray:  # [B, 256] float32 -> [B, 144 | 176] uint8
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)  # [B, 8]: w = d sc q - dmin m, m >= 0
    span = np.maximum(sub.max(-1) - lo, 1e-8) / (2**bits - 1)
    d = (span.max(-1) / 63).astype(np.float16).astype(np.float32)  # [B]
    dmin = ((-lo).max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(span / np.maximum(d[:, None], 1e-12)), 1, 63).astype(np.uint8)  # [B, 8]
    mn = np.clip(np.round(-lo / np.maximum(dmin[:, None], 1e-12)), 0, 63).astype(np.uint8)
    step = d[:, None, None] * sc[..., None]
    q = np.clip(np.round((sub + (dmin[:, None] * mn)[..., None]) / step), 0, 2**bits - 1).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=-1)  # [B, 12]
    low = (q & 15).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)  # sub-blocks 2i (low), 2i + 1 (high)
    parts = [_fp16(d), _fp16(dmin), scales]
    if bits == 5:
        high = (q >> 4).astype(np.uint8)  # [B, 8, 32]
        parts.append(np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
    return np.concatenate(parts + [qs], axis=-1)


def _pack_q6_k(x: np.ndarray) -> np.ndarray:  # [B, 256] float32 -> [B, 210] uint8
    grp = x.reshape(-1, 16, 16)
    amax = np.abs(grp).max(-1)  # [B, 16]
    d = (amax.max(-1) / 32 / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(amax / 32 / np.maximum(d[:, None], 1e-12)), 1, 127).astype(np.int8)
    q = np.clip(np.round(grp / (d[:, None, None] * sc[..., None])), -32, 31).astype(np.int16) + 32
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8)  # element 128 g + 32 s + e
    ql = ((q[:, :, 0:2] & 15) | ((q[:, :, 2:4] & 15) << 4)).reshape(-1, 128)
    qh = np.bitwise_or.reduce((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None], axis=2)
    return np.concatenate([ql, qh.reshape(-1, 64), sc.view(np.uint8), _fp16(d)], axis=-1)


def pack_k(w: np.ndarray, fmt: G.BlockFormat) -> np.ndarray:
    """``w`` ``[N, K]`` float32 (K a multiple of 256) as ``fmt`` (Q4_K, Q5_K or Q6_K) rows:
    ``[N, K / 256 * block_bytes]`` uint8."""
    n, k = w.shape
    flat = w.reshape(-1, 256).astype(np.float32)
    packed = _pack_q6_k(flat) if fmt is G.Q6_K else _pack_q4_q5_k(flat, 4 if fmt is G.Q4_K else 5)
    assert packed.shape[1] == fmt.block_bytes
    return np.ascontiguousarray(packed.reshape(n, -1))
