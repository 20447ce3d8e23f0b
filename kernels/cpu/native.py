"""The native CPU kernel library (``csrc/``): built once with the machine's C compiler, loaded with ctypes.

The shared library is compiled with ``-O3 -march=native -fopenmp -ffast-math`` (then linked
without ``-ffast-math``) on first use into ``$PAGEDLLM_KERNEL_CACHE`` (default ``~/.cache/pagedllm/kernels``), named by a hash of the
sources, the flags, the compiler's version, its predefined macros under those flags (what
``-march=native`` enables) and the CPU's feature flags, so a changed source or
another machine builds its own. Without a compiler (or if the build fails) :func:`load`
returns ``None`` once, logs why, and the caller keeps its torch path. The kernels' Python
wrappers are in :mod:`kernels.cpu.ops`.
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

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / n for n in ("cpu_paged_attention.c", "cpu_rms_norm.c", "cpu_gemm_bf16.c", "cpu_llama_layers.c")]
HEADERS = [CSRC / "cpu_bf16.h"]
# -ffast-math only when compiling (vectorised expf): linking with it would add gcc's
# crtfastmath.o, which turns on flush-to-zero for the whole process when the library loads.
COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC", "-c"]
LINK_FLAGS = ["-shared", "-fopenmp"]
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 128  # as in the C source

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    return Path(os.environ.get("PAGEDLLM_KERNEL_CACHE", Path.home() / ".cache" / "pagedllm" / "kernels"))


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def build(compiler: str | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile the kernels (if not already built) and return the shared library's path.

    ``extra_flags`` go after ``-march=native`` (the tests build a portable variant with
    ``-mno-avx512bf16``).

    Raises:
        RuntimeError: no C compiler, or the compiler failed (its output in the message).
    """
    cc = compiler or os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc or not shutil.which(cc):
        raise RuntimeError(f"no C compiler found ({cc or 'gcc/cc'}; set CC or install gcc)")
    compile_flags = [*COMPILE_FLAGS, *extra_flags]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    # what -march=native turns on here (AVX512-BF16 or not ...): a shared cache never hands one
    # CPU's build to another, even where /proc/cpuinfo cannot be read
    macros = subprocess.run([cc, *(f for f in compile_flags if f != "-c"), "-E", "-dM", "-x", "c", os.devnull],
                            capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join([*(src.read_text() for src in SOURCES + HEADERS), " ".join(compile_flags + LINK_FLAGS), *version,
                   macros, cpu_flags(), torch.__version__]).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"pagedllm_cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # per builder: concurrent builds are safe
        objs = [str(Path(tmp) / f"{src.stem}.o") for src in SOURCES]
        lib = Path(tmp) / "kernels.so"
        cmds = [[cc, *compile_flags, str(src), "-o", obj] for src, obj in zip(SOURCES, objs, strict=True)]
        for cmd in [*cmds, [cc, *LINK_FLAGS, *objs, "-o", str(lib), "-lm"]]:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        umask = os.umask(0)
        os.umask(umask)
        lib.chmod(0o755 & ~umask)  # readable by every user of a shared cache directory
        os.replace(lib, target)  # atomic
    return target


_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)


class LlamaLayersArgs(ctypes.Structure):
    """The argument block of ``pagedllm_llama_layers_bf16`` (``cpu_llama_layers.c``): the
    model's pointers (per-layer arrays, set once) and the step's (set per forward)."""

    _fields_ = [
        *[(n, ctypes.c_int64) for n in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "inter",
                                        "block_size", "num_slots")],
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        *[(n, _PP) for n in ("in_norm", "post_norm", "qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w", "gate_up_b",
                             "down_w", "down_b", "k_cache", "v_cache")],
        ("T", ctypes.c_int64), ("h", _P), ("cos", _P), ("sin", _P), ("slots", _P), ("block_index", _P),
        ("nblk", ctypes.c_int64), ("row_seq", _P), ("row_len", _P),
        *[(n, _P) for n in ("x", "qkv", "attn", "gate_up", "act", "delta")],
        ("num_threads", ctypes.c_int),
    ]


def bind(path: Path | str) -> ctypes.CDLL:
    """Load a built library and declare its functions' C signatures."""
    lib = ctypes.CDLL(str(path))
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


def load() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; ``None`` if it cannot be built."""
    global _lib, _tried
    if _tried:  # the per-layer path: no lock once decided
        return _lib
    with _lock:
        if not _tried:
            _tried = True
            try:
                _lib = bind(build())
                gomp = {p for p in openmp_runtimes() if os.path.basename(p) == "libgomp.so.1"}
                if len(gomp) > 1:  # our libgomp.so.1 is not torch's: two thread pools would spin
                    log.warning("cpu_kernels_two_openmp_runtimes", runtimes=sorted(gomp))
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                log.warning("cpu_kernels_unavailable", reason=str(exc)[:500])
        return _lib
