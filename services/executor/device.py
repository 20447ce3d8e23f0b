"""Which torch device the executor runs on (light: imports torch only)."""

from __future__ import annotations

import torch


def resolve_device(setting: str) -> torch.device:
    """The device for the ``device`` setting: ``auto`` is CUDA when torch sees a GPU, else the CPU."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)
