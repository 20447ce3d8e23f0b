"""Hugging Face safetensors checkpoints -> a model's parameters, through each parameter's ``weight_loader``.

As vLLM's ``load_weights``: a checkpoint tensor whose name holds a stacked shard
(``stacked_params_mapping``: ``(param_name, shard_name, shard_id)``, e.g. ``(".qkv_proj",
".q_proj", "q")``) goes to that shard of the merged parameter; any other to the parameter of
its own name. Values are cast to the parameter's dtype.

A weight loader receives a :class:`CheckpointTensor`, not a tensor: nothing is read until the
loader asks, and a tensor-parallel rank asks only for its slice (``narrow``), so each rank
reads its share of the checkpoint, not all of it. Tensors are read with ``pread`` in chunks
straight into the parameters (allocated once, in the serving dtype), so loading holds about
one chunk besides the weights: ``benchmarks/load_memory.py`` measures it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
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


#: safetensors dtype names -> torch dtypes (https://github.com/huggingface/safetensors: the format's header)
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
#: the most bytes of a checkpoint tensor read at once (a larger one is copied in row chunks)
READ_CHUNK_BYTES = 16 << 20


class CheckpointTensor:
    """One tensor of a safetensors file, read on demand with ``os.pread`` (no memory map:
    pages of the file never count in the process's memory): ``shape``; ``narrow(dim, start,
    length)`` reads only those rows (``dim`` 0) or columns (``dim`` 1); ``copy_into(dst)``
    copies it into a parameter (cast to its dtype) ``READ_CHUNK_BYTES`` at a time, so loading
    holds at most one chunk besides the parameters; ``load()`` reads it whole.

    The file format: an 8-byte little-endian header length, a JSON header mapping each name
    to its ``dtype``, ``shape`` and ``data_offsets`` (from the end of the header), then the
    data, row-major.
    """

    def __init__(self, fd: int, name: str, entry: dict, data_start: int) -> None:
        self.name, self._fd = name, fd
        self.dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if self.dtype is None:
            raise ValueError(f"{name}: safetensors dtype {entry['dtype']} is not supported")
        self.shape = tuple(entry["shape"])
        self._start = data_start + entry["data_offsets"][0]
        self._row_bytes = (math.prod(self.shape[1:]) if self.shape else 1) * torch.empty((), dtype=self.dtype).element_size()

    def _rows(self, start: int, count: int) -> torch.Tensor:  # rows [start, start + count), shaped
        size = count * self._row_bytes
        data = torch.empty(size, dtype=torch.uint8)  # not zero-filled: read straight into it
        view, done = memoryview(data.numpy()), 0
        while done < size:  # pread may return fewer bytes than asked
            got = os.preadv(self._fd, [view[done:]], self._start + start * self._row_bytes + done)
            if got <= 0:
                raise ValueError(f"{self.name}: the file ends inside the tensor")
            done += got
        return data.view(self.dtype).view((count, *self.shape[1:]) if self.shape else ())

    def _chunk_rows(self) -> int:
        return max(1, READ_CHUNK_BYTES // max(1, self._row_bytes))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self._rows(start, length)
        parts = [self._rows(r, min(self._chunk_rows(), self.shape[0] - r)).narrow(dim, start, length).clone()
                 for r in range(0, self.shape[0], self._chunk_rows())]
        return torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype)

    def load(self) -> torch.Tensor:
        return self._rows(0, self.shape[0]) if self.shape else self._rows(0, 1)

    def copy_into(self, dst: torch.Tensor) -> None:
        """``dst.copy_(tensor)`` (``dst`` of the same shape; cast), one chunk of rows at a time."""
        if not self.shape:
            dst.copy_(self.load())
            return
        step = self._chunk_rows()
        for r in range(0, self.shape[0], step):
            n = min(step, self.shape[0] - r)
            dst.narrow(0, r, n).copy_(self._rows(r, n))


@contextlib.contextmanager
def open_safetensors(file: Path) -> Iterator[dict[str, CheckpointTensor]]:
    """The tensors of one safetensors file by name, readable while the context is open.

    Raises:
        ValueError: a dtype this reader does not know.
    """
    fd = os.open(file, os.O_RDONLY)
    try:
        (header_len,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        header = json.loads(os.pread(fd, header_len, 8))
        header.pop("__metadata__", None)
        yield {name: CheckpointTensor(fd, name, entry, 8 + header_len) for name, entry in header.items()}
    finally:
        os.close(fd)


def _checkpoint_tensors(files: list[Path]) -> Iterator[CheckpointTensor]:
    """Every tensor of the files, each read only when (and as far as) its loader asks."""
    for file in files:
        with open_safetensors(file) as tensors:
            yield from tensors.values()


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
