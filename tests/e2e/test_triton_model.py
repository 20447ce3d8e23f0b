"""The whole SmolLM2 model with the Triton attention backend (under the interpreter on the
CPU, in a fresh process) gives the same greedy tokens as the torch backend (in this one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "scripts" / "greedy_with_backend.py"
sys.path.insert(0, str(SCRIPT.parent))
from greedy_with_backend import greedy as greedy_here  # noqa: E402


def greedy_interpreted(model_dir: Path, backend: str) -> dict:
    """The script's output in a fresh process with ``TRITON_INTERPRET=1``."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, str(SCRIPT), str(model_dir), backend, "4"], env=env,
                         capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_triton_backend_matches_torch_backend_on_smollm2(smollm2_path):
    triton = greedy_interpreted(smollm2_path, "triton")
    torch_ = greedy_here(str(smollm2_path), "torch", 4)  # no Triton: no fresh process needed
    assert triton["backend"] == "TritonBackend" and torch_["backend"] == "TorchBackend"
    assert triton["tokens"] == torch_["tokens"]
    assert all(len(v) == 4 for v in torch_["tokens"].values())
