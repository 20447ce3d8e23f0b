"""The native CPU kernels from Python: paged attention rows, fused add + RMSNorm, the bf16-weight GEMM
and the weight packing it reads (the C sources are in ``csrc/``).

:func:`paged_attention_rows` runs ``cpu_paged_attention.c``: attention of query rows (decodes,
short prefills and chunks, causal) straight from the paged KV cache on
``torch.get_num_threads()`` OpenMP threads of the runtime torch already loaded (its bundled
``libgomp.so.1``). bf16 on AVX512-BF16 CPUs runs in tiles of up to 8 rows of one sequence
(each K/V chunk read once per tile) with vdpbf16ps scores and P V and spread L2 prefetches,
about twice as fast as one (row, KV head) per item. Elsewhere (float32, or CPUs without
AVX512-BF16) work items are (row, KV head) pairs.

:func:`add_rms_norm` runs ``cpu_rms_norm.c``: the residual add fused with RMSNorm in bf16
(one pass instead of torch's add + norm; the model uses it on CPU in bf16).

:mod:`kernels.cpu.quant_ops` wraps the quantized matmuls (int4 group-quantized, GGUF blocks).

:func:`gemm_bf16w` runs ``cpu_gemm_bf16.c``: matmuls with bf16 weights (laid out once by
:func:`pack_bf16_weight` in the layout of :func:`gemm_layout`). With AVX512-BF16, vdpbf16ps
register tiles, faster than oneDNN (several times at one row). Elsewhere float32 AVX2 + FMA
tiles, for CPUs where torch emulates bf16 matmuls at a sixth of its float32 speed
(:func:`native_bf16_matmul`), faster there than torch's bf16 and float32 matmuls.
:func:`prefer_native_gemm` says where the model uses it. Measurements (``benchmarks/cpu_gemm.py``):
benchmarks/RESULTS.md, "Figures moved out of the code".

The library is built and loaded by :mod:`kernels.cpu.native`.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu.native import PANEL, cpu_flags, load

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_attention_rows` handles these tensors (CPU, float32 or bfloat16,
    dense cache, query heads dense) and the library is available, within its limits
    (``lib.abi``: head_dim <= 256, at most 16 query heads per KV head, block size <= 128)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    if not (
        query.device.type == "cpu"
        and query.dtype in _DTYPES
        and key_cache.dtype == query.dtype
        and num_heads % num_kv_heads == 0
        and key_cache.is_contiguous()
        and query.stride(2) == 1
        and query.stride(1) == head_dim
    ):
        return False
    lib = load()
    return (
        lib is not None
        and head_dim <= lib.abi.max_head_dim
        and block_size <= lib.abi.max_block
        and num_heads // num_kv_heads <= lib.abi.max_group
    )


def _validate(query, key_cache, value_cache, block_index, num_blocks_per_seq, row_seq, row_len, out) -> None:
    """The argument checks of :func:`paged_attention_rows` (ValueError naming the parameter)."""
    rows, _, head_dim = query.shape
    block_size = key_cache.shape[1]
    if query.dtype not in _DTYPES or query.stride(2) != 1 or query.stride(1) != head_dim:
        raise ValueError("query must be float32/bfloat16 [T, H, D] with dense heads")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dtype != query.dtype or not cache.is_contiguous() or cache.shape != key_cache.shape:
            raise ValueError(f"{name} must be a dense [num_blocks, block_size, Hkv, D] tensor of the query's dtype")
    if block_index.dtype != torch.int64 or num_blocks_per_seq < 1 or block_index.numel() % num_blocks_per_seq:
        raise ValueError("block_index must hold S * num_blocks_per_seq int64 block ids")
    num_seqs = block_index.numel() // num_blocks_per_seq
    for name, t in (("row_seq", row_seq), ("row_len", row_len)):
        if t.dtype != torch.int64 or t.shape != (rows,):
            raise ValueError(f"{name} must be [T] = [{rows}] int64")
    if rows and not (0 <= int(row_seq.min()) and int(row_seq.max()) < num_seqs):
        raise ValueError(f"row_seq must index the {num_seqs} sequences of block_index")
    if rows and int(row_len.max()) > num_blocks_per_seq * block_size:
        raise ValueError(f"row_len exceeds num_blocks_per_seq * block_size = {num_blocks_per_seq * block_size}")
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype or not out.is_contiguous()):
        raise ValueError("out must be a dense [T, H, D] tensor of the query's dtype")


def paged_attention_rows(
    query: torch.Tensor,  # [T, H, D]: heads dense, any token stride
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], dense
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], dense, key_cache's dtype
    block_index: torch.Tensor,  # [S * nblk] or [S, nblk] int64, physical block of each logical block
    num_blocks_per_seq: int,  # nblk, the row length of block_index
    row_seq: torch.Tensor,  # [T] int64, the sequence (row of block_index) of each query row
    row_len: torch.Tensor,  # [T] int64, positions 0 .. row_len - 1 of its sequence that the row attends
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D] dense, query's dtype
    lib: ctypes.CDLL | None = None,  # a library from bind(); default: load()
    validate: bool = True,  # False: the caller vouches for every argument (a plan built per step)
) -> torch.Tensor:  # [T, H, D]
    """Paged attention of query rows over their sequences' cached K/V (already written).

    A decode row attends its whole sequence (``row_len = seq_len``); the ``q_len`` new rows of
    a prefill or chunk over ``ctx`` cached tokens attend causally (``row_len = ctx + 1 ..
    ctx + q_len``). Only blocks covering positions before a row's ``row_len`` are read.
    Accumulates in float32. bf16 with AVX512-BF16 takes its scores and P V from bf16 dot
    products, the probabilities rounded to bf16 as in a bf16 matmul (and the softmax sum
    taken of the rounded values); rows may come in any order, and runs of rows of one
    sequence share each K/V read.
    Runs on ``torch.get_num_threads()`` OpenMP threads. Check :func:`supports` first.

    Raises:
        ValueError: inconsistent arguments (the message names the parameter), or shapes the
            kernel refuses (see :func:`supports`).
    """
    lib = lib or load()
    if lib is None:
        raise ValueError("the native CPU kernels are not available (see the cpu_kernels_unavailable log)")
    rows, num_heads, head_dim = query.shape
    block_size = key_cache.shape[1]
    if validate:
        block_index, row_seq, row_len = block_index.contiguous(), row_seq.contiguous(), row_len.contiguous()
        _validate(query, key_cache, value_cache, block_index, num_blocks_per_seq, row_seq, row_len, out)
    if out is None:
        out = torch.empty((rows, num_heads, head_dim), dtype=query.dtype)
    status = lib.pagedllm_paged_attention(
        _DTYPES[query.dtype], query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
        block_index.data_ptr(), num_blocks_per_seq, row_seq.data_ptr(), row_len.data_ptr(), out.data_ptr(), rows,
        num_heads, key_cache.shape[2], head_dim, block_size, scale, torch.get_num_threads(),
    )
    if status == 3:
        raise MemoryError("cpu paged attention: out of memory for the tile list")
    if status != 0:
        raise ValueError(f"cpu paged attention: unsupported shapes (query {tuple(query.shape)}, "
                         f"cache {tuple(key_cache.shape)})")
    return out


# Rows x hidden above which the norm runs on every thread (below, one thread: a parallel
# region costs more than the work, e.g. for SmolLM2's 64 x 576 decode rows).
NORM_PARALLEL_MIN_ELEMENTS = 1 << 16


def add_rms_norm(
    h: torch.Tensor,  # [T, n] bfloat16, dense; with ``delta``: updated in place to h + delta
    weight: torch.Tensor,  # [n] bfloat16
    eps: float,
    delta: torch.Tensor | None = None,  # [T, n] bfloat16, dense: added to h first (residual add)
    lib: ctypes.CDLL | None = None,
    validate: bool = True,  # False: the caller vouches for the tensors (the model's hot path)
) -> torch.Tensor:  # [T, n] bfloat16, RMSNorm(h) * weight
    """Fused residual add + RMSNorm in bfloat16 (``cpu_rms_norm.c``; vLLM's fused_add_rms_norm).

    Equals ``h.add_(delta)`` then ``F.rms_norm(h, (n,), weight, eps)`` (float32 math, one
    rounding per output; rare 1-ulp differences from the order of the float32 sum).

    Raises:
        ValueError: not dense bfloat16 ``[T, n]`` tensors of matching shapes, or no library.
    """
    lib = lib or load()
    if lib is None:
        raise ValueError("the native CPU kernels are not available (see the cpu_kernels_unavailable log)")
    if validate:
        tensors = {"h": h, "weight": weight} | ({"delta": delta} if delta is not None else {})
        for name, t in tensors.items():
            if t.dtype != torch.bfloat16 or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"{name} must be a dense bfloat16 CPU tensor")
        if h.dim() != 2 or weight.shape != (h.shape[1],) or (delta is not None and delta.shape != h.shape):
            raise ValueError(f"h must be [T, n], weight [n] and delta [T, n]; got {tuple(h.shape)}, "
                             f"{tuple(weight.shape)}, {None if delta is None else tuple(delta.shape)}")
    out = torch.empty_like(h)
    threads = torch.get_num_threads() if h.numel() >= NORM_PARALLEL_MIN_ELEMENTS else 1
    lib.pagedllm_add_rms_norm_bf16(h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                                   out.data_ptr(), h.shape[0], h.shape[1], eps, threads)
    return out


# Storage slot of each column inside a panel: AVX2's unpacklo / unpackhi of one 256-bit load
# then give columns 0-7 and 8-15 (see cpu_gemm_bf16.c).
_PANEL_ORDER = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15])


def native_bf16_matmul() -> bool:
    """Whether oneDNN serves bf16 matmuls on this CPU (``torch.ops.mkldnn._is_mkldnn_bf16_supported``:
    AVX512-BF16 / AMX, or AVX-512 alone, where oneDNN converts on the fly). Without it (AVX2
    CPUs), bf16 ``F.linear`` is emulated (a sixth of float32's speed) and :func:`gemm_bf16w`
    serves bf16 weights instead."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


LAYOUT_FMA = 0  # [P, K, 16], columns permuted: float32 FMA tiles (AVX2 or portable C)
LAYOUT_PAIRS = 1  # [P, ceil(K / 2), 32]: k-pairs side by side for AVX512-BF16's vdpbf16ps


def gemm_layout(lib: ctypes.CDLL | None = None) -> int:
    """The weight layout the library's GEMM reads (``LAYOUT_FMA`` or ``LAYOUT_PAIRS``, fixed
    when it was compiled for this CPU); ``LAYOUT_FMA`` when there is no library."""
    lib = lib or load()
    return LAYOUT_FMA if lib is None else int(lib.pagedllm_gemm_bf16_layout())


def hardware_bf16_gemm(lib: ctypes.CDLL | None = None) -> bool:
    """Whether :func:`gemm_bf16w` multiplies in bf16 hardware (AVX512-BF16 dot products):
    then it serves bf16 models even where oneDNN has bf16 too (one C call for all the decoder
    layers beats ~25 torch calls per layer); on CPUs with AMX, oneDNN's tiles are faster."""
    return gemm_layout(lib) == LAYOUT_PAIRS and "amx_bf16" not in cpu_flags().split()


def prefer_native_gemm() -> bool:
    """Whether a bf16 model on this CPU should run its matmuls in :func:`gemm_bf16w` rather than
    torch's: where torch emulates bf16 (no :func:`native_bf16_matmul`), and where our GEMM has
    bf16 hardware (:func:`hardware_bf16_gemm`), which beats oneDNN on CPUs with AVX512-BF16
    and no AMX (``benchmarks/cpu_gemm.py``; benchmarks/RESULTS.md, "Figures moved out of the code")."""
    return load() is not None and (not native_bf16_matmul() or hardware_bf16_gemm())


def packed_shape(n: int, k: int, layout: int) -> tuple[int, int, int]:
    """The shape of an ``[n, k]`` weight packed in ``layout``."""
    panels = -(-n // PANEL)
    return (panels, k, PANEL) if layout == LAYOUT_FMA else (panels, -(-k // 2), 2 * PANEL)


def pack_bf16_weight(weight: torch.Tensor, layout: int | None = None) -> torch.Tensor:
    """Lay a weight ``[N, K]`` (out, in) out for :func:`gemm_bf16w` in panels of 16 output
    columns, zero-padded to a multiple of 16 columns (``packed_shape``). ``layout`` (default:
    the loaded library's, :func:`gemm_layout`):

    - ``LAYOUT_FMA``: ``[P, K, 16]``, k-major, columns stored 0-3, 8-11, 4-7, 12-15 (AVX2's
      unpacklo / unpackhi then give columns 0-7 and 8-15);
    - ``LAYOUT_PAIRS``: ``[P, ceil(K / 2), 32]``, each k-pair's 16 columns as (W[c, 2j],
      W[c, 2j + 1]) pairs, an odd K padded with a zero k.

    Raises:
        ValueError: ``weight`` is not a 2-D bfloat16 CPU tensor, or an unknown ``layout``.
    """
    if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        raise ValueError(f"weight must be a 2-D [N, K] bfloat16 CPU tensor, got {tuple(weight.shape)} "
                         f"{weight.dtype} on {weight.device}")
    layout = gemm_layout() if layout is None else layout
    if layout not in (LAYOUT_FMA, LAYOUT_PAIRS):
        raise ValueError(f"layout must be LAYOUT_FMA or LAYOUT_PAIRS, got {layout}")
    n, k = weight.shape
    panels = -(-n // PANEL)
    if layout == LAYOUT_PAIRS:
        kp = -(-k // 2)
        padded = torch.zeros(panels * PANEL, 2 * kp, dtype=torch.bfloat16)
        padded[:n, :k] = weight.detach()
        # [P, 16, KP, 2] -> [P, KP, 16, 2]
        return padded.view(panels, PANEL, kp, 2).transpose(1, 2).reshape(panels, kp, 2 * PANEL).contiguous()
    padded = torch.zeros(panels * PANEL, k, dtype=torch.bfloat16)
    padded[:n] = weight.detach()
    inv = torch.empty_like(_PANEL_ORDER)
    inv[_PANEL_ORDER] = torch.arange(PANEL)  # slot -> column
    return padded.view(panels, PANEL, k)[:, inv].transpose(1, 2).contiguous()


def unpack_bf16_weight(packed: torch.Tensor, n: int, k: int | None = None) -> torch.Tensor:  # -> [n, k] bf16
    """The weight ``[n, k]`` that :func:`pack_bf16_weight` laid out as ``packed`` (the layout
    read from its last dimension). ``k`` (K) is required for ``LAYOUT_PAIRS``, where an odd K
    was padded by one.

    Raises:
        ValueError: ``k`` missing or not one the packed shape can hold.
    """
    panels, rows, width = packed.shape
    if width == 2 * PANEL:  # LAYOUT_PAIRS
        if k is None or not 2 * rows - 1 <= k <= 2 * rows:
            raise ValueError(f"k must be the weight's K ({2 * rows - 1} or {2 * rows} for {rows} k-pairs), got {k}")
        full = packed.view(panels, rows, PANEL, 2).transpose(1, 2).reshape(panels * PANEL, 2 * rows)
        return full[:n, :k].contiguous()
    if k is not None and k != rows:
        raise ValueError(f"k must be the weight's K = {rows}, got {k}")
    return packed.transpose(1, 2)[:, _PANEL_ORDER].reshape(panels * PANEL, rows)[:n].contiguous()


def gemm_bf16w(
    x: torch.Tensor,  # [M, K] bfloat16 or float32, unit stride along K
    packed: torch.Tensor,  # bfloat16, pack_bf16_weight() in the library's layout (packed_shape)
    n: int,  # N, the weight's output columns
    bias: torch.Tensor | None = None,  # [N] bfloat16
    out_dtype: torch.dtype = torch.bfloat16,  # bfloat16 or float32
    lib: ctypes.CDLL | None = None,
    validate: bool = True,  # False: the caller vouches for the tensors (the model's hot path)
) -> torch.Tensor:  # [M, N] out_dtype
    """``F.linear(x, weight, bias)`` for a bf16 ``weight`` (``cpu_gemm_bf16.c``, GotoBLAS-style
    blocking, float32 sums, one rounding per output): AVX512-BF16 dot products where the CPU
    has them (``LAYOUT_PAIRS``; a float32 ``x`` is split into bf16 high and low halves, exact
    to about 2^-17), else float32 AVX2 + FMA tiles (``LAYOUT_FMA``). ``packed`` must be in the
    library's layout. Runs on ``torch.get_num_threads()`` OpenMP threads.

    Raises:
        ValueError: shapes or dtypes that do not fit (the message names the parameter), or no library.
    """
    lib = lib or load()
    if lib is None:
        raise ValueError("the native CPU kernels are not available (see the cpu_kernels_unavailable log)")
    m, k = x.shape
    if validate:
        if x.dtype not in _DTYPES or x.device.type != "cpu" or x.stride(1) != 1:
            raise ValueError("x must be a float32/bfloat16 [M, K] CPU tensor with unit stride along K")
        expected = packed_shape(n, k, gemm_layout(lib))
        if packed.dtype != torch.bfloat16 or not packed.is_contiguous() or packed.device.type != "cpu" \
                or tuple(packed.shape) != expected:
            raise ValueError(f"packed must be pack_bf16_weight() of an [{n}, {k}] weight in this library's layout "
                             f"{gemm_layout(lib)}: shape {expected}, got {tuple(packed.shape)}")
        if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous() or bias.shape != (n,)
                                 or bias.device.type != "cpu"):
            raise ValueError(f"bias must be a dense [{n}] bfloat16 CPU tensor")
        if out_dtype not in _DTYPES:
            raise ValueError("out_dtype must be torch.float32 or torch.bfloat16")
    out = torch.empty((m, n), dtype=out_dtype)
    status = lib.pagedllm_gemm_bf16w(_DTYPES[x.dtype], x.data_ptr(), x.stride(0) if m > 1 else k, packed.data_ptr(),
                                     None if bias is None else bias.data_ptr(), _DTYPES[out_dtype], out.data_ptr(),
                                     n, m, n, k, torch.get_num_threads())
    if status != 0:
        raise ValueError(f"cpu bf16 gemm failed (status {status}) for x {tuple(x.shape)}, weight [{n}, {k}]")
    return out
