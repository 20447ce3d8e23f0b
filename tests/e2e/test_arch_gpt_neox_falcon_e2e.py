"""GPT-NeoX and Falcon (its new decoder architecture with grouped KV heads, and the older
multi-query form) through the whole engine (``LLM``: every service, the 8 prompts together,
chunked prefill, preemption in a small block pool), on one rank and on two: greedy tokens
equal Hugging Face ``generate``'s in float32 (``tests/architectures.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from architectures import PROMPTS, hf_tokens, llm_tokens, tiny_checkpoint

sys.path.insert(0, str(Path(__file__).parents[1] / "executor"))
from test_arch_gpt_neox_falcon import falcon, neox  # noqa: E402

CONFIGS = {
    "gpt-neox": lambda: neox(True),  # 4 heads: 2 per rank, each de-interleaved from query_key_value
    "falcon-new-arch-gqa": lambda: falcon(new_decoder_architecture=True, num_kv_heads=2),  # 1 KV group per rank
    "falcon-mqa": lambda: falcon(multi_query=True, parallel_attn=True),  # the one KV head on both ranks
}
# 197 prompt tokens + 8 x 12 new ones need 41 blocks of 8: 16 blocks force preemptions
ENGINE = dict(max_num_batched_tokens=32, num_gpu_blocks_override=16, block_size=8)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_engine_gives_hugging_face_greedy_tokens(name, tmp_path, smollm2_path):
    tiny_checkpoint(CONFIGS[name](), tmp_path, smollm2_path)
    expected = hf_tokens(tmp_path, PROMPTS, 12)
    assert len({tuple(t) for t in expected}) > 1
    tokens, stats = llm_tokens(tmp_path, PROMPTS, 12, **ENGINE)
    assert stats.num_preemptions > 0
    assert tokens == expected
    tokens, stats = llm_tokens(tmp_path, PROMPTS, 12, tensor_parallel_size=2, **ENGINE)
    assert stats.num_preemptions > 0
    assert tokens == expected
