"""GPT-NeoX / Pythia (fused q/k/v per head, partial rotary, parallel and sequential residual)
and Falcon (the new decoder architecture with grouped KV heads and one or two LayerNorms; the
older multi-query form with parallel and sequential attention/MLP; the older multi-head form):
greedy parity with Hugging Face in float32 (``tests/architectures.py``), and the fused q/k/v
loader's split of each layout over two tensor-parallel ranks."""

from __future__ import annotations

import pytest
import torch
from architectures import VOCAB, assert_model_parity, ours, tiny_checkpoint
from transformers import FalconConfig, GPTNeoXConfig

from services.executor.layers.linear import GroupedQKVParallelLinear
from services.executor.models.hf_config import num_kv_heads_of
from services.executor.parallel.group import TensorParallelGroup, use_tp_group

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, initializer_range=0.15, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)


def neox(parallel_residual: bool, **extra) -> GPTNeoXConfig:
    return GPTNeoXConfig(**COMMON, intermediate_size=128, use_parallel_residual=parallel_residual,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                         tie_word_embeddings=False, architectures=["GPTNeoXForCausalLM"], **extra)


def falcon(**extra) -> FalconConfig:
    return FalconConfig(**COMMON, ffn_hidden_size=128, architectures=["FalconForCausalLM"], **{"bias": True, **extra})


CONFIGS = {
    "gpt-neox-parallel-residual": lambda: neox(True),
    "gpt-neox-sequential-residual": lambda: neox(False, attention_bias=False),
    "falcon-new-arch-gqa": lambda: falcon(new_decoder_architecture=True, num_kv_heads=2),
    "falcon-new-arch-one-ln": lambda: falcon(new_decoder_architecture=True, num_kv_heads=2,
                                             num_ln_in_parallel_attn=1, bias=False),
    "falcon-mqa-parallel-attn": lambda: falcon(multi_query=True, parallel_attn=True),
    "falcon-mqa-sequential": lambda: falcon(multi_query=True, parallel_attn=False, bias=False),
    "falcon-mha-sequential": lambda: falcon(multi_query=False, parallel_attn=False),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.heavy
def test_greedy_parity_with_hugging_face(name, tmp_path):
    config = CONFIGS[name]()
    tiny_checkpoint(config, tmp_path)
    assert_model_parity(config, tmp_path)


def test_falcon_alibi_is_refused(tmp_path):
    config = falcon(alibi=True)
    with pytest.raises(ValueError, match="alibi=True"):
        ours(config, tmp_path)


def test_falcon_kv_heads_of_each_form():
    assert num_kv_heads_of(falcon(new_decoder_architecture=True, num_kv_heads=2)) == 2
    assert num_kv_heads_of(falcon(multi_query=True)) == 1
    assert num_kv_heads_of(falcon(multi_query=False)) == 4


class _Tensor:
    """A checkpoint tensor stand-in (``shape``, ``narrow``)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.shape = t, t.shape

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.t.narrow(dim, start, length)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (4, 1), (8, 2)])
def test_grouped_qkv_loader_takes_each_ranks_heads(heads, kv_heads):
    """Rows of head ``h``'s q, k, v hold the values ``(h, 0 | 1 | 2)``: each rank of two gets its
    query heads and their KV heads (a single KV head replicated), in the order q | k | v."""
    d, group = 2, heads // kv_heads
    fused = torch.empty(kv_heads, group + 2, d, 3)  # [Hkv, q_per_kv + 2, D, hidden]: (head, kind, group)
    for g in range(kv_heads):
        for i in range(group):
            fused[g, i] = torch.tensor([g * group + i, 0, g])
        fused[g, group], fused[g, group + 1] = torch.tensor([g, 1, g]), torch.tensor([g, 2, g])
    for rank in range(2):
        with use_tp_group(TensorParallelGroup(rank, 2)):
            layer = GroupedQKVParallelLinear(3, d, heads, kv_heads, bias=False)
        layer.weight_loader(layer.weight, _Tensor(fused.flatten(0, 2)))
        shard = layer.head_shard
        q = layer.weight[: layer.q_size].view(shard.num_heads, d, 3)
        k, v = layer.weight[layer.q_size :].view(2, shard.num_kv_heads, d, 3)
        assert q[:, 0, 0].tolist() == list(range(shard.q_start, shard.q_start + shard.num_heads))
        assert q[:, 0, 1].eq(0).all() and k[:, 0, 1].eq(1).all() and v[:, 0, 1].eq(2).all()
        kv = list(range(shard.kv_start, shard.kv_start + shard.num_kv_heads))
        assert k[:, 0, 0].tolist() == kv and v[:, 0, 0].tolist() == kv
        assert q[:, 0, 2].tolist() == [h // group for h in range(shard.q_start, shard.q_start + shard.num_heads)]
