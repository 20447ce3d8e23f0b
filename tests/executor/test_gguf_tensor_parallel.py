"""A GGUF file loaded at tensor-parallel ranks (``gguf_loader`` + ``gguf_shards``), built under
sizes-only groups in one process: every rank keeps its layers' blocks, and its shares put
together (q | k | v and gate | up rows by shard, o_proj / down_proj input columns, vocabulary
rows) are one rank's weights exactly; a rank share that would cut a block is refused, naming the
layer, the tensor-parallel size and the block size. Greedy tokens over real ranks:
``tests/e2e/test_gguf_tensor_parallel_e2e.py``."""

from __future__ import annotations

import pytest
import torch
from gguf_files import F32, TINY_FORMATS, tiny_hf_config, write_gguf
from transformers import LlamaConfig, Phi3Config, Qwen2Config, Qwen2MoeConfig

from services.executor.layers.fused_moe import fused_moe_reference, topk_softmax
from services.executor.layers.linear import UnquantizedLinearMethod
from services.executor.layers.quantization import gguf as G
from services.executor.layers.quantization.gguf import GGUFLinearMethod, GGUFShardedLinearMethod
from services.executor.model_loader import gguf_loader, gguf_quant_config
from services.executor.models import get_model_class
from services.executor.parallel.group import TensorParallelGroup, use_tp_group

pytestmark = pytest.mark.heavy  # each test loads a GGUF model at its ranks (tests/conftest.py)

#: 9 heads / 3 KV heads (3 ranks: 3 + 3 + 3; 2 ranks: 6 + 3), 32-element blocks only, shards of
#: q | k | v and gate | up in different formats, an untied LM head of 1024 rows (342 + 341 + 341)
UNEVEN = LlamaConfig(vocab_size=1024, hidden_size=288, intermediate_size=192, num_hidden_layers=1,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=512, rms_norm_eps=1e-5,
                     tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
Q32_FORMATS = {"token_embd": G.Q8_0, "output": G.Q4_1, "attn_q": G.Q4_0, "attn_k": G.Q4_0, "attn_v": G.Q8_0,
               "attn_qkv": G.Q8_0, "attn_output": G.Q4_0, "ffn_gate": G.Q8_0, "ffn_up": G.Q4_0, "ffn_down": G.Q4_1}
#: o_proj, down_proj and the embedding in F16: not kept, dequantized at load, then split as values
F16 = G.BlockFormat("F16", 1, 1, 2)
#: the same attention, 4 experts of 192 (2 ranks: 96 each, 3 blocks; 3 ranks: 64, 2 blocks) in three
#: formats, a shared expert of 192, the router F32
QWEN2_MOE = Qwen2MoeConfig(vocab_size=1024, hidden_size=288, intermediate_size=192, num_hidden_layers=1,
                           num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=512, num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=192, shared_expert_intermediate_size=192,
                           tie_word_embeddings=True, architectures=["Qwen2MoeForCausalLM"])
MOE_FORMATS = {**Q32_FORMATS, "ffn_gate_inp": F32, "ffn_gate_exps": G.Q4_0, "ffn_up_exps": G.Q8_0,
               "ffn_down_exps": G.Q4_1, "ffn_gate_shexp": G.Q8_0, "ffn_up_shexp": G.Q4_0, "ffn_down_shexp": G.Q8_0}
Q32_F16_FORMATS = {**Q32_FORMATS, "token_embd": F16, "attn_output": F16, "ffn_down": F16}
#: the same sizes as Phi-3: q | k | v and gate | up each one fused file tensor, cut into shards at each rank
PHI3 = Phi3Config(vocab_size=1024, hidden_size=288, intermediate_size=192, num_hidden_layers=1, num_attention_heads=9,
                  num_key_value_heads=3, max_position_embeddings=512, tie_word_embeddings=False,
                  pad_token_id=0, architectures=["Phi3ForCausalLM"])
#: the same sizes as Qwen2: q, k and v biases, split with their rows
QWEN2 = Qwen2Config(vocab_size=1024, hidden_size=288, intermediate_size=192, num_hidden_layers=1, num_attention_heads=9,
                    num_key_value_heads=3, max_position_embeddings=512, tie_word_embeddings=True,
                    architectures=["Qwen2ForCausalLM"])


def _load(config, path, rank: int, world: int, native: bool = False):
    with use_tp_group(TensorParallelGroup(rank, world)):  # sizes only: no process group behind it
        model = get_model_class(config)(config, torch.float32, torch.device("cpu"),
                                        quant_config=gguf_quant_config(path))
    gguf_loader.load_gguf_weights(model, path, native=native)
    return model


def _w(module) -> torch.Tensor:  # [N, K] float32: the module's weight as its method holds it
    method = module.quant_method
    if isinstance(method, GGUFShardedLinearMethod):
        return torch.cat([m.weight(part, torch.float32) for m, part in zip(method.parts, module.gguf_shards, strict=True)])
    if isinstance(method, GGUFLinearMethod):
        return method.weight(module, torch.float32)
    assert not method.quantized  # dequantized at load (F16)
    return module.weight.data


@pytest.mark.parametrize(("config", "world", "formats"), [
    pytest.param(UNEVEN, 2, Q32_FORMATS, id="llama-6-and-3-heads"),
    pytest.param(UNEVEN, 3, Q32_FORMATS, id="llama-3-heads-each"),
    pytest.param(UNEVEN, 3, Q32_F16_FORMATS, id="llama-f16-row-parallel-and-embedding"),
    pytest.param(PHI3, 2, Q32_FORMATS, id="phi3-fused-tensors"),
    pytest.param(QWEN2, 2, Q32_FORMATS, id="qwen2-qkv-bias-tied")])
def test_rank_shares_put_together_are_one_rank_weights(tmp_path, smollm2_path, config, world, formats):
    path = tmp_path / "uneven.gguf"
    write_gguf(path, config, smollm2_path, formats, {})
    whole = _load(config, path, 0, 1)
    ranks = [_load(config, path, r, world) for r in range(world)]
    fused = config.model_type == "phi3"  # one file tensor, one format: GGUFLinearMethod
    attn, mlp = whole.model.layers[0].self_attn, whole.model.layers[0].mlp
    assert attn.o_proj.quant_method.quantized == (formats["attn_output"] is not F16)
    d, inter = attn.head_dim, config.intermediate_size
    q, k, v = _w(attn.qkv_proj).split([9 * d, 3 * d, 3 * d])
    gate, up = _w(mlp.gate_up_proj).split([inter, inter])
    parts: dict[str, list[torch.Tensor]] = {n: [] for n in ("q", "k", "v", "gate", "up", "o", "down", "embed", "head")}
    for model in ranks:
        a, m = model.model.layers[0].self_attn, model.model.layers[0].mlp
        # llama: Q4_0 q, k beside Q8_0 v, each shard's blocks apart
        assert isinstance(a.qkv_proj.quant_method, GGUFLinearMethod if fused else GGUFShardedLinearMethod)
        sizes = [a.num_heads * d, a.num_kv_heads * d, a.num_kv_heads * d]
        for name, t in zip("qkv", _w(a.qkv_proj).split(sizes), strict=True):
            parts[name].append(t)
        if a.qkv_proj.bias is not None:
            for name, t in zip(("qb", "kb", "vb"), a.qkv_proj.bias.split(sizes), strict=True):
                parts.setdefault(name, []).append(t)
        half = m.gate_up_proj.output_partition_sizes[0]
        parts["gate"].append(_w(m.gate_up_proj)[:half])
        parts["up"].append(_w(m.gate_up_proj)[half:])
        parts["o"].append(_w(a.o_proj))
        parts["down"].append(_w(m.down_proj))
        parts["embed"].append(_w(model.model.embed_tokens))
        parts["head"].append(_w(model.lm_head))
        assert torch.equal(model.model.norm.weight, whole.model.norm.weight)
    assert [t.shape[0] for t in parts["q"]] == ([6 * d, 3 * d] if world == 2 else [3 * d] * 3)
    assert [t.shape[0] for t in parts["embed"]] == ([512, 512] if world == 2 else [342, 341, 341])
    for name, ref in (("q", q), ("k", k), ("v", v), ("gate", gate), ("up", up),
                      ("embed", _w(whole.model.embed_tokens)), ("head", _w(whole.lm_head))):
        assert torch.equal(torch.cat(parts[name]), ref), name
    assert (attn.qkv_proj.bias is not None) == (config.model_type == "qwen2")
    if attn.qkv_proj.bias is not None:
        for name, ref in zip(("qb", "kb", "vb"), attn.qkv_proj.bias.split([9 * d, 3 * d, 3 * d]), strict=True):
            assert torch.equal(torch.cat(parts[name]), ref), name
    assert torch.equal(torch.cat(parts["o"], dim=1), _w(attn.o_proj))  # each rank's heads' input columns
    assert torch.equal(torch.cat(parts["down"], dim=1), _w(mlp.down_proj))


def test_native_ranks_interleave_shares_of_a_multiple_of_16_rows(tmp_path, smollm2_path, kernel_library,
                                                               interleaved_gguf):
    """With the native kernels ``gguf_r16`` interleaves a rank's share when it has a multiple of 16
    rows (rank 0 of 3: q 96, k and v 32, o_proj 288 rows), not otherwise (342 vocabulary rows);
    either way the rank's weights are the file layout's."""
    path = tmp_path / "uneven.gguf"
    write_gguf(path, UNEVEN, smollm2_path, Q32_FORMATS, {})
    native, plain = _load(UNEVEN, path, 0, 3, native=True), _load(UNEVEN, path, 0, 3)
    attn = native.model.layers[0].self_attn
    assert [p.r16 for p in attn.qkv_proj.quant_method.parts] == [True, True, True]
    assert attn.o_proj.quant_method.r16 and not native.model.embed_tokens.quant_method.r16
    assert not native.lm_head.quant_method.r16
    for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
                 "model.layers.0.mlp.down_proj", "model.embed_tokens", "lm_head"):
        assert torch.equal(_w(native.get_submodule(name)), _w(plain.get_submodule(name))), name


def test_a_rank_share_that_cuts_a_block_is_refused_naming_layer_tp_and_block(tmp_path, smollm2_path):
    """The tiny K-quant Llama's o_proj (Q4_K, 256 input columns) over 2 ranks: 128 columns each,
    half a 256-element super-block."""
    path = tmp_path / "kq.gguf"
    config = tiny_hf_config(256)
    config.architectures = ["LlamaForCausalLM"]
    write_gguf(path, config, smollm2_path, TINY_FORMATS, {})
    with pytest.raises(ValueError, match=r"blk\.0\.attn_output\.weight: tensor_parallel_size=2 gives rank 0 the "
                                         r"input columns \[0, 128\) of 256, which cut Q4_K's blocks of 256 elements"):
        _load(config, path, 0, 2)


@pytest.mark.parametrize("world", [2, 3])
def test_rank_shares_of_moe_experts_put_together_are_one_rank_experts(tmp_path, smollm2_path, world):
    """Each rank keeps its range of every expert's intermediate size as blocks: the gate and up
    experts' rows and the down experts' input columns, put together, are one rank's experts; the
    router (F32) is whole on every rank."""
    path = tmp_path / "moe.gguf"
    write_gguf(path, QWEN2_MOE, smollm2_path, MOE_FORMATS, {})
    whole = _load(QWEN2_MOE, path, 0, 1).model.layers[0].mlp
    w13, w2 = whole.experts.quant_method.weights(whole.experts)  # [4, 384, 288], [4, 288, 192]
    gates, ups, downs = [], [], []
    for rank in range(world):
        mlp = _load(QWEN2_MOE, path, rank, world).model.layers[0].mlp
        r13, r2 = mlp.experts.quant_method.weights(mlp.experts)
        inter = r2.shape[2]
        assert inter == 192 // world and mlp.experts.quant_method.fmts == (G.Q4_0, G.Q8_0, G.Q4_1)
        gates.append(r13[:, :inter])
        ups.append(r13[:, inter:])
        downs.append(r2)
        assert torch.equal(mlp.gate.weight, whole.gate.weight)
    assert torch.equal(torch.cat(gates, dim=1), w13[:, :192]) and torch.equal(torch.cat(ups, dim=1), w13[:, 192:])
    assert torch.equal(torch.cat(downs, dim=2), w2)


@pytest.mark.parametrize(("experts", "methods"), [
    ({}, (GGUFShardedLinearMethod, GGUFLinearMethod)),  # Q4_0 gate, Q8_0 up, Q4_1 down
    ({"ffn_down_exps": F16}, (GGUFShardedLinearMethod, UnquantizedLinearMethod)),  # down cut as values
    ({"ffn_gate_exps": F16}, (UnquantizedLinearMethod, GGUFLinearMethod)),  # gate | up dense, rows cut as values
], ids=["all-kept", "down-dense", "gate-up-dense"])
def test_rank_partial_outputs_of_moe_experts_sum_to_the_layer_output(tmp_path, smollm2_path, experts, methods):
    """Each rank's ``GGUFMoEMethod.apply`` on its share of the experts (2 ranks: 96 of the 192
    intermediate rows, 3 blocks of down's columns; 3 ranks: 64, 2 blocks) gives its partial sum,
    the all-reduce's input: summed over the ranks it is the whole layer's output (float32 rounding
    apart), which is the per-token oracle's on the dequantized experts; no rank's part alone is."""
    path = tmp_path / "moe.gguf"
    write_gguf(path, QWEN2_MOE, smollm2_path, MOE_FORMATS | experts, {})
    whole = _load(QWEN2_MOE, path, 0, 1).model.layers[0].mlp
    x = torch.randn(12, 288, generator=torch.Generator().manual_seed(0))  # [T, hidden]
    weights, ids = topk_softmax(whole.gate(x), 2, renormalize=False)  # [T, 2] each
    assert ids.unique().tolist() == [0, 1, 2, 3]  # every expert has tokens
    out = whole.experts.quant_method.apply(whole.experts, x, weights, ids)  # [T, hidden]
    torch.testing.assert_close(out, fused_moe_reference(x, *whole.experts.quant_method.weights(whole.experts),
                                                        weights, ids), rtol=1e-4, atol=1e-4)
    scale = out.abs().max().item()
    for world in (2, 3):
        parts = []
        for rank in range(world):
            moe = _load(QWEN2_MOE, path, rank, world).model.layers[0].mlp.experts
            assert moe.intermediate_range[1] == 192 // world
            assert tuple(type(getattr(moe.gguf_experts[0], m).quant_method) for m in ("gate_up", "down")) == methods
            parts.append(moe.quant_method.apply(moe, x, weights, ids))
            assert (parts[-1] - out).abs().max() > 0.1 * scale
        torch.testing.assert_close(sum(parts), out, rtol=1e-5, atol=1e-5 * scale)
