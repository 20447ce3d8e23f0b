"""The sampler's C kernels (``csrc/cpu_token_bitmask.c``): a structured output's token
bitmask applied to CPU float32 logits."""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu.native import load


def apply_token_bitmask(
    logits: torch.Tensor,  # [N, V] float32 CPU, unit stride along V; changed in place
    bitmask: torch.Tensor,  # [R, W] int32, W * 32 >= V (xgrammar's bit order)
    rows: list[int],  # [R]: the logits row of each mask row, each in [0, N)
    lib: ctypes.CDLL | None = None,
) -> bool:
    """Set to -inf the logits of the tokens each row's mask forbids (``cpu_token_bitmask.c``,
    on ``torch.get_num_threads()`` threads). Returns False, changing nothing, where the kernel
    does not apply (no library, another device or dtype, a mask narrower than the logits): the
    caller's torch path serves then. The shapes are checked before the library is loaded, so a
    call that does not apply never builds it; the sampler calls this only with native CPU kernels
    on (``Sampler(native_kernels=True)``), where the runner loaded the library at start.

    Raises:
        ValueError: ``rows`` and the mask's rows differ in number, or a row is out of range.
    """
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
            or logits.stride(1) != 1 or bitmask.dtype != torch.int32 or bitmask.dim() != 2
            or bitmask.shape[1] * 32 < logits.shape[1]):
        return False  # checked first: another device never loads (nor builds) the library
    lib = lib or load()
    if lib is None:
        return False
    if len(rows) != bitmask.shape[0] or any(not 0 <= r < logits.shape[0] for r in rows):
        raise ValueError(f"rows must name {bitmask.shape[0]} rows of the {logits.shape[0]} logits rows")
    mask = bitmask.contiguous()
    index = torch.tensor(rows, dtype=torch.int64)
    status = lib.pagedllm_apply_token_bitmask(logits.data_ptr(), logits.stride(0), mask.data_ptr(), mask.shape[1],
                                              index.data_ptr(), len(rows), logits.shape[1], torch.get_num_threads())
    if status:
        raise ValueError(f"pagedllm_apply_token_bitmask refused its shapes (status {status})")
    return True
