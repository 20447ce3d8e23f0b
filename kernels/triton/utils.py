"""Helpers shared by the Triton kernels, their tests and the benchmark.

* :class:`KernelLaunch`: a planned ``kernel[grid](**kwargs)``; the launchers build these in a
  ``plan_*`` function so the exact launch can also be compiled without running it.
* :func:`compile_launch`: compile a planned launch for a CUDA target (PTX and cubin through
  ptxas) on a machine with no GPU, with the same specialisation (dtypes, divisibility,
  constexprs) as a real launch would get. The CPU CI uses it to catch what the interpreter
  cannot (layouts, register/shared-memory limits, MLIR verifier errors).
* :func:`is_interpreted`: whether a kernel object was built by the CPU interpreter.

Nothing here queries CUDA at import time.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import triton
import triton.language as tl


class KernelLaunch(NamedTuple):
    """One kernel launch: ``kernel[grid](**kwargs)`` (kwargs include num_warps / num_stages)."""

    kernel: Any  # triton.runtime.JITFunction, or the interpreter's InterpretedFunction
    grid: tuple[int, ...]
    kwargs: dict[str, Any]

    def __call__(self) -> Any:
        """Launch; returns what Triton's launch returns (on a GPU the CompiledKernel, whose
        ``n_regs`` / ``n_spills`` / ``metadata.shared`` describe the build)."""
        return self.kernel[self.grid](**self.kwargs)


def is_interpreted(kernel: object) -> bool:
    """True when ``kernel`` was built by the Triton CPU interpreter (``TRITON_INTERPRET=1``).

    Triton 3.9 reads ``TRITON_INTERPRET`` when ``@triton.jit`` runs, i.e. when the module that
    defines the kernel is imported (not when ``triton`` is imported, nor at launch), so the
    truth at launch time is the kernel object's type rather than the environment.
    """
    return not isinstance(kernel, triton.runtime.JITFunction)


def compile_launch(launch: KernelLaunch, arch: int = 90) -> Any:
    """Compile ``launch`` for ``sm_<arch>`` without a GPU; returns triton's CompiledKernel.

    Mirrors ``JITFunction.run`` up to the compile (binder -> specialisation -> ``_pack_args``)
    with the target fixed instead of asked of the driver. Uses Triton internals of the pinned
    version (3.9); the tensors in ``launch.kwargs`` may live on the CPU (only dtype and
    alignment are read).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    assert not is_interpreted(kernel), "kernel was built under TRITON_INTERPRET=1"
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(launch.kwargs)
    kwargs.setdefault("debug", False)
    bound_args, specialization, options = binder(**kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound_args, specialization, options
    )
    src = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__)


@triton.jit
def round_bf16(v):
    """(Called from kernels: the interpreter's bf16 emulation.) float32 ``v`` rounded to the nearest bf16 (ties to even), kept in float32: the GPU's
    fp32 -> bf16 conversion, which the interpreter's truncating one does not match."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)
