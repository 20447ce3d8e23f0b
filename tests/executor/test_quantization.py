"""Quantized linear layers (``services/executor/layers/quantization/``) on checkpoints packed by
our own code (``tests/quant_fixtures.py``): each format against ``x @ W.T`` of the weight it
holds, whole and split over two tensor-parallel ranks, read from a safetensors file as the
loader reads it; the config's refusals; greedy parity of a quantized tiny Llama with the same
weights dequantized to a plain float32 checkpoint; compressed-tensors against Hugging Face's
own loader."""

from __future__ import annotations

import json

import pytest
import quant_fixtures as qf
import torch
from architectures import PROMPTS, VOCAB, ours, tiny_checkpoint
from greedy import paged_greedy
from safetensors.torch import save_file
from transformers import LlamaConfig

from services.executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from services.executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
from services.executor.layers.quantization.int4 import PackedInt4
from services.executor.layers.selection import restore_weights
from services.executor.model_loader.loader import open_safetensors
from services.executor.parallel.group import TensorParallelGroup, use_tp_group

FORMATS = sorted(qf.QUANT_CONFIGS)
INT4 = ("awq", "ct-w4a16", "gptq", "gptq-desc-act", "gptq_v2")


def _method(fmt: str, prefix: str, shards: list[str]):
    return QUANTIZATION_METHODS[qf.QUANT_CONFIGS[fmt]["quant_method"]].from_config(
        qf.QUANT_CONFIGS[fmt]).linear_method(prefix, shards)


def _load(layer, tensors: dict[str, torch.Tensor], tmp_path, shard=None) -> None:
    """Every tensor into its parameter through the parameter's loader, read from a file as
    ``model_loader/loader.py`` reads it (not-yet-read ``CheckpointTensor``s)."""
    file = tmp_path / f"t{len(list(tmp_path.iterdir()))}.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, file)
    with open_safetensors(file) as stored:
        for name, tensor in stored.items():
            param = getattr(layer, name)
            if shard is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard)


def _process(layer) -> None:
    layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("fmt", FORMATS)
def test_row_parallel_layer_matches_its_dequantized_weight_whole_and_on_two_ranks(fmt, tmp_path):
    torch.manual_seed(0)
    n, k = 48, 128
    packed, deq = qf.quantize(torch.randn(n, k), fmt, seed=1)
    x = torch.randn(5, k)
    bias = torch.randn(n)
    ref = x @ deq.T + bias
    layer = RowParallelLinear(k, n, bias=True, quant_method=_method(fmt, "model.layers.0.mlp.down_proj", []))
    _load(layer, {**packed, "bias": bias}, tmp_path)
    unprocessed = layer(x)  # the torch path on the checkpoint's tensors
    _process(layer)
    torch.testing.assert_close(unprocessed, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(layer(x), ref, atol=1e-4, rtol=1e-4)
    if fmt in INT4:
        assert isinstance(layer.quant_derived, PackedInt4)
        assert all(getattr(layer, name).numel() == 0 for name in layer.quant_shapes)  # held once
    if fmt in ("gptq-desc-act", "gptq_v2"):
        return  # act order / one group: covered with a whole input below
    partial = []
    for rank in range(2):
        with use_tp_group(TensorParallelGroup(rank, 2)):
            part = RowParallelLinear(k, n, quant_method=_method(fmt, "model.layers.0.mlp.down_proj", []))
        _load(part, packed, tmp_path)
        _process(part)
        start, size = part.input_range
        partial.append(part.quant_method.apply(part, x[:, start:start + size]))
    torch.testing.assert_close(partial[0] + partial[1] + bias, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["gptq-desc-act", "gptq_v2"])
def test_gptq_act_order_and_one_group_split_over_rows_keep_every_group(fmt, tmp_path):
    """desc_act (and group_size -1): each row-parallel rank keeps all groups' scales and zeros."""
    torch.manual_seed(1)
    n, k = 32, 128
    packed, deq = qf.quantize(torch.randn(n, k), fmt, seed=3)
    x = torch.randn(3, k)
    partial = []
    for rank in range(2):
        with use_tp_group(TensorParallelGroup(rank, 2)):
            part = RowParallelLinear(k, n, quant_method=_method(fmt, "model.layers.0.mlp.down_proj", []))
        assert part.scales.shape[0] == (4 if fmt == "gptq-desc-act" else 1)
        _load(part, packed, tmp_path)
        _process(part)
        start, size = part.input_range
        partial.append(part.quant_method.apply(part, x[:, start:start + size]))
    torch.testing.assert_close(partial[0] + partial[1], x @ deq.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_merged_qkv_and_gate_up_take_each_shard_and_each_rank_its_rows(fmt, tmp_path):
    torch.manual_seed(2)
    hidden, head, heads, kv_heads, inter = 64, 16, 4, 2, 64
    seed = 5  # one act order for the shards of one input (GPTQ desc_act)
    qkv = {s: qf.quantize(torch.randn(n * head, hidden), fmt, seed) for s, n in (("q", heads), ("k", kv_heads),
                                                                                  ("v", kv_heads))}
    gate_up = [qf.quantize(torch.randn(inter, hidden), fmt, seed) for _ in range(2)]
    x = torch.randn(4, hidden)
    ref_qkv = {s: x @ deq.T for s, (_, deq) in qkv.items()}
    ref_gate_up = [x @ deq.T for _, deq in gate_up]
    for world in (1, 2):
        outs_q, outs_gu = [], []
        for rank in range(world):
            with use_tp_group(TensorParallelGroup(rank, world)):
                layer = QKVParallelLinear(hidden, head, heads, kv_heads, quant_method=_method(
                    fmt, "model.layers.0.self_attn.qkv_proj", ["q_proj", "k_proj", "v_proj"]))
                mlp = MergedColumnParallelLinear(hidden, [inter] * 2, quant_method=_method(
                    fmt, "model.layers.0.mlp.gate_up_proj", ["gate_proj", "up_proj"]))
            for s, (packed, _) in qkv.items():
                _load(layer, packed, tmp_path, s)
            for i, (packed, _) in enumerate(gate_up):
                _load(mlp, packed, tmp_path, i)
            _process(layer)
            _process(mlp)
            out = layer(x)
            q, kk = layer.q_size, layer.kv_size
            outs_q.append((out[:, :q], out[:, q:q + kk], out[:, q + kk:]))
            gu = mlp(x)
            outs_gu.append((gu[:, :inter // world],
                            gu[:, inter // world:]))
        for i, s in enumerate("qkv"):
            torch.testing.assert_close(torch.cat([o[i] for o in outs_q], 1), ref_qkv[s], atol=1e-4, rtol=1e-4)
        for i in range(2):
            torch.testing.assert_close(torch.cat([o[i] for o in outs_gu], 1), ref_gate_up[i], atol=1e-4, rtol=1e-4)


def test_reloading_a_processed_layer_gives_back_loadable_parameters(tmp_path):
    torch.manual_seed(3)
    layer = RowParallelLinear(64, 32, quant_method=_method("awq", "model.layers.0.mlp.down_proj", []))
    for _ in range(2):  # the second load into the processed layer
        packed, deq = qf.quantize(torch.randn(32, 64), "awq")
        restore_weights(torch.nn.ModuleList([layer]))
        _load(layer, packed, tmp_path)
        _process(layer)
        x = torch.randn(2, 64)
        torch.testing.assert_close(layer(x), x @ deq.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("config", "requested", "message"), [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, None, "GPTQ with bits=8 is not supported"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, None, "AWQ version='gemv' is not supported"),
    ({"quant_method": "bitsandbytes"}, None, "quantization method 'bitsandbytes' is not supported"),
    ({"quant_method": "gptq", "bits": 4}, "awq", "quantization='awq' was asked for, but the checkpoint is "
                                                  "quantized with 'gptq'"),
    (None, "gptq", "has no quantization_config"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, None, "weight_block_size"),
    (qf._ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False}), None,
     "asymmetric weights are not supported"),
    (qf._ct({"num_bits": 2, "type": "int", "strategy": "group", "group_size": 32}), None,
     "int weights of 2 bits are not supported"),
])
def test_unsupported_quantization_is_refused_naming_it(config, requested, message):
    hf_config = {"quantization_config": config} if config else {}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        get_quantization_config(hf_config, requested)


def test_a_quantized_checkpoint_is_detected_and_a_matching_setting_accepted():
    cfg = {"quantization_config": qf.QUANT_CONFIGS["ct-w4a16"]}
    assert get_quantization_config(cfg).name == "compressed-tensors"
    assert get_quantization_config(cfg, "compressed-tensors").name == "compressed-tensors"
    assert get_quantization_config({}) is None


TINY = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=256, initializer_range=0.15,
                   bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
                   architectures=["LlamaForCausalLM"])


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_checkpoint(TINY, path)
    return path


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.heavy
def test_quantized_tiny_llama_gives_the_greedy_tokens_of_its_dequantized_weights(fmt, tiny_llama, tmp_path):
    qf.quantize_checkpoint(tiny_llama, tmp_path / "q", tmp_path / "deq", fmt)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    quantized = ours(LlamaConfig(**config), tmp_path / "q")
    plain = ours(TINY, tmp_path / "deq")
    down = quantized.model.layers[0].mlp.down_proj
    assert type(down.quant_method).__name__ != "UnquantizedLinearMethod"
    if fmt in INT4:  # repacked at load for the C kernel
        assert isinstance(down.quant_derived, PackedInt4)
    prompts = PROMPTS[:4]
    new_q, logits_q = paged_greedy(quantized, prompts, 6)
    new_p, logits_p = paged_greedy(plain, prompts, 6)
    for a, b in zip(logits_q, logits_p, strict=True):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)
    assert new_q == new_p
    assert len({tuple(t) for t in new_p}) > 1


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, None)])
@pytest.mark.heavy
def test_compressed_tensors_weights_equal_hugging_face_loader(bits, group, tiny_llama, tmp_path):
    """HF's compressed-tensors integration (``run_compressed=False``: decompressed at load)
    reads our packed checkpoint as the same float weights our layers hold."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    fmt = "ct-w4a16" if bits == 4 else "ct-w8a16"
    qf.quantize_checkpoint(tiny_llama, tmp_path / "q", tmp_path / "deq", fmt)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32,
                                              quantization_config=CompressedTensorsConfig(run_compressed=False))
    from safetensors.torch import load_file
    plain = load_file(tmp_path / "deq" / "model.safetensors")
    state = hf.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        torch.testing.assert_close(state[name].float(), plain[name], atol=1e-6, rtol=1e-6)


NON_LLAMA = {  # architecture -> (config class name, its tiny config)
    "gemma": ("GemmaConfig", dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=24, num_hidden_layers=2, max_position_embeddings=256,
                                  initializer_range=0.15, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                                  architectures=["GemmaForCausalLM"])),
    "opt": ("OPTConfig", dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=128, init_std=0.15, bos_token_id=None,
                              eos_token_id=None, pad_token_id=None, architectures=["OPTForCausalLM"])),
    "phi3": ("Phi3Config", dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=256,
                                initializer_range=0.15, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                                tie_word_embeddings=False, architectures=["Phi3ForCausalLM"])),
}


@pytest.mark.parametrize(("arch", "fmt"), [("gemma", "gptq"), ("opt", "ct-w4a16"), ("phi3", "awq")])
@pytest.mark.heavy
def test_quantized_non_llama_models_give_the_greedy_tokens_of_their_dequantized_weights(arch, fmt, tmp_path):
    """Architectures other than Llama take the quantized linears (Gemma: GeGLU, head_dim 24; OPT:
    biases, ReLU, learned positions; Phi-3: q|k|v and gate|up fused in the checkpoint): every
    decoder linear int4 (repacked for the C kernel), the greedy tokens and logits those of the
    same weights dequantized to float32."""
    import transformers

    config_cls, kwargs = getattr(transformers, NON_LLAMA[arch][0]), NON_LLAMA[arch][1]
    tiny_checkpoint(config_cls(**kwargs), tmp_path / "src", seed=1)
    qf.quantize_checkpoint(tmp_path / "src", tmp_path / "q", tmp_path / "deq", fmt)
    quantized = ours(config_cls(**json.loads((tmp_path / "q" / "config.json").read_text())), tmp_path / "q")
    plain = ours(config_cls(**kwargs), tmp_path / "deq")
    packed = [m for m in quantized.modules() if isinstance(getattr(m, "quant_derived", None), PackedInt4)]
    assert len(packed) == 8  # per layer: q|k|v, o, gate|up (fc1), down (fc2)
    new_q, logits_q = paged_greedy(quantized, PROMPTS[:4], 6)
    new_p, logits_p = paged_greedy(plain, PROMPTS[:4], 6)
    for a, b in zip(logits_q, logits_p, strict=True):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)
    assert new_q == new_p and len({tuple(t) for t in new_p}) > 1


def test_architectures_without_quantized_layers_refuse_a_quantized_checkpoint():
    """GPT-2 (Conv1D weights) is refused at build time naming the method and the architectures
    that take one; a MoE model whose quantization covers its experts names the expert."""
    from transformers import GPT2Config, MixtralConfig

    from services.executor.models import get_model_class

    gpt2 = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=1, n_head=4, architectures=["GPT2LMHeadModel"],
                      quantization_config=qf.QUANT_CONFIGS["gptq"])
    with pytest.raises(ValueError, match=r"gptq quantization is not supported for GPT2LMHeadModel \(quantized "
                                         r"checkpoints: the Llama family"):
        get_model_class(gpt2)(gpt2, torch.float32, "cpu")
    mixtral = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                            num_key_value_heads=2, num_hidden_layers=1, num_local_experts=4,
                            architectures=["MixtralForCausalLM"], quantization_config=qf.QUANT_CONFIGS["gptq"])
    with pytest.raises(ValueError, match=r"MoE experts \(model\.layers\.0\.block_sparse_moe\.experts\.0\.w1\)"):
        get_model_class(mixtral)(mixtral, torch.float32, "cpu")
