"""The native CPU kernel library as the tests use it: built once per session (the
``kernel_library`` fixture of ``tests/conftest.py``, never at collection) for this CPU, and
rebuilt without some of its instruction-set extensions (the portable code paths other CPUs take),
once per session for each set of flags."""

from __future__ import annotations

import platform

import pytest

from kernels.cpu import native

# The test needs the library: it is built (or found) at the first such test of the session;
# without a C compiler the test is skipped (the torch path is used).
NEEDS_KERNEL = pytest.mark.usefixtures("kernel_library")
X86 = platform.machine() in ("x86_64", "AMD64")
# the portable bf16 paths (float32 scores, AVX2 + FMA GEMM tiles): one build for every test that needs it
NO_AVX512_BF16 = ("-mno-avx512bf16",)


def library_params(portable_flags: tuple[str, ...]) -> list:
    """Fixture params: the native build, and a portable build with ``portable_flags`` (x86 only)."""
    return [
        pytest.param(("native", ()), id="native"),
        pytest.param(("portable", portable_flags), id="portable",
                     marks=pytest.mark.skipif(not X86, reason=f"{' '.join(portable_flags)} is x86")),
    ]


def build_library(request: pytest.FixtureRequest):
    """The library for one of :func:`library_params`' params (``request.param``): the session's,
    or a portable one (built once per session for its flags: ``variant_library_path``). Skips
    the test without a compiler."""
    session_lib = request.getfixturevalue("kernel_library")
    variant, flags = request.param
    if variant == "native":
        return session_lib
    return native.bind(request.getfixturevalue("variant_library_path")(flags))
