"""Hugging Face safetensors checkpoints -> a model's parameters, through each parameter's ``weight_loader``.

As vLLM's ``load_weights``: a checkpoint tensor whose name holds a stacked shard
(``stacked_params_mapping``: ``(param_name, shard_name, shard_id)``, e.g. ``(".qkv_proj",
".q_proj", "q")``) goes to that shard of the merged parameter; any other to the parameter of
its own name. Values are cast to the parameter's dtype.

A weight loader receives a :class:`CheckpointTensor`, not a tensor: nothing is read until the
loader asks, and a tensor-parallel rank asks only for its slice (``narrow``, through
safetensors' ``get_slice``), so each rank reads its share of the checkpoint, not all of it.
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


class CheckpointTensor:
    """One tensor of a safetensors file, read on demand: ``shape``; ``narrow(dim, start,
    length)`` reads only those rows (``dim`` 0) or columns (``dim`` 1); ``load()`` reads it whole."""

    def __init__(self, handle: object, name: str) -> None:
        self._handle, self.name = handle, name
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]

    def load(self) -> torch.Tensor:
        return self._handle.get_tensor(self.name)


def _checkpoint_tensors(files: list[Path]) -> Iterator[CheckpointTensor]:
    """Every tensor of the files, each read only when (and as far as) its loader asks."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield CheckpointTensor(f, name)


@torch.no_grad()
def load_weights(model: nn.Module, model_dir: Path | str, stacked_params_mapping: StackedParamsMapping,
                 skip: Callable[[str], bool], rename: Callable[[str], str] | None = None) -> None:
    """Load every parameter of ``model`` from the checkpoint in ``model_dir`` (one file, or
    the shards of ``model.safetensors.index.json``).

    Each checkpoint name goes through ``rename`` first (an architecture whose checkpoints name
    things otherwise); names without the ``model.`` prefix are read with it. A tensor that
    matches no parameter is ignored when ``skip(name)`` (rotary caches, a tied ``lm_head.weight``).

    Raises:
        FileNotFoundError: no ``*.safetensors`` in ``model_dir``.
        ValueError: a parameter is missing, has the wrong shape (``<name>: checkpoint shape
            ... != expected ...``), or the checkpoint holds tensors this architecture does not
            know.
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
    for tensor in _checkpoint_tensors(files):
        name = rename(tensor.name) if rename is not None else tensor.name
        key = name if name in targets or name.startswith("model.") else "model." + name
        if key not in targets:
            if not skip(name):
                unexpected.append(name)
            continue
        param, shard_id = targets[key]
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard_id is None:
                weight_loader(param, tensor)
            else:
                weight_loader(param, tensor, shard_id)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        loaded.add(key)
    if unexpected:
        raise ValueError(f"{len(unexpected)} unexpected tensors in {model_dir}, e.g. {unexpected[:5]}")
    missing = sorted(set(targets) - loaded)
    if missing:
        raise ValueError(f"{len(missing)} tensors missing from {model_dir}, e.g. {missing[:5]}")
