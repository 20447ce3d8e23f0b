"""Mixture-of-experts architectures through the whole engine (``LLM``): 8 prompts together,
chunked prefill (32-token steps) and preemption in a pool too small for all of them, greedy
tokens equal Hugging Face's in float32; then the same over two tensor-parallel ranks (each
expert's intermediate size split, the partial outputs all-reduced)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "executor"))
from architectures import PROMPTS, hf_tokens, llm_tokens, tiny_checkpoint  # noqa: E402
from test_arch_moe import CONFIGS  # noqa: E402

#: the prompts and 12 new tokens each take about 37 blocks of 8; 18 makes the engine preempt
ENGINE = dict(max_num_batched_tokens=32, num_gpu_blocks_override=18, block_size=8)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_llm_greedy_equals_hugging_face_tp1_and_tp2(name, tmp_path, smollm2_path):
    tiny_checkpoint(CONFIGS[name](), tmp_path, smollm2_path)
    expected = hf_tokens(tmp_path, PROMPTS, 12)
    tokens, stats = llm_tokens(tmp_path, PROMPTS, 12, **ENGINE)
    assert tokens == expected
    assert stats.num_preemptions > 0
    tokens, _ = llm_tokens(tmp_path, PROMPTS, 12, tensor_parallel_size=2, **ENGINE)
    assert tokens == expected
