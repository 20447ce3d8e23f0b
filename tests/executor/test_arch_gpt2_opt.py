"""GPT-2 (Conv1D weights read transposed, learned positions, tied head) and OPT (positions
offset by 2, pre- and post-norm blocks, project_in / project_out): greedy parity with Hugging
Face in float32 (``tests/architectures.py``)."""

from __future__ import annotations

import pytest
import torch
from architectures import VOCAB, assert_model_parity, ours, tiny_checkpoint
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, OPTConfig

GPT2 = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, initializer_range=0.15,
            bos_token_id=None, eos_token_id=None, architectures=["GPT2LMHeadModel"])
OPT = dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
           max_position_embeddings=128, init_std=0.15, bos_token_id=None, eos_token_id=None, pad_token_id=None,
           architectures=["OPTForCausalLM"])
CONFIGS = {
    "gpt2": lambda: GPT2Config(**GPT2),
    # exact GELU, a 96-wide MLP, an untied head, scores scaled by 1 / (layer + 1) too
    "gpt2-gelu-untied-inverse-layer-scale": lambda: GPT2Config(**GPT2, activation_function="gelu", n_inner=96,
                                                               tie_word_embeddings=False,
                                                               scale_attn_by_inverse_layer_idx=True),
    "opt-pre-norm": lambda: OPTConfig(**OPT, do_layer_norm_before=True),
    # OPT-350m's shape: post-norm blocks, no final LayerNorm, 32-wide embeddings projected in and out
    "opt-post-norm-projected": lambda: OPTConfig(**OPT, do_layer_norm_before=False, word_embed_proj_dim=32),
    # no biases, LayerNorms without weight and bias, an untied head
    "opt-no-bias-no-affine-untied": lambda: OPTConfig(**OPT, enable_bias=False, layer_norm_elementwise_affine=False,
                                                      tie_word_embeddings=False),
}
#: post-norm: the last LayerNorm's bias reaches the LM head directly; at 0.5 it picks every token
BIAS_STD = {"opt-post-norm-projected": 0.1}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.heavy
def test_greedy_parity_with_hugging_face(name, tmp_path):
    config = CONFIGS[name]()
    tiny_checkpoint(config, tmp_path, bias_std=BIAS_STD.get(name, 0.5))
    assert_model_parity(config, tmp_path)


@pytest.mark.heavy
def test_gpt2_loads_openai_names_and_skips_mask_buffers(tmp_path):
    """OpenAI's conversions name tensors without ``transformer.`` and carry the causal-mask
    buffers ``attn.bias`` / ``attn.masked_bias``: the same weights load."""
    config = CONFIGS["gpt2"]()
    tiny_checkpoint(config, tmp_path)
    reference = ours(config, tmp_path)
    tensors = {name.removeprefix("transformer."): t for name, t in load_file(tmp_path / "model.safetensors").items()}
    tensors["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 128, 128))
    tensors["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    (tmp_path / "model.safetensors").unlink()
    save_file(tensors, tmp_path / "model.safetensors")
    model = ours(config, tmp_path)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_gpt2_refuses_cross_attention():
    with pytest.raises(ValueError, match="add_cross_attention"):
        ours(GPT2Config(**GPT2, add_cross_attention=True), "unused")
