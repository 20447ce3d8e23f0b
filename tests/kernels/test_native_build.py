"""Building, caching and loading the native CPU kernel library (kernels/cpu/native.py): the cache
directory, the compiler timeouts, the ABI check, and what loading it does to the process."""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import structlog
from native_builds import NEEDS_KERNEL, NO_AVX512_BF16, X86

from kernels.cpu import native

ROOT = Path(__file__).resolve().parents[2]
# A library that speaks another ABI: pagedllm_abi() reports the -D values it was compiled with.
FAKE_ABI_SOURCE = """
#include <stdint.h>
typedef struct { int64_t version, abi_size, llama_args_size, max_group, max_head_dim, max_block, max_rope_dim,
                 panel, max_shards; } info_t;
static const info_t info = {VERSION, sizeof(info_t), ARGS_SIZE, 16, 256, 128, 512, PANEL, 3};
#ifndef NO_ABI
const info_t* pagedllm_abi(void) { return &info; }
#endif
int pagedllm_paged_attention(void) { return 0; }
"""


def test_build_without_a_compiler_fails_clearly(tmp_path):
    with pytest.raises(RuntimeError, match="no C compiler"):
        native.build(compiler="/nonexistent/cc", cache_dir=tmp_path)


@NEEDS_KERNEL
def test_build_caches_by_content(variant_library_path):
    """A build into an empty cache directory leaves only the library there, readable by other
    users; building again finds it (not rebuilt). The first build is the session's portable one
    (``variant_library_path``: made in a new directory, shared with the kernel tests of that
    variant), not a third compile of the same sources."""
    flags = NO_AVX512_BF16 if X86 else ()
    first = variant_library_path(flags)
    cache_dir = first.parent
    mtime = first.stat().st_mtime_ns
    assert native.build(extra_flags=flags, cache_dir=cache_dir) == first  # found by its content key
    assert first.stat().st_mtime_ns == mtime  # not rebuilt
    assert [p.name for p in cache_dir.iterdir()] == [first.name]  # no temp files left
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(first.stat().st_mode) == 0o755 & ~umask  # other users can load a shared cache


@NEEDS_KERNEL
def test_a_compile_past_its_timeout_is_a_failed_build(tmp_path, monkeypatch):
    """The compiler is killed at COMPILE_TIMEOUT_S: build() raises, nothing is left in the
    cache, and load() reports the library unavailable (the torch path serves)."""
    monkeypatch.setattr(native, "COMPILE_TIMEOUT_S", 0.001)
    with pytest.raises(RuntimeError, match=r"timed out after 0\.001 s"):
        native.build(cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(native, "_tried", False)  # a fresh process's first load (restored after)
    monkeypatch.setattr(native, "_lib", None)
    with structlog.testing.capture_logs() as logs:
        assert native.load(tmp_path) is None
    assert [e["event"] for e in logs] == ["cpu_kernels_unavailable"] and "timed out" in logs[0]["reason"]


def test_the_library_reports_its_abi(kernel_library):
    abi = kernel_library.abi
    assert (abi.version, abi.abi_size, abi.llama_args_size, abi.panel) == (
        native.ABI_VERSION, ctypes.sizeof(native.AbiInfo), ctypes.sizeof(native.LlamaLayersArgs), native.PANEL)
    assert (abi.max_group, abi.max_head_dim, abi.max_block, abi.max_rope_dim, abi.max_shards) == (16, 256, 128, 512, 3)


def _fake_library(tmp_path: Path, name: str, **defines: int) -> Path:
    src, lib = tmp_path / f"{name}.c", tmp_path / f"{name}.so"
    src.write_text(FAKE_ABI_SOURCE)
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    flags = [f"-D{k}={v}" for k, v in defines.items()]
    subprocess.run([cc, "-shared", "-fPIC", *flags, str(src), "-o", str(lib)], check=True, timeout=60)
    return lib


@NEEDS_KERNEL
@pytest.mark.parametrize(("defines", "reason"), [
    ({"VERSION": 999}, f"ABI version 999, this side {native.ABI_VERSION}"),
    ({"ARGS_SIZE": 8}, "pagedllm_llama_args is 8 bytes there"),
    ({"PANEL": 32}, "panels of 32 columns there"),
    ({"NO_ABI": 1}, "exports no pagedllm_abi"),
], ids=["version", "struct_size", "panel", "no_abi"])
def test_a_library_of_another_abi_is_refused(tmp_path, monkeypatch, defines, reason):
    """bind() checks pagedllm_abi() before declaring any function; load() then logs why and
    returns None, so the torch path serves."""
    values = {"VERSION": native.ABI_VERSION, "ARGS_SIZE": ctypes.sizeof(native.LlamaLayersArgs),
              "PANEL": native.PANEL} | defines
    lib = _fake_library(tmp_path, "fake", **values)
    with pytest.raises(RuntimeError, match=f"ABI mismatch: .*{reason}"):
        native.bind(lib)
    monkeypatch.setattr(native, "build", lambda **kw: lib)
    monkeypatch.setattr(native, "_tried", False)  # a fresh process's first load (restored after)
    monkeypatch.setattr(native, "_lib", None)
    with structlog.testing.capture_logs() as logs:
        assert native.load(tmp_path) is None
    assert [e["event"] for e in logs] == ["cpu_kernels_unavailable"] and reason in logs[0]["reason"]


def test_load_builds_into_the_cache_dir_it_is_given(tmp_path, monkeypatch):
    """The cache directory is a parameter (Settings.cache_dir / "kernels"); without one,
    Settings.cache_dir as the environment sets it (PAGEDLLM_CACHE_DIR), else
    ~/.cache/pagedllm/kernels."""
    from shared.config import DEFAULT_CACHE_DIR, kernel_cache_dir

    asked = []
    monkeypatch.setattr(native, "build", lambda **kw: asked.append(kw["cache_dir"]) or tmp_path / "none.so")
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    with structlog.testing.capture_logs():
        assert native.load(tmp_path / "kernels") is None  # no such file: OSError, logged
        assert native.load(tmp_path / "elsewhere") is None  # the first call decided
    assert asked == [tmp_path / "kernels"]
    monkeypatch.delenv("PAGEDLLM_CACHE_DIR", raising=False)
    assert kernel_cache_dir() == DEFAULT_CACHE_DIR / "kernels" == Path.home() / ".cache" / "pagedllm" / "kernels"
    assert kernel_cache_dir("~/x") == Path.home() / "x" / "kernels"
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "models"))  # as the Docker image sets it
    assert kernel_cache_dir() == tmp_path / "models" / "kernels"
    assert kernel_cache_dir(tmp_path / "given") == tmp_path / "given" / "kernels"


@NEEDS_KERNEL
def test_loading_keeps_denormals(kernel_library):
    """The library is linked without -ffast-math's crtfastmath.o: loading it must not turn on
    flush-to-zero for the process (torch and Python floats keep their denormals)."""
    code = (
        "import sys, torch; from kernels.cpu import native; native.bind(sys.argv[1]); "
        "assert 5e-324 * 1.0 != 0.0; assert float((torch.tensor([1e-40]) * 2)[0]) != 0.0; "
        "assert float((torch.full((1 << 20,), 1e-40) * 2).min()) != 0.0"
    )
    proc = subprocess.run([sys.executable, "-c", code, kernel_library._name], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


@NEEDS_KERNEL
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_the_kernel_shares_torchs_openmp_runtime():
    """One libgomp.so.1 in the process (torch's): the kernel's threads are torch's threads."""
    runtimes = native.openmp_runtimes()
    gomp = [p for p in runtimes if os.path.basename(p) == "libgomp.so.1"]
    assert len(gomp) == 1 and "torch" in gomp[0], runtimes


def test_prepare_model_builds_into_the_settings_cache_dir(tmp_path, monkeypatch, kernel_library):
    """``pagedllm prepare-model`` builds the library into ``Settings.cache_dir / "kernels"`` for a
    CPU executor with native kernels, so executors find it built; with them off it builds nothing."""
    from pagedllm.cli import prepare_cpu_kernels
    from shared.config import Settings

    built = []
    monkeypatch.setattr(native, "build", lambda **kw: built.append(kw["cache_dir"]) or Path(kernel_library._name))
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    assert prepare_cpu_kernels(Settings(cache_dir=tmp_path, device="cpu", native_cpu_kernels=False)) == (
        "native CPU kernels: not used with these settings")
    assert built == []
    line = prepare_cpu_kernels(Settings(cache_dir=tmp_path, device="cpu"))
    assert built == [tmp_path / "kernels"] and line == f"native CPU kernels ready at {kernel_library._name}"
