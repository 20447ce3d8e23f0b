"""Shared fixtures: a real nats-server per test session and the default model directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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
