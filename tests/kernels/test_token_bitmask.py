"""The structured-output bitmask kernel (``kernels/cpu/csrc/cpu_token_bitmask.c``) against a
plain torch bit-unpacking reference: the same logits bit for bit."""

from __future__ import annotations

import pytest
import torch
from native_builds import NEEDS_KERNEL

from kernels.cpu import sampling_ops


def reference(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
    """-inf where bit t % 32 of ``mask[r, t // 32]`` is 0 (xgrammar's order), in place."""
    vocab = logits.shape[1]
    bits = (mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [R, W, 32]
    allowed = bits.flatten(1)[:, :vocab].bool()  # [R, V]
    for j, r in enumerate(rows):
        logits[r] = logits[r].masked_fill(~allowed[j], float("-inf"))


@NEEDS_KERNEL
@pytest.mark.parametrize("vocab", [32, 100, 49152, 49160])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4], [4, 0, 2], []])
def test_kernel_equals_torch(vocab, rows):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    words = (vocab + 31) // 32
    mask = torch.randint(-2**31, 2**31 - 1, (len(rows), words), generator=g, dtype=torch.int32)
    if rows:
        mask[0, : words // 2] = -1  # whole words allowed (skipped)
        mask[-1, words // 2:] = 0  # whole words forbidden
    want, got = logits.clone(), logits.clone()
    reference(want, mask, rows)
    assert sampling_ops.apply_token_bitmask(got, mask, rows)
    assert torch.equal(got, want)
    untouched = [r for r in range(5) if r not in rows]
    assert torch.equal(got[untouched], logits[untouched])


@NEEDS_KERNEL
def test_where_the_kernel_does_not_apply_nothing_changes(monkeypatch):
    logits = torch.randn(2, 64)
    narrow = torch.zeros(1, 1, dtype=torch.int32)  # 32 tokens for 64 logits: torch's path
    assert not sampling_ops.apply_token_bitmask(logits, narrow, [0])
    assert not sampling_ops.apply_token_bitmask(logits.double(), torch.zeros(1, 2, dtype=torch.int32), [0])
    def no_library(*args, **kwargs):
        raise AssertionError("loaded for a call the kernel does not serve")

    monkeypatch.setattr(sampling_ops, "load", no_library)  # checked before the library is asked for
    assert not sampling_ops.apply_token_bitmask(logits.double(), torch.zeros(1, 2, dtype=torch.int32), [0])
    monkeypatch.undo()
    with pytest.raises(ValueError, match="rows"):
        sampling_ops.apply_token_bitmask(logits, torch.zeros(1, 2, dtype=torch.int32), [2])
