"""Phi-3: fused q/k/v and gate/up checkpoint tensors, default RoPE, LongRoPE (short and long
factors in one batch), partial rotary and a sliding window. Greedy parity with Hugging Face in
float32 (``tests/architectures.py``), and LongRoPE's frequencies against HF's own."""

from __future__ import annotations

import pytest
import torch
from architectures import PROMPTS, VOCAB, assert_model_parity, tiny_checkpoint
from transformers import Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from services.executor.attention import AttentionMetadata
from services.executor.layers.rotary_embedding import LongRopeRotaryEmbedding, get_rope
from services.executor.models.hf_config import rope_parameters
from services.executor.models.phi3 import rope_seq_lens

TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=2, max_position_embeddings=256, initializer_range=0.15, bos_token_id=None,
            eos_token_id=None, pad_token_id=None, tie_word_embeddings=False, architectures=["Phi3ForCausalLM"])
HALF_HEAD = 16 // 2  # head_dim 16: 8 frequencies


def longrope(original: int = 32, rotary: float = 1.0, **extra) -> dict:
    n = int(HALF_HEAD * rotary)
    return dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=rotary,
                short_factor=[1.0 + 0.1 * i for i in range(n)], long_factor=[1.0 + 0.9 * i for i in range(n)],
                original_max_position_embeddings=original, **extra)


# Prompt lengths are 3, 9, 17, 70, 5, 33, 12 and 48 tokens. With original_max_position_embeddings
# 32 the 33-, 48- and 70-token prompts take the long factors, the others the short ones, and none
# crosses from short to long while generating 8 tokens (17 + 7 <= 32): where HF recomputes its
# cache and a paged cache does not (phi3.rope_seq_lens).
CONFIGS = {
    "default-rope": lambda: Phi3Config(**TINY),
    "longrope": lambda: Phi3Config(**TINY, original_max_position_embeddings=32, rope_parameters=longrope()),
    "longrope-partial-rotary-sliding-window": lambda: Phi3Config(
        **TINY, original_max_position_embeddings=32, sliding_window=24, rope_parameters=longrope(rotary=0.5)),
    "tied-embeddings-partial-rotary": lambda: Phi3Config(
        **{**TINY, "tie_word_embeddings": True},
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
}


def test_prompt_lengths_pick_both_factors():
    assert {len(p) > 32 for p in PROMPTS} == {True, False}
    assert all(len(p) > 32 or len(p) + 8 - 1 <= 32 for p in PROMPTS)  # no crossing while generating


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.heavy
def test_greedy_parity_with_hugging_face(name, tmp_path):
    config = CONFIGS[name]()
    tiny_checkpoint(config, tmp_path)
    assert_model_parity(config, tmp_path)


@pytest.mark.parametrize("extra", [{}, {"factor": 3.0}, {"attention_factor": 1.25}], ids=["ratio", "factor", "attention-factor"])
def test_longrope_matches_hugging_face_frequencies(extra):
    """Short and long inverse frequencies and the attention scaling equal
    ``_compute_longrope_parameters``'s bit for bit; cos/sin as HF's rotary embedding forms them."""
    config = Phi3Config(**TINY, original_max_position_embeddings=32, rope_parameters=longrope(**extra))
    rope = get_rope(16, rope_parameters(config), torch.float32, "cpu")
    assert isinstance(rope, LongRopeRotaryEmbedding)
    short, scaling = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=33)
    assert rope.attention_scaling == scaling
    assert torch.equal(rope.inv_freq, short) and torch.equal(rope.long_inv_freq, long)
    positions = torch.arange(40)
    for seq_len, inv_freq in ((32, short), (33, long)):
        cos, sin = rope(positions, torch.full((40,), seq_len))
        freqs = positions.float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        torch.testing.assert_close(cos[:, 0], emb.cos() * scaling, rtol=0, atol=0)
        torch.testing.assert_close(sin[:, 0, HALF_HEAD:], emb.sin()[:, HALF_HEAD:] * scaling, rtol=0, atol=0)


def test_rope_seq_lens_use_the_whole_prompt_while_chunked():
    # a 70-token prompt's second 5-token chunk, a 3-token prompt's decode at length 5, a fresh prompt
    meta = AttentionMetadata.build([5, 1, 4], [10, 5, 4], [[0], [1], [2]], 16, num_prompt_tokens=[70, 3, 4])
    assert rope_seq_lens(meta, torch.device("cpu")).tolist() == [70] * 5 + [5] + [4] * 4
    meta = AttentionMetadata.build([5, 1], [10, 5], [[0], [1]], 16)  # prompt lengths unknown: the step's
    assert rope_seq_lens(meta, torch.device("cpu")).tolist() == [10] * 5 + [5]
