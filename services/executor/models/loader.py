"""Hugging Face safetensors checkpoints -> a model's parameters, through each parameter's ``weight_loader``.

As vLLM's ``load_weights``: a checkpoint tensor whose name holds a stacked shard
(``stacked_params_mapping``: ``(param_name, shard_name, shard_id)``, e.g. ``(".qkv_proj",
".q_proj", "q")``) goes to that shard of the merged parameter; any other to the parameter of
its own name. Values are cast to the parameter's dtype.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from services.executor.layers.utils import default_weight_loader

StackedParamsMapping = list[tuple[str, str, str | int]]  # (param_name, shard_name, shard_id)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files: the shards listed in ``model.safetensors.index.json``, else every
    ``*.safetensors``.

    Raises:
        FileNotFoundError: no ``*.safetensors`` in ``model_dir``.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def _checkpoint_tensors(files: list[Path]) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(name, read the tensor) for every tensor of the files, read lazily."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, lambda f=f, name=name: f.get_tensor(name)


@torch.no_grad()
def load_weights(model: nn.Module, model_dir: Path | str, stacked_params_mapping: StackedParamsMapping,
                 skip: Callable[[str], bool]) -> None:
    """Load every parameter of ``model`` from the checkpoint in ``model_dir`` (one file, or
    the shards of ``model.safetensors.index.json``).

    Checkpoint names without the ``model.`` prefix are read with it. A tensor that matches no
    parameter is ignored when ``skip(name)`` (rotary caches, a tied ``lm_head.weight``).

    Raises:
        FileNotFoundError: no ``*.safetensors`` in ``model_dir``.
        ValueError: a parameter is missing, has the wrong shape (``<name>: checkpoint shape
            ... != expected ...``), or the checkpoint holds tensors this architecture does not
            know (e.g. Qwen3's q_norm).
    """
    model_dir = Path(model_dir)
    files = safetensors_files(model_dir)
    # checkpoint name -> (parameter, shard id or None): one entry per shard of a stacked parameter
    targets: dict[str, tuple[nn.Parameter, str | int | None]] = {}
    for name, param in model.named_parameters():
        shards = [(name.replace(p, s), i) for p, s, i in stacked_params_mapping if p in name]
        for checkpoint_name, shard_id in shards or [(name, None)]:
            targets[checkpoint_name] = (param, shard_id)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, read in _checkpoint_tensors(files):
        key = name if name in targets or name.startswith("model.") else "model." + name
        if key not in targets:
            if not skip(name):
                unexpected.append(name)
            continue
        param, shard_id = targets[key]
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard_id is None:
                weight_loader(param, read())
            else:
                weight_loader(param, read(), shard_id)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        loaded.add(key)
    if unexpected:
        raise ValueError(f"{len(unexpected)} unexpected tensors in {model_dir}, e.g. {unexpected[:5]}")
    missing = sorted(set(targets) - loaded)
    if missing:
        raise ValueError(f"{len(missing)} tensors missing from {model_dir}, e.g. {missing[:5]}")
