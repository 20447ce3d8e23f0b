"""GGUF files served in bf16 with the native kernels: every decoder layer in one C call
(``NativeLayers``, the GGUF blocks read by ``cpu_gguf_gemm.c`` inside ``cpu_llama_layers.c``),
with the per-layer path's greedy tokens and logits. The bundled Q4_1 file's weights and the tiny
K-quant file's are held in the 16-row interleaved layout (``gguf_r16``), served at any step size."""

from __future__ import annotations

import torch
from greedy import paged_greedy
from native_builds import NEEDS_KERNEL
from transformers import AutoConfig

from kernels.cpu import ops
from services.executor.layers import gguf as G
from services.executor.layers.cpu.native_layers import NativeLayers
from services.executor.models import get_model_class
from shared.model_source import _gguf_path, prepare_gguf_model

PROMPTS = [[1, 9690, 28, 314, 2234], [1, 504, 3458, 282, 4649, 314, 982, 30, 198], [1, 19556, 30]]


@NEEDS_KERNEL
def test_gguf_blocks_run_in_the_all_layers_c_call(tmp_path, monkeypatch):
    monkeypatch.setattr(ops, "prefer_native_gemm", lambda: True)
    path = prepare_gguf_model(_gguf_path(), tmp_path)
    config = AutoConfig.from_pretrained(path)
    model = get_model_class(config)(config, dtype=torch.bfloat16, device="cpu", native_cpu_kernels=True)
    model.load_weights(path)
    assert model.use_native_norms(True) and model.use_native_matmuls(True)
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.down_proj.quant_method, G.GGUFLinearMethod)  # kept quantized
    assert model.model.native_layers_enabled

    fused: list[int] = []
    real_run = NativeLayers.run
    monkeypatch.setattr(NativeLayers, "run", lambda self, h, *a: fused.append(h.shape[0]) or real_run(self, h, *a))
    new_n, logits_n = paged_greedy(model, PROMPTS, 5)
    # the 17-token prefill (over NATIVE_MAX_ROWS: no limit for the interleaved layout) and the 3-row decodes in C
    assert sum(map(len, PROMPTS)) > G.NATIVE_MAX_ROWS and fused == [sum(map(len, PROMPTS))] + [len(PROMPTS)] * 4
    assert model.model.native_layers.max_rows is None
    assert model.model.native_layers._wtype.tolist() == [G.Q4_1.ggml_type | 0x100] * (4 * config.num_hidden_layers)

    monkeypatch.setattr(NativeLayers, "applies", staticmethod(lambda layers, caches: False))
    model.model.native_layers = None
    fused.clear()
    new_l, logits_l = paged_greedy(model, PROMPTS, 5)
    assert not fused
    assert new_n == new_l
    for a, b in zip(logits_n, logits_l, strict=True):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)  # the same kernels but for SiLU's exp


@NEEDS_KERNEL
def test_k_quant_blocks_run_in_the_all_layers_c_call(tmp_path, smollm2_path, monkeypatch):
    """A tiny Q4_K / Q5_K / Q6_K GGUF (``tests/gguf_files.py``, one format per merged layer)
    in bf16: its weights held in the 16-row interleaved layout, its steps (the prefill of more
    than NATIVE_MAX_ROWS tokens included) run in the one C call with the per-layer path's
    greedy tokens."""
    from gguf_files import TINY_FORMATS, write_tiny_gguf

    monkeypatch.setattr(ops, "prefer_native_gemm", lambda: True)
    write_tiny_gguf(tmp_path / "tiny.gguf", smollm2_path, mixed=False)
    path = prepare_gguf_model(tmp_path / "tiny.gguf", tmp_path / "cache")
    config = AutoConfig.from_pretrained(path)
    model = get_model_class(config)(config, dtype=torch.bfloat16, device="cpu", native_cpu_kernels=True)
    model.load_weights(path)
    assert model.use_native_norms(True) and model.use_native_matmuls(True)
    fused: list[int] = []
    real_run = NativeLayers.run
    monkeypatch.setattr(NativeLayers, "run", lambda self, h, *a: fused.append(h.shape[0]) or real_run(self, h, *a))
    # prompts whose greedy steps have no near-tie in this random model (the top two logits >= 0.5 apart; [900, 17, 31]
    # has one 0.03 apart, which the two paths' roundings of bf16 and int8 activations may order either way)
    prompts = [[1, 2, 3, 400, 500, 700], [900, 18, 31], [5, 60, 7, 80, 9, 100, 11, 120]]
    new_n, _ = paged_greedy(model, prompts, 5)
    assert sum(map(len, prompts)) > G.NATIVE_MAX_ROWS
    assert fused == [sum(map(len, prompts))] + [len(prompts)] * 4  # the 17-token prefill and the decodes
    assert model.model.native_layers.max_rows is None
    layer_types = [TINY_FORMATS[k].ggml_type | 0x100 for k in ("attn_q", "attn_output", "ffn_gate", "ffn_down")]
    assert model.model.native_layers._wtype.tolist() == layer_types * config.num_hidden_layers

    monkeypatch.setattr(NativeLayers, "applies", staticmethod(lambda layers, caches: False))
    model.model.native_layers = None
    new_l, _ = paged_greedy(model, prompts, 5)
    assert new_n == new_l


@NEEDS_KERNEL
def test_qwen2_gguf_with_qkv_biases_runs_layer_by_layer(tmp_path, smollm2_path, monkeypatch):
    """A Qwen2 GGUF (q, k, v biases) in bf16 with the native kernels: the all-layers C call takes
    no bias (``NativeLayers.applies``), so every step runs layer by layer, the biases added
    after the native GGUF GEMM; greedy tokens are the float32 model's, logits within bf16's error."""
    from gguf_files import TINY_FORMATS, write_gguf
    from transformers import Qwen2Config

    monkeypatch.setattr(ops, "prefer_native_gemm", lambda: True)
    tiny = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=None,
                eos_token_id=None, pad_token_id=None)
    write_gguf(tmp_path / "qwen2.gguf", Qwen2Config(**tiny), smollm2_path, TINY_FORMATS, {})
    path = prepare_gguf_model(tmp_path / "qwen2.gguf", tmp_path / "cache")
    config = AutoConfig.from_pretrained(path)
    fused: list[int] = []
    real_run = NativeLayers.run
    monkeypatch.setattr(NativeLayers, "run", lambda self, h, *a: fused.append(h.shape[0]) or real_run(self, h, *a))
    prompts = [[1, 2, 3, 400, 500, 700], [900, 17, 31]]
    runs = {}
    for dtype, native in ((torch.bfloat16, True), (torch.float32, False)):
        model = get_model_class(config)(config, dtype=dtype, device="cpu", native_cpu_kernels=native)
        model.load_weights(path)
        assert model.model.native_layers_enabled == native  # the kernels would take the C call ...
        assert model.model.layers[0].self_attn.qkv_proj.bias is not None
        runs[native] = paged_greedy(model, prompts, 5)
    assert not fused  # ... which refuses the biased q | k | v
    assert runs[True][0] == runs[False][0]
    for bf16, f32 in zip(runs[True][1], runs[False][1], strict=True):
        torch.testing.assert_close(bf16.float(), f32, atol=0.05 * f32.abs().max().item(), rtol=0)
