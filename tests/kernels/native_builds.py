"""The native CPU kernel library as the tests build it: for this CPU, and without some of its
instruction-set extensions (the portable code paths other CPUs take)."""

from __future__ import annotations

import os
import platform

import pytest

from kernels.cpu import native

NEEDS_KERNEL = pytest.mark.skipif(native.load() is None, reason="no C compiler: the torch path is used")
X86 = platform.machine() in ("x86_64", "AMD64")


def library_params(portable_flags: tuple[str, ...]) -> list:
    """Fixture params: the native build, and a portable build with ``portable_flags`` (x86 only)."""
    return [
        pytest.param(("native", ()), marks=NEEDS_KERNEL, id="native"),
        pytest.param(("portable", portable_flags), id="portable",
                     marks=[NEEDS_KERNEL, pytest.mark.skipif(not X86, reason=f"{' '.join(portable_flags)} is x86")]),
    ]


def build_library(param: tuple[str, tuple[str, ...]], tmp_path_factory):
    """The library for one of :func:`library_params`' params (portable: built in a temporary cache)."""
    variant, flags = param
    if variant == "native":
        return native.load()
    os.environ["PAGEDLLM_KERNEL_CACHE"] = str(tmp_path_factory.mktemp(variant))
    try:
        return native.bind(native.build(extra_flags=flags))
    finally:
        del os.environ["PAGEDLLM_KERNEL_CACHE"]
