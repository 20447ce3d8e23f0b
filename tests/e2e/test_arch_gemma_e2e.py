"""Gemma, Gemma 2 and Gemma 3 text through the whole engine (``LLM.generate``): 8 prompts
together in a pool small enough to preempt, chunked prefill, on one rank and on two
(tensor parallelism: 2 of the 4 query heads and 1 of the 2 KV heads per rank); greedy tokens
equal Hugging Face's in float32. The tiny configs are the parity tests' (sliding window of 16
tokens on Gemma 2/3's sliding layers, soft caps, Gemma 3's per-layer-type RoPE)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from architectures import PROMPTS, hf_tokens, llm_tokens, tiny_checkpoint

sys.path.insert(0, str(Path(__file__).parents[1] / "executor"))
from test_arch_gemma import CONFIGS  # noqa: E402

MAX_NEW = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm2_path):
    """name -> (checkpoint dir, HF's greedy tokens), built once per architecture (HF's generate
    is the slow part)."""
    made: dict[str, tuple[Path, list[list[int]]]] = {}

    def get(name: str) -> tuple[Path, list[list[int]]]:
        if name not in made:
            path = tmp_path_factory.mktemp(name)
            tiny_checkpoint(CONFIGS[name](), path, smollm2_path)
            made[name] = (path, hf_tokens(path, PROMPTS, MAX_NEW))
        return made[name]

    return get


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_engine_greedy_equals_hugging_face(name, tp, checkpoints):
    path, expected = checkpoints(name)
    # 293 tokens in all need ~40 blocks of 8: 16 force preemption
    tokens, stats = llm_tokens(path, PROMPTS, MAX_NEW, max_num_batched_tokens=32, num_gpu_blocks_override=16,
                               block_size=8, tensor_parallel_size=tp)
    assert stats.num_preemptions > 0
    assert tokens == expected
