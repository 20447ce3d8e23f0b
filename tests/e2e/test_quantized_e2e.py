"""A GPTQ checkpoint served through every service (``LLM.generate``): greedy tokens equal
Hugging Face's on the same weights dequantized to a plain float32 checkpoint. The checkpoint is
a tiny random Llama packed by our own code (``tests/quant_fixtures.py``; act order on, so the
``g_idx`` path is taken), with SmolLM2's tokenizer files (token ids below 512)."""

from __future__ import annotations

import quant_fixtures as qf
from architectures import PROMPTS, VOCAB, hf_tokens, llm_tokens, tiny_checkpoint
from transformers import LlamaConfig

TINY = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=256, initializer_range=0.15,
                   bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
                   architectures=["LlamaForCausalLM"])


def test_gptq_checkpoint_served_gives_the_greedy_tokens_of_its_dequantized_weights(tmp_path, smollm2_path):
    tiny_checkpoint(TINY, tmp_path / "src", smollm2_path)
    qf.quantize_checkpoint(tmp_path / "src", tmp_path / "gptq", tmp_path / "deq", "gptq-desc-act")
    ours, stats = llm_tokens(tmp_path / "gptq", PROMPTS, 8, quantization="gptq", kv_cache_memory_bytes=4 << 20)
    reference = hf_tokens(tmp_path / "deq", PROMPTS, 8)
    assert ours == reference
    assert len({tuple(t) for t in reference}) > 1
