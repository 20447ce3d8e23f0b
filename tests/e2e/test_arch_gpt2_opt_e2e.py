"""GPT-2 and OPT through the whole engine (``LLM``: every service, the 8 prompts together,
chunked prefill, preemption in a small block pool), on one rank and on two: greedy tokens
equal Hugging Face ``generate``'s in float32 (``tests/architectures.py``)."""

from __future__ import annotations

import pytest
from architectures import PROMPTS, VOCAB, hf_tokens, llm_tokens, tiny_checkpoint
from transformers import GPT2Config, OPTConfig

CONFIGS = {
    "gpt2": lambda: GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                               initializer_range=0.15, bos_token_id=None, eos_token_id=None,
                               architectures=["GPT2LMHeadModel"]),
    # OPT-350m's shape: post-norm, embeddings 32 wide projected in and out of the 64-wide decoder
    "opt": lambda: OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=128, init_std=0.15,
                             do_layer_norm_before=False, word_embed_proj_dim=32, bos_token_id=None,
                             eos_token_id=None, pad_token_id=None, architectures=["OPTForCausalLM"]),
}
BIAS_STD = {"gpt2": 0.5, "opt": 0.1}  # post-norm: a large final LayerNorm bias picks every token
# 197 prompt tokens + 8 x 12 new ones need 41 blocks of 8: 16 blocks force preemptions
ENGINE = dict(max_num_batched_tokens=32, num_gpu_blocks_override=16, block_size=8)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_engine_gives_hugging_face_greedy_tokens(name, tmp_path, smollm2_path):
    tiny_checkpoint(CONFIGS[name](), tmp_path, smollm2_path, bias_std=BIAS_STD[name])
    expected = hf_tokens(tmp_path, PROMPTS, 12)
    assert len({tuple(t) for t in expected}) > 1
    tokens, stats = llm_tokens(tmp_path, PROMPTS, 12, **ENGINE)
    assert stats.num_preemptions > 0
    assert tokens == expected
    # two ranks: 2 of the 4 heads each (GPT-2's from the columns of its Conv1D c_attn), half the MLP
    tokens, _ = llm_tokens(tmp_path, PROMPTS, 12, tensor_parallel_size=2, **ENGINE)
    assert tokens == expected
