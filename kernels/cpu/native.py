"""The native CPU kernel library (``csrc/``): built with the machine's C compiler, loaded with ctypes.

:func:`build` compiles the sources with ``-O3 -march=native -fopenmp -ffast-math`` (then links
without ``-ffast-math``) into a cache directory: ``Settings.cache_dir / "kernels"``
(:func:`shared.config.kernel_cache_dir`, default ``~/.cache/pagedllm/kernels``), naming the
library by a hash of the sources, the flags, the compiler's version, its predefined macros
under those flags (what ``-march=native`` enables), the CPU's feature flags and the torch
version, so a changed source or another CPU builds its own. ``pagedllm prepare-model`` builds
it (and so ``make run``, ``make test`` and the Docker image); the first :func:`load` builds it
where that did not happen (a container started on a CPU other than the build machine's).

:func:`bind` checks the library's ABI (``pagedllm_abi()``, ``csrc/pagedllm_abi.h``: the ABI
version, the struct sizes, the kernels' limits) before it declares a function, so a library
built from other sources is refused instead of misread. Without a compiler, after a failed or
timed-out build, or on an ABI mismatch, :func:`load` returns ``None`` once and logs
``cpu_kernels_unavailable`` with the reason; the callers keep their torch paths. The kernels'
Python wrappers are in :mod:`kernels.cpu.ops`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from shared.config import kernel_cache_dir
from shared.logging import get_logger

log = get_logger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / n for n in ("abi.c", "cpu_paged_attention.c", "cpu_rms_norm.c", "cpu_gemm_bf16.c",
                              "cpu_llama_layers.c", "cpu_gemm_w4.c", "cpu_gguf_gemm.c", "cpu_gguf_q8.c", "cpu_gguf_r16.c",
                              "cpu_gguf_r16k.c", "cpu_token_bitmask.c")]
HEADERS = [CSRC / "cpu_bf16.h", CSRC / "cpu_gguf_q8.h", CSRC / "pagedllm_abi.h"]
# -ffast-math only when compiling (vectorised expf): linking with it would add gcc's
# crtfastmath.o, which turns on flush-to-zero for the whole process when the library loads.
COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC", "-c"]
LINK_FLAGS = ["-shared", "-fopenmp"]
PROBE_TIMEOUT_S = 60  # the compiler's --version and its predefined macros
COMPILE_TIMEOUT_S = 600  # one source file, or the link; a timeout is a failed build
ABI_VERSION = 8  # PAGEDLLM_ABI_VERSION in csrc/pagedllm_abi.h
PANEL = 16  # output columns per packed weight panel (csrc/pagedllm_abi.h): kernels.cpu.ops packs in it

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def cpu_flags() -> str:
    """The ``flags`` line of ``/proc/cpuinfo`` (``""`` where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` with its output captured.

    Raises:
        RuntimeError: it ran longer than ``timeout`` seconds (killed).
    """
    # its own process group: a timeout (or an interrupt of the caller) kills the compiler
    # driver's children too (cc1 would otherwise go on compiling, orphaned)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except BaseException as error:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            if isinstance(error, subprocess.TimeoutExpired):
                raise RuntimeError(f"{' '.join(cmd)} timed out after {timeout} s") from None
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _usable_cores() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _check(cmd: list[str], proc: subprocess.CompletedProcess) -> None:
    """Raises RuntimeError with the end of its stderr when ``cmd`` failed."""
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")


def find_compiler() -> str | None:
    """The C compiler builds use: ``$CC``, else ``gcc``, else ``cc``; None when there is none."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    return cc if cc and shutil.which(cc) else None


def build(compiler: str | None = None, extra_flags: tuple[str, ...] = (), cache_dir: Path | None = None) -> Path:
    """Compile the kernels (if not already built) and return the shared library's path.

    ``extra_flags`` go after ``-march=native`` (the tests build a portable variant with
    ``-mno-avx512bf16``). ``cache_dir``: where libraries are kept (default
    :func:`shared.config.kernel_cache_dir`).

    Raises:
        RuntimeError: no C compiler, or a compiler command failed (its output in the message)
            or ran past its timeout (``PROBE_TIMEOUT_S``, ``COMPILE_TIMEOUT_S``).
    """
    cc = compiler or find_compiler()
    if not cc or not shutil.which(cc):
        raise RuntimeError(f"no C compiler found ({cc or 'gcc/cc'}; set CC or install gcc)")
    compile_flags = [*COMPILE_FLAGS, *extra_flags]
    version = _run([cc, "--version"], PROBE_TIMEOUT_S).stdout.splitlines()[:1]
    # what -march=native turns on here (AVX512-BF16 or not ...): a shared cache never hands one
    # CPU's build to another, even where /proc/cpuinfo cannot be read
    macros = _run([cc, *(f for f in compile_flags if f != "-c"), "-E", "-dM", "-x", "c", os.devnull],
                  PROBE_TIMEOUT_S).stdout
    key = hashlib.sha256(
        "\0".join([*(src.read_text() for src in SOURCES + HEADERS), " ".join(compile_flags + LINK_FLAGS), *version,
                   macros, cpu_flags(), torch.__version__]).encode()
    ).hexdigest()[:16]
    target = Path(cache_dir or kernel_cache_dir()) / f"pagedllm_cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # per builder: concurrent builds are safe
        objs = [str(Path(tmp) / f"{src.stem}.o") for src in SOURCES]
        lib = Path(tmp) / "kernels.so"
        cmds = [[cc, *compile_flags, str(src), "-o", obj] for src, obj in zip(SOURCES, objs, strict=True)]
        # the sources compile at once, one per core (cpu_paged_attention.c alone takes about
        # half of a serial build); the link waits for all of them
        with ThreadPoolExecutor(max_workers=min(len(cmds), _usable_cores())) as pool:
            procs = list(pool.map(lambda cmd: _run(cmd, COMPILE_TIMEOUT_S), cmds))
        link = [cc, *LINK_FLAGS, *objs, "-o", str(lib), "-lm"]
        for cmd, proc in zip(cmds, procs, strict=True):
            _check(cmd, proc)
        _check(link, _run(link, COMPILE_TIMEOUT_S))
        umask = os.umask(0)
        os.umask(umask)
        lib.chmod(0o755 & ~umask)  # readable by every user of a shared cache directory
        os.replace(lib, target)  # atomic
    return target


_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)


class LlamaLayersArgs(ctypes.Structure):
    """``pagedllm_llama_args`` (``csrc/pagedllm_abi.h``), the argument block of
    ``pagedllm_llama_layers_bf16``: the model's pointers (per-layer arrays, set once) and the
    step's (set per forward). Its size is checked against the library's (:func:`bind`)."""

    _fields_ = [
        *[(n, ctypes.c_int64) for n in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "inter",
                                        "block_size", "num_slots")],
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        *[(n, _PP) for n in ("in_norm", "post_norm", "qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w", "gate_up_b",
                             "down_w", "down_b", "k_cache", "v_cache")],
        ("wtype", _P), ("nshard", _P), ("shard_w", _PP), ("shard_type", _P), ("shard_rows", _P),
        ("T", ctypes.c_int64), ("h", _P), ("cos", _P), ("sin", _P), ("slots", _P), ("block_index", _P),
        ("nblk", ctypes.c_int64), ("row_seq", _P), ("row_len", _P),
        *[(n, _P) for n in ("x", "qkv", "attn", "gate_up", "act", "delta")],
        ("num_threads", ctypes.c_int),
    ]


class AbiInfo(ctypes.Structure):
    """``pagedllm_abi_info`` (``csrc/pagedllm_abi.h``): what a build speaks, and the kernels'
    limits (``max_group`` query heads per KV head, ``max_head_dim`` and ``max_block`` of paged
    attention, ``max_rope_dim`` and ``max_shards`` (shards of a merged matmul) of the all-layers
    call), which :mod:`kernels.cpu.ops` and ``NativeLayers`` read from ``lib.abi``."""

    _fields_ = [(n, ctypes.c_int64) for n in ("version", "abi_size", "llama_args_size", "max_group",
                                               "max_head_dim", "max_block", "max_rope_dim", "panel", "max_shards")]


def check_abi(lib: ctypes.CDLL) -> AbiInfo:
    """The library's :class:`AbiInfo`, after checking it against this side's.

    Raises:
        RuntimeError: no ``pagedllm_abi`` export, another ABI version, or a struct size or
            panel width other than this side's (the message says which).
    """
    try:
        abi = lib.pagedllm_abi
    except AttributeError:
        raise RuntimeError("ABI mismatch: the library exports no pagedllm_abi()") from None
    abi.argtypes, abi.restype = [], ctypes.c_void_p
    address = abi()
    version, size = (ctypes.c_int64 * 2).from_address(address)  # read before trusting the layout
    if version != ABI_VERSION:
        raise RuntimeError(f"ABI mismatch: the library speaks ABI version {version}, this side {ABI_VERSION}")
    if size != ctypes.sizeof(AbiInfo):
        raise RuntimeError(f"ABI mismatch: pagedllm_abi_info is {size} bytes there, {ctypes.sizeof(AbiInfo)} here")
    info = AbiInfo.from_buffer_copy((ctypes.c_char * size).from_address(address))
    if info.llama_args_size != ctypes.sizeof(LlamaLayersArgs):
        raise RuntimeError(f"ABI mismatch: pagedllm_llama_args is {info.llama_args_size} bytes there, "
                           f"LlamaLayersArgs {ctypes.sizeof(LlamaLayersArgs)} here")
    if info.panel != PANEL:
        raise RuntimeError(f"ABI mismatch: weight panels of {info.panel} columns there, {PANEL} here")
    return info


def bind(path: Path | str) -> ctypes.CDLL:
    """Load a built library, check its ABI (:func:`check_abi`, kept as ``lib.abi``) and
    declare its functions' C signatures.

    Raises:
        OSError: the file cannot be loaded.
        RuntimeError: an ABI mismatch (no function is declared then).
    """
    lib = ctypes.CDLL(str(path))
    lib.abi = check_abi(lib)
    fn = lib.pagedllm_paged_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ctypes.c_int, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64,
                   ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    norm = lib.pagedllm_add_rms_norm_bf16
    norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int]
    norm.restype = ctypes.c_int
    gemm = lib.pagedllm_gemm_bf16w
    gemm.argtypes = [ctypes.c_int, ptr, i64, ptr, ptr, ctypes.c_int, ptr, i64, i64, i64, i64, ctypes.c_int]
    gemm.restype = ctypes.c_int
    lib.pagedllm_gemm_bf16_layout.argtypes = []
    lib.pagedllm_gemm_bf16_layout.restype = ctypes.c_int
    lib.pagedllm_gguf_int8_dot.argtypes = []
    lib.pagedllm_gguf_int8_dot.restype = ctypes.c_int
    w4 = lib.pagedllm_gemm_w4
    w4.argtypes = [ctypes.c_int, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
    w4.restype = ctypes.c_int
    gguf = lib.pagedllm_gemm_gguf
    gguf.argtypes = [ctypes.c_int, ptr, ctypes.c_int, ptr, i64, ctypes.c_int, ptr, i64, i64, i64, i64, ctypes.c_int]
    gguf.restype = ctypes.c_int
    mask = lib.pagedllm_apply_token_bitmask
    mask.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, ctypes.c_int]
    mask.restype = ctypes.c_int
    layers = lib.pagedllm_llama_layers_bf16
    layers.argtypes = [ctypes.POINTER(LlamaLayersArgs)]
    layers.restype = ctypes.c_int
    return lib


def openmp_runtimes() -> set[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux ``/proc/self/maps``).

    Our library needs ``libgomp.so.1``, which resolves to torch's bundled copy when torch is
    loaded first; other wheels may bring their own renamed copies (sentencepiece's
    ``libgomp-<hash>.so``), which are separate runtimes but not the kernel's."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if line.rstrip().endswith(".so") or ".so." in line}
    except OSError:
        return set()
    names = ("libgomp", "libiomp", "libomp")
    return {p for p in paths if any(os.path.basename(p).startswith(n) for n in names)}


def load(cache_dir: Path | None = None) -> ctypes.CDLL | None:
    """The loaded kernel library, built into ``cache_dir`` (default
    :func:`shared.config.kernel_cache_dir`) where it is not there yet; ``None`` if it cannot be
    built or loaded (logged once as ``cpu_kernels_unavailable``). The first call of the process
    decides: later calls return its result, whatever their ``cache_dir``."""
    global _lib, _tried
    if _tried:  # the per-layer path: no lock once decided
        return _lib
    with _lock:
        if not _tried:
            _tried = True
            try:
                _lib = bind(build(cache_dir=cache_dir))
                gomp = {p for p in openmp_runtimes() if os.path.basename(p) == "libgomp.so.1"}
                if len(gomp) > 1:  # our libgomp.so.1 is not torch's: two thread pools would spin
                    log.warning("cpu_kernels_two_openmp_runtimes", runtimes=sorted(gomp))
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                log.warning("cpu_kernels_unavailable", reason=str(exc)[:500])
        return _lib
