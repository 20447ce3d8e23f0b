"""Mixture-of-experts architectures: Mixtral (4 experts, top-2, a sliding window shorter than
the prompts), Qwen2-MoE (shared expert, top-k weights not renormalised, one dense layer) and
Qwen3-MoE (q/k norms, renormalised top-k). Greedy parity with Hugging Face in float32
(``tests/architectures.py``), and ``FusedMoE``'s tensor-parallel split: the ranks' partial
outputs sum to the whole layer's."""

from __future__ import annotations

import pytest
import torch
from architectures import VOCAB, assert_model_parity, tiny_checkpoint
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from services.executor.layers.fused_moe import FusedMoE, fused_moe_reference, topk_softmax
from services.executor.parallel.group import TensorParallelGroup, use_tp_group

TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=2, max_position_embeddings=256, initializer_range=0.15, bos_token_id=None,
            eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
CONFIGS = {
    "mixtral": lambda: MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2, sliding_window=24,
                                     architectures=["MixtralForCausalLM"]),
    # layer 0 dense (mlp_only_layers), layer 1 sparse with the gated shared expert
    "qwen2_moe": lambda: Qwen2MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[0],
                                        architectures=["Qwen2MoeForCausalLM"]),
    "qwen3_moe": lambda: Qwen3MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                        head_dim=32, norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"]),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.heavy
def test_greedy_parity_with_hugging_face(name, tmp_path):
    config = CONFIGS[name]()
    tiny_checkpoint(config, tmp_path)
    assert_model_parity(config, tmp_path)


@pytest.mark.heavy
def test_qwen2_moe_layers_are_dense_and_sparse_as_configured(tmp_path):
    from architectures import ours

    from services.executor.models.llama import LlamaMLP
    from services.executor.models.qwen_moe import Qwen2MoeSparseMoeBlock

    config = CONFIGS["qwen2_moe"]()
    tiny_checkpoint(config, tmp_path)
    model = ours(config, tmp_path)
    assert [type(layer.mlp) for layer in model.model.layers] == [LlamaMLP, Qwen2MoeSparseMoeBlock]
    assert model.model.layers[1].mlp.shared_expert is not None


class _Checkpoint:
    """A stand-in for the loader's lazy checkpoint tensor (``shape``, ``narrow``, ``load``)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.shape = tensor, tuple(tensor.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.tensor.narrow(dim, start, length)

    def load(self) -> torch.Tensor:
        return self.tensor


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_fused_moe_ranks_sum_to_the_whole_layer(tp):
    """Each rank loads its slice of every expert (intermediate size 40 over ``tp`` ranks, 3 not
    dividing it); the sum of the ranks' outputs is the reference's."""
    gen = torch.Generator().manual_seed(0)
    num_experts, hidden, inter, top_k = 4, 24, 40, 2
    w1, w3 = (torch.randn(num_experts, inter, hidden, generator=gen) * 0.2 for _ in range(2))
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * 0.2
    x = torch.randn(9, hidden, generator=gen)
    weights, ids = topk_softmax(torch.randn(9, num_experts, generator=gen), top_k, renormalize=False)
    total = torch.zeros(9, hidden)
    for rank in range(tp):
        with use_tp_group(TensorParallelGroup(rank, tp)):
            layer = FusedMoE(num_experts, hidden, inter, torch.float32, reduce_results=False)
        checkpoint = {"w1": w1, "w3": w3, "w2": w2}
        for param_suffix, shard_name, (e, shard) in FusedMoE.expert_params_mapping(num_experts):
            param = layer.w13 if param_suffix.endswith("w13") else layer.w2
            layer.weight_loader(param, _Checkpoint(checkpoint[shard_name.split(".")[3]][e]), (e, shard))
        total += layer(x, weights, ids)
    w13 = torch.cat((w1, w3), dim=1)  # [E, 2 I, hidden] gate | up
    torch.testing.assert_close(total, fused_moe_reference(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
