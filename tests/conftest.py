"""Shared fixtures (a real nats-server per test session, the default model directory) and the
markers of the test layout.

The tests are laid out like the source (``tests/gateway/`` for ``gateway/``, ...). Every test
under ``tests/e2e/`` is marked ``e2e`` (the whole engine, its processes or the default model
end to end) and every test under ``tests/kernels/`` ``kernel`` (attention, GEMM and norm
kernels against their references). Elsewhere a test is marked ``heavy`` by hand for what it
does, not for how long it took:

- it loads a model: builds one and reads a checkpoint or GGUF file into it (a tiny random one
  or the default model), as the parity tests against transformers do;
- it starts a process that runs the engine's code (a service, tensor-parallel ranks); a
  nats-server, or a child of a few lines such as the supervisor's tests start, is not one;
- it runs a stateful property search (the block manager's hypothesis state machine).

``make test-fast`` runs the rest, the pure layer (``-m "not e2e and not kernel and not
heavy"``): the scheduler, block manager, gateway, messages, tokenizer, detokenizer and the
executor's layers, on fakes and the session's nats-server. ``make test`` runs every test.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _interpret_triton_without_a_gpu() -> None:
    """Set ``TRITON_INTERPRET=1`` before anything imports triton when the Triton kernel tests
    (tests/kernels/test_triton_kernels.py, test_fused_moe.py, test_quant_triton.py) will run on
    the CPU interpreter, as each of those modules does at its top.

    Triton fixes its mode at ``import triton`` (see test_triton_kernels.py's docstring), and
    collecting an earlier module imports it: transformers' model classes import torch._dynamo,
    which imports triton. Those modules then found triton compiled-mode, skipped their kernel
    tests here and ran them again in a fresh ``python -m pytest`` (a new interpreter importing
    torch and triton, three times a session). Setting it here runs them in this process; with
    a GPU (or ``PAGEDLLM_KERNEL_TEST_DEVICE=cuda``) nothing changes."""
    device = os.environ.get("PAGEDLLM_KERNEL_TEST_DEVICE")
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_triton_without_a_gpu()


def _one_thread_per_xdist_worker() -> None:
    """Under several pytest-xdist workers (``make test``'s ``TEST_WORKERS``), run each worker's
    torch, and the processes it starts (``OMP_NUM_THREADS``: services, engines), on one thread.
    The workers already fill the cores; an OpenMP team per process spin-waits for cores the other
    worker holds (services/executor/cpu_threads.py). Tests of threading set their counts themselves."""
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


_one_thread_per_xdist_worker()

TESTS_DIR = Path(__file__).resolve().parent
MARKER_OF_DIR = {"e2e": "e2e", "kernels": "kernel"}  # first folder under tests/ -> marker
CACHE_DIR = Path(os.environ.get("PAGEDLLM_CACHE_DIR", Path.home() / ".cache" / "pagedllm"))


@pytest.fixture(scope="session")
def nats_url():
    """URL of a real nats-server started for this test session."""
    from shared.nats_server import EmbeddedNats

    with EmbeddedNats() as server:
        yield server.url


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The default SmolLM2-135M-Instruct converted to a Hugging Face directory (once)."""
    from shared.model_source import convert_default_model

    return convert_default_model(CACHE_DIR)


@pytest.fixture(scope="module")
def smollm2_served(request, nats_url, smollm2_path, tmp_path_factory):
    """``(Settings, ModelInfo)`` serving the default model on the session's NATS server under a
    name of the requesting test module's own (its services' subjects are apart from other
    modules'), with that module's ``MAX_MODEL_LEN``."""
    from shared.config import Settings
    from shared.model_source import load_model_info

    settings = Settings(
        model=str(smollm2_path), served_model_name=f"test-{request.module.__name__}-{uuid.uuid4().hex[:8]}",
        nats_url=nats_url, cache_dir=tmp_path_factory.mktemp("cache"), max_model_len=request.module.MAX_MODEL_LEN,
    )
    return settings, load_model_info(settings)


@pytest.fixture(scope="session")
def kernel_library():
    """The native CPU kernel library, built once per session into ``CACHE_DIR / "kernels"``
    (found there when ``pagedllm prepare-model`` built it); skips the test only on a machine
    without a C compiler (the torch path is used there); with one, a library that does not
    build or load fails the test. Nothing builds it at collection."""
    from kernels.cpu import native
    from shared.config import kernel_cache_dir

    if native.find_compiler() is None:
        pytest.skip("no C compiler: the torch path is used")
    lib = native.load(kernel_cache_dir(CACHE_DIR))
    assert lib is not None, "a C compiler is here but the native CPU kernels did not build or load"
    return lib


@pytest.fixture(scope="session")
def variant_library_path(kernel_library, tmp_path_factory):
    """``build(flags) -> Path``: the native CPU kernel library built with ``extra_flags=flags``
    (a variant without some instruction-set extensions), compiled at most once per session for
    each set of flags (~15 s a build), each into a new directory of its own that holds nothing
    else (``test_build_caches_by_content`` checks the first build left only the library there).
    Skips the test without a C compiler (``kernel_library``)."""
    from kernels.cpu import native

    built: dict[tuple[str, ...], Path] = {}

    def build(flags: tuple[str, ...]) -> Path:
        if flags not in built:
            built[flags] = native.build(extra_flags=flags, cache_dir=tmp_path_factory.mktemp("variant"))
        return built[flags]

    return build


@pytest.fixture
def interleaved_gguf(monkeypatch):
    """GGUF weights of a multiple of 16 rows take the 16-row interleaved layout (``gguf_r16``) on any
    CPU, as with AVX512-VNNI; without VNNI the loader keeps the file's layout, and the interleaved
    groups the test asks for are multiplied unpacked by the float32 path."""
    from kernels.cpu import quant_ops

    monkeypatch.setattr(quant_ops, "gguf_int8_dot", lambda lib=None: True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test by its folder (``MARKER_OF_DIR``)."""
    for item in items:
        parts = Path(item.fspath).resolve().relative_to(TESTS_DIR).parts
        marker = MARKER_OF_DIR.get(parts[0]) if len(parts) > 1 else None
        if marker is not None:
            item.add_marker(marker)
