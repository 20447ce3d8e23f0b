"""The structured-output bitmask kernel (``kernels/cpu/csrc/cpu_token_bitmask.c``) against the
torch path (``shared.structured_output.apply_token_bitmask``): the same logits bit for bit."""

from __future__ import annotations

import pytest
import torch
from native_builds import NEEDS_KERNEL

from kernels.cpu import sampling_ops
from shared.structured_output import apply_token_bitmask


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
    apply_token_bitmask(want, mask, rows)
    assert sampling_ops.apply_token_bitmask(got, mask, rows)
    assert torch.equal(got, want)
    untouched = [r for r in range(5) if r not in rows]
    assert torch.equal(got[untouched], logits[untouched])


@NEEDS_KERNEL
def test_where_the_kernel_does_not_apply_nothing_changes():
    logits = torch.randn(2, 64)
    narrow = torch.zeros(1, 1, dtype=torch.int32)  # 32 tokens for 64 logits: torch's path
    assert not sampling_ops.apply_token_bitmask(logits, narrow, [0])
    assert not sampling_ops.apply_token_bitmask(logits.double(), torch.zeros(1, 2, dtype=torch.int32), [0])
    with pytest.raises(ValueError, match="rows"):
        sampling_ops.apply_token_bitmask(logits, torch.zeros(1, 2, dtype=torch.int32), [2])
