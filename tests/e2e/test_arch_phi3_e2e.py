"""Phi-3 through the whole engine (``LLM.generate``): a tiny random LongRoPE model with a sliding
window, 8 prompts of 3-70 tokens together in 32-token steps (chunked prefill) and a pool small
enough to preempt, on one rank and on two (the fused q/k/v and gate/up tensors split by head and
column), greedy tokens equal to Hugging Face's."""

from __future__ import annotations

from architectures import PROMPTS, VOCAB, hf_tokens, llm_tokens, tiny_checkpoint
from transformers import Phi3Config

# 197 prompt tokens + 8 x 12 new ones: about 40 blocks of 8 when every sequence is resident
ENGINE = dict(max_num_batched_tokens=32, num_gpu_blocks_override=20, block_size=8)
# original_max_position_embeddings 32: the 33-, 48- and 70-token prompts take the long factors,
# the others stay at most 17 + 11 = 28 tokens long (short factors throughout)
CONFIG = Phi3Config(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    num_hidden_layers=2, max_position_embeddings=256, original_max_position_embeddings=32, sliding_window=24,
    initializer_range=0.15, bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    architectures=["Phi3ForCausalLM"],
    rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.1 * i for i in range(8)],
                         long_factor=[1.0 + 0.9 * i for i in range(8)], original_max_position_embeddings=32),
)


def test_phi3_longrope_engine_tp1_and_tp2_equal_hugging_face(tmp_path, smollm2_path):
    tiny_checkpoint(CONFIG, tmp_path, smollm2_path)
    expected = hf_tokens(tmp_path, PROMPTS, 12)
    for tp in (1, 2):
        tokens, stats = llm_tokens(tmp_path, PROMPTS, 12, tensor_parallel_size=tp, **ENGINE)
        assert stats.num_preemptions > 0, tp
        assert tokens == expected, tp
