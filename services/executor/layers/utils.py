"""What every layer shares: a module base without per-call overhead, and the default weight loader."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class FastModule(nn.Module):
    """An ``nn.Module`` whose forward pass pays no per-call module machinery.

    ``nn.Module.__call__`` (hook dispatch) and ``nn.Module.__getattr__`` (submodules and
    parameters live in ``_modules`` / ``_parameters``, found only after a failed attribute
    lookup) each cost ten or more times a plain attribute read; a decoder step makes a few
    hundred such calls and lookups, which is measurable next to a CPU decode step of a small
    model (benchmarks/RESULTS.md, "Figures moved out of the code"). So:

    - calling the module runs its ``forward`` directly (``__call__`` is ``forward``): module
      hooks do not run (nothing here registers any);
    - every submodule and parameter is also a plain instance attribute (a reference in
      ``__dict__``, kept equal to the registered one by ``__setattr__``, ``register_parameter``,
      ``add_module``, ``__delattr__`` and ``_apply``), so ``self.weight`` is a dict lookup.
      Loading copies into the parameters in place, which keeps the references valid.

    Everything else (``named_parameters``, ``state_dict``, ``to``, ...) is ``nn.Module``'s.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "forward" in cls.__dict__:
            cls.__call__ = cls.forward

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        self._mirror(name)

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        self.__dict__.pop(name, None)

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        super().register_parameter(name, param)
        self._mirror(name)

    def add_module(self, name: str, module: nn.Module | None) -> None:
        super().add_module(name, module)
        self._mirror(name)

    def _apply(self, fn: Any, recurse: bool = True) -> FastModule:
        out = super()._apply(fn, recurse)
        for name in self._parameters:  # a conversion may have put new Parameter objects there
            self._mirror(name)
        return out

    def _mirror(self, name: str) -> None:
        for registry in (self.__dict__.get("_parameters"), self.__dict__.get("_modules")):
            if registry is not None and name in registry:
                self.__dict__[name] = registry[name]
                return


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    """Attach loading metadata (``weight_loader``, ...) to a parameter, as vLLM does."""
    for key, value in attrs.items():
        setattr(param, key, value)


def copy_checked(dst: torch.Tensor, loaded_weight: torch.Tensor | Any) -> None:
    """``dst.copy_(loaded_weight)`` (cast to ``dst``'s dtype) after checking the shapes.

    ``loaded_weight`` is a tensor, or a checkpoint tensor not read yet (``model_loader/loader.py``'s
    ``CheckpointTensor``: ``shape``, ``narrow``, ``load``, ``copy_into``), read only once the
    shapes agree, chunk by chunk into ``dst``.

    Raises:
        ValueError: ``checkpoint shape (...) != expected (...)`` (the loader prefixes the
            checkpoint tensor's name).
    """
    if tuple(loaded_weight.shape) != tuple(dst.shape):
        raise ValueError(f"checkpoint shape {tuple(loaded_weight.shape)} != expected {tuple(dst.shape)}")
    if isinstance(loaded_weight, torch.Tensor):
        dst.copy_(loaded_weight)
    else:  # read in chunks straight into dst
        loaded_weight.copy_into(dst)


def narrow_checked(loaded_weight: torch.Tensor | Any, dim: int, start: int, length: int,
                   full_size: int) -> torch.Tensor:
    """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, start + length)`` of a checkpoint tensor
    whose ``dim`` must be ``full_size`` long; a not-yet-read ``CheckpointTensor`` reads only
    that slice (``safe_open(...).get_slice``).

    Raises:
        ValueError: ``checkpoint shape (...) != expected (...)`` (``dim`` differs).
    """
    shape = tuple(loaded_weight.shape)
    if len(shape) <= dim or shape[dim] != full_size:
        expected = shape[:dim] + (full_size,) + shape[dim + 1 :]
        raise ValueError(f"checkpoint shape {shape} != expected {expected}")
    return loaded_weight.narrow(dim, start, length)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor | Any) -> None:
    """The whole checkpoint tensor into the whole parameter (vLLM's ``default_weight_loader``)."""
    copy_checked(param.data, loaded_weight)
