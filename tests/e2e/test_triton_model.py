"""The whole SmolLM2 model with the Triton attention backend (under the interpreter on the
CPU) gives the same greedy tokens as the torch backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "scripts" / "greedy_with_backend.py"


def greedy(model_dir: Path, backend: str, interpret: bool) -> dict:
    env = dict(os.environ)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run([sys.executable, str(SCRIPT), str(model_dir), backend, "4"], env=env,
                         capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_triton_backend_matches_torch_backend_on_smollm2(smollm2_path):
    triton = greedy(smollm2_path, "triton", interpret=True)
    torch_ = greedy(smollm2_path, "torch", interpret=False)
    assert triton["backend"] == "TritonBackend" and torch_["backend"] == "TorchBackend"
    assert triton["tokens"] == torch_["tokens"]
    assert all(len(v) == 4 for v in torch_["tokens"].values())
