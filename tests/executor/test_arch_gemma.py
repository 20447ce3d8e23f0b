"""Gemma, Gemma 2 and Gemma 3 text: greedy parity with Hugging Face in float32
(``tests/architectures.py``) on tiny random models with ``head_dim`` set apart from
``hidden_size / heads``, a 16-token sliding window (shorter than the 70- and 48-token prompts)
on Gemma 2/3's sliding layers, both soft caps on, and Gemma 3's linear RoPE scaling on its
full layers."""

from __future__ import annotations

import pytest
import torch
from architectures import VOCAB, assert_model_parity, tiny_checkpoint
from transformers import Gemma2Config, Gemma3TextConfig, GemmaConfig

from services.executor.models import get_model_class
from services.executor.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, GemmaForCausalLM

TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=24, max_position_embeddings=256, initializer_range=0.15, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)
CONFIGS = {
    "gemma": lambda: GemmaConfig(**TINY, num_hidden_layers=2, architectures=["GemmaForCausalLM"]),
    # layer 0 sliding (16 tokens), layer 1 full; the caps small enough to bite on random weights
    "gemma2-softcaps-sliding": lambda: Gemma2Config(
        **TINY, num_hidden_layers=2, sliding_window=16, query_pre_attn_scalar=32, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, architectures=["Gemma2ForCausalLM"]),
    # one sliding layer (local base 10^4), one full layer (base 10^6, positions divided by 4)
    "gemma3-text-linear-rope": lambda: Gemma3TextConfig(
        **TINY, num_hidden_layers=2, sliding_window=16, query_pre_attn_scalar=32, final_logit_softcapping=3.0,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}},
        architectures=["Gemma3ForCausalLM"]),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.heavy
def test_greedy_parity_with_hugging_face(name, tmp_path):
    config = CONFIGS[name]()
    tiny_checkpoint(config, tmp_path)
    assert_model_parity(config, tmp_path)


def test_registry_and_model_type_without_architectures():
    for name, cls in (("gemma", GemmaForCausalLM), ("gemma2-softcaps-sliding", Gemma2ForCausalLM),
                      ("gemma3-text-linear-rope", Gemma3ForCausalLM)):
        config = CONFIGS[name]()
        assert get_model_class(config) is cls
        config.architectures = None  # model_type alone picks the class
        assert get_model_class(config) is cls


def test_layer_switches():
    """What each version reads from its config: scale, caps, windows, RoPE per layer type."""
    g1, g2, g3 = (cls(CONFIGS[name](), torch.float32, "cpu") for name, cls in (
        ("gemma", GemmaForCausalLM), ("gemma2-softcaps-sliding", Gemma2ForCausalLM),
        ("gemma3-text-linear-rope", Gemma3ForCausalLM)))
    attn = [[layer.self_attn.attn for layer in m.model.layers] for m in (g1, g2, g3)]
    assert [a.scale for a in attn[0]] == [24**-0.5] * 2 and attn[0][0].sliding_window is None
    assert [(a.scale, a.sliding_window, a.logits_soft_cap) for a in attn[1]] == [(32**-0.5, 16, 2.0),
                                                                                  (32**-0.5, None, 2.0)]
    assert [(a.sliding_window, a.logits_soft_cap) for a in attn[2]] == [(16, None), (None, None)]
    assert g1.final_logit_softcapping is None and g2.final_logit_softcapping == 3.0
    ropes = g3.model.rotary_emb
    assert ropes["full_attention"].base == 1e6 and ropes["full_attention"].factor == 4.0
    assert ropes["sliding_attention"].base == 1e4
    assert g3.model.layers[0].self_attn.q_norm is not None and g2.model.layers[0].self_attn.q_norm is None


def test_bidirectional_attention_is_refused():
    config = CONFIGS["gemma3-text-linear-rope"]()
    config.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="bidirectional"):
        Gemma3ForCausalLM(config, torch.float32, "cpu")
