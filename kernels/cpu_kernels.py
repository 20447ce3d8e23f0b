"""Native CPU kernels: built once with the machine's C compiler, loaded with ctypes.

:func:`paged_decode_attention` runs ``cpu_decode_attention.c``: decode attention straight from
the paged KV cache, parallel over (sequence, KV head) with the OpenMP runtime torch loaded
(so ``torch.set_num_threads`` on the calling thread applies). SmolLM2 bf16, 64 sequences at
~128 tokens of context, 2 cores: a whole decode step 90 -> 76 ms against the torch path's block
gather + batched matmuls (``benchmarks/step_time.py``, 2026-12-01).

The shared library is compiled with ``-O3 -march=native -fopenmp`` on first use into
``$PAGEDLLM_KERNEL_CACHE`` (default ``~/.cache/pagedllm/kernels``), named by a hash of the
source, the flags, the compiler's version and the CPU's feature flags, so a changed source or
another machine builds its own. Without a compiler (or if the build fails) :func:`load`
returns ``None`` once, logs why, and the caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import structlog
import torch

log = structlog.get_logger("kernels")

SOURCE = Path(__file__).with_name("cpu_decode_attention.c")
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-shared", "-fPIC"]
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 128  # as in the C source
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    return Path(os.environ.get("PAGEDLLM_KERNEL_CACHE", Path.home() / ".cache" / "pagedllm" / "kernels"))


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def build(compiler: str | None = None) -> Path:
    """Compile the kernels (if not already built) and return the shared library's path.

    Raises:
        RuntimeError: no C compiler, or the compiler failed (its output in the message).
    """
    cc = compiler or os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc or not shutil.which(cc):
        raise RuntimeError(f"no C compiler found ({cc or 'gcc/cc'}; set CC or install gcc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), " ".join(CFLAGS), *version, _cpu_flags(), torch.__version__]).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"cpu_decode_attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    proc = subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{cc} failed to build {SOURCE.name}:\n{proc.stderr[-2000:]}")
    os.replace(tmp, target)  # atomic: concurrent builders each write their own temp file
    return target


def load() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; ``None`` if it cannot be built."""
    global _lib, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                lib = ctypes.CDLL(str(build()))
                fn = lib.pagedllm_decode_attention
                i64, ptr = ctypes.c_int64, ctypes.c_void_p
                fn.argtypes = [ctypes.c_int, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64,
                               ctypes.c_float]
                fn.restype = ctypes.c_int
                _lib = lib
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                log.warning("cpu_kernels_unavailable", reason=str(exc)[:500])
        return _lib


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_decode_attention` handles these tensors (CPU, float32 or bfloat16,
    head_dim <= 256, at most 16 query heads per KV head, block size <= 128, dense cache, query
    heads dense) and the library is available."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    return (
        query.device.type == "cpu"
        and query.dtype in _DTYPES
        and key_cache.dtype == query.dtype
        and head_dim <= MAX_HEAD_DIM
        and block_size <= MAX_BLOCK
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and key_cache.is_contiguous()
        and query.stride(2) == 1
        and query.stride(1) == head_dim
        and load() is not None
    )


def paged_decode_attention(
    query: torch.Tensor,  # [B, H, D]: heads dense, any token stride
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], dense
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], dense
    block_index: torch.Tensor,  # [B * nblk] or [B, nblk] int64, physical block of each logical block
    num_blocks_per_seq: int,  # nblk, the row length of block_index
    seq_lens: torch.Tensor,  # [B] int64, tokens of context of each sequence (its new token included)
    scale: float,
    out: torch.Tensor | None = None,  # [B, H, D] dense, query's dtype
) -> torch.Tensor:  # [B, H, D]
    """Attention of one new token per sequence over its cached K/V (already written).

    Every block id in ``block_index`` that covers a position before ``seq_lens[b]`` is read;
    the rest are not. Accumulates in float32; bf16 scores use AVX512-BF16 dot products when
    the CPU has them. Check :func:`supports` first.

    Raises:
        ValueError: the kernel refused the shapes (see :func:`supports`).
    """
    lib = load()
    batch, num_heads, head_dim = query.shape
    assert lib is not None and block_index.dtype == torch.int64 and seq_lens.dtype == torch.int64
    if out is None:
        out = torch.empty((batch, num_heads, head_dim), dtype=query.dtype)
    status = lib.pagedllm_decode_attention(
        _DTYPES[query.dtype], query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
        block_index.data_ptr(), num_blocks_per_seq, seq_lens.data_ptr(), out.data_ptr(), batch, num_heads,
        key_cache.shape[2], head_dim, key_cache.shape[1], scale,
    )
    if status != 0:
        raise ValueError(f"cpu decode attention: unsupported shapes (query {tuple(query.shape)}, "
                         f"cache {tuple(key_cache.shape)})")
    return out
