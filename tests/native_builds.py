"""The native CPU kernel library as the tests use it: built once per session (the
``kernel_library`` fixture of ``tests/conftest.py``, never at collection) for this CPU, and
rebuilt without some of its instruction-set extensions (the portable code paths other CPUs take)."""

from __future__ import annotations

import platform

import pytest

from kernels.cpu import native

# The test needs the library: it is built (or found) at the first such test of the session;
# without a C compiler the test is skipped (the torch path is used).
NEEDS_KERNEL = pytest.mark.usefixtures("kernel_library")
X86 = platform.machine() in ("x86_64", "AMD64")


def library_params(portable_flags: tuple[str, ...]) -> list:
    """Fixture params: the native build, and a portable build with ``portable_flags`` (x86 only)."""
    return [
        pytest.param(("native", ()), id="native"),
        pytest.param(("portable", portable_flags), id="portable",
                     marks=pytest.mark.skipif(not X86, reason=f"{' '.join(portable_flags)} is x86")),
    ]


def build_library(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The library for one of :func:`library_params`' params (``request.param``): the session's,
    or a portable one built in a temporary cache directory. Skips the test without a compiler."""
    session_lib = request.getfixturevalue("kernel_library")
    variant, flags = request.param
    if variant == "native":
        return session_lib
    return native.bind(native.build(extra_flags=flags, cache_dir=tmp_path_factory.mktemp(variant)))
