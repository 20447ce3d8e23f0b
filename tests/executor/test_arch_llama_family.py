"""Llama-family architectures beyond Llama itself: Qwen3 (q/k RMSNorm per head) and Mistral
with a sliding window shorter than the prompts. Greedy parity with Hugging Face in float32
(``tests/architectures.py``)."""

from __future__ import annotations

import pytest
from architectures import PROMPTS, VOCAB, assert_model_parity, hf_tokens, llm_tokens, tiny_checkpoint
from transformers import MistralConfig, Qwen2Config, Qwen3Config

TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, initializer_range=0.15, bos_token_id=None, eos_token_id=None,
            pad_token_id=None, tie_word_embeddings=False)
CONFIGS = {
    "qwen3": lambda: Qwen3Config(**TINY, num_hidden_layers=2, head_dim=32, architectures=["Qwen3ForCausalLM"]),
    # every layer windowed: the 70- and 48-token prompts reach past it
    "mistral-sliding-window": lambda: MistralConfig(**TINY, num_hidden_layers=2, sliding_window=24,
                                                    architectures=["MistralForCausalLM"]),
    # use_sliding_window from layer 1 on: one full layer, one windowed
    "qwen2-sliding-layers": lambda: Qwen2Config(**TINY, num_hidden_layers=2, use_sliding_window=True,
                                                sliding_window=20, max_window_layers=1,
                                                architectures=["Qwen2ForCausalLM"]),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.heavy
def test_greedy_parity_with_hugging_face(name, tmp_path):
    config = CONFIGS[name]()
    tiny_checkpoint(config, tmp_path)
    assert_model_parity(config, tmp_path)


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["qwen3", "mistral-sliding-window"])
def test_llm_gives_hugging_face_greedy_tokens_with_chunks_and_preemption(name, tmp_path, smollm2_path):
    """The whole engine (``LLM``): the 8 prompts generated together, prefilled in 32-token
    chunks, in a pool small enough that requests are preempted and recomputed; then at
    tensor-parallel size 2."""
    config = CONFIGS[name]()
    tiny_checkpoint(config, tmp_path, smollm2_path)
    expected = hf_tokens(tmp_path, PROMPTS, 12)
    tokens, stats = llm_tokens(tmp_path, PROMPTS, 12, max_num_batched_tokens=32, block_size=8,
                               num_gpu_blocks_override=24)
    assert tokens == expected
    assert stats.num_preemptions > 0
    tokens, _ = llm_tokens(tmp_path, PROMPTS, 12, tensor_parallel_size=2, max_num_batched_tokens=32)
    assert tokens == expected
