"""GGUF files served in bf16 with the native kernels: every decoder layer in one C call
(``NativeLayers``, the GGUF blocks read by ``cpu_gguf_gemm.c`` inside ``cpu_llama_layers.c``),
with the per-layer path's greedy tokens and logits (tokens also where layer 0's q | k | v mixes two
K-quant types: one GGUF GEMM per shard). The bundled Q4_1 file's weights and the tiny K-quant
file's are held in the 16-row interleaved layout (``gguf_r16``), served at any step size."""

from __future__ import annotations

import pytest
import torch
from greedy import paged_greedy
from native_builds import NEEDS_KERNEL
from transformers import AutoConfig

from kernels.cpu import ops
from services.executor.attention import AttentionMetadata
from services.executor.forward_pass import ForwardPass, all_layers_stack
from services.executor.layers.cpu.native_layers import NativeLayers
from services.executor.layers.quantization import gguf as G
from services.executor.model_loader import quantization_config
from services.executor.models import get_model_class, kv_cache_shape
from shared.model_source import _gguf_path, prepare_gguf_model

pytestmark = pytest.mark.heavy  # each test loads a GGUF model (tests/conftest.py)

PROMPTS = [[1, 9690, 28, 314, 2234], [1, 504, 3458, 282, 4649, 314, 982, 30, 198], [1, 19556, 30]]


@NEEDS_KERNEL
def test_gguf_blocks_run_in_the_all_layers_c_call(smollm2_path, monkeypatch, interleaved_gguf):
    monkeypatch.setattr(ops, "prefer_native_gemm", lambda: True)
    # the bundled file's serving directory in the session's cache, as LLM and serve of it prepare
    # it (tests/e2e/test_gguf_e2e.py): written once (~10 s: transformers reads the whole file), not per test
    path = prepare_gguf_model(_gguf_path(), smollm2_path.parent)
    config = AutoConfig.from_pretrained(path)
    model = get_model_class(config)(config, dtype=torch.bfloat16, device="cpu", native_cpu_kernels=True,
                                     quant_config=quantization_config(path, config))
    model.load_weights(path)
    assert model.use_native_norms(True) and model.use_native_matmuls(True)
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.down_proj.quant_method, G.GGUFLinearMethod)  # kept quantized
    assert all_layers_stack(model) is not None

    fused: list[int] = []
    real_run = NativeLayers.run
    monkeypatch.setattr(NativeLayers, "run", lambda self, h, *a: fused.append(h.shape[0]) or real_run(self, h, *a))
    forward = ForwardPass(model)
    new_n, logits_n = paged_greedy(model, PROMPTS, 5, forward=forward)
    # the 17-token prefill (over NATIVE_MAX_ROWS: no limit for the interleaved layout) and the 3-row decodes in C
    assert sum(map(len, PROMPTS)) > G.NATIVE_MAX_ROWS and fused == [sum(map(len, PROMPTS))] + [len(PROMPTS)] * 4
    assert forward.native_layers.max_rows is None
    assert forward.native_layers._wtype.tolist() == [G.Q4_1.ggml_type | 0x100] * (4 * config.num_hidden_layers)

    monkeypatch.setattr(NativeLayers, "applies", staticmethod(lambda layers, caches: False))
    fused.clear()
    new_l, logits_l = paged_greedy(model, PROMPTS, 5)  # a new ForwardPass: asks applies again
    assert not fused
    assert new_n == new_l
    for a, b in zip(logits_n, logits_l, strict=True):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)  # the same kernels but for SiLU's exp


def _tiny_k_quant_model(tmp_path, smollm2_path, overrides: dict[str, G.BlockFormat]):
    """The tiny K-quant GGUF (``tests/gguf_files.py``: ``TINY_FORMATS``, ``overrides`` by tensor
    name) as a bf16 model with the native kernels' norms and matmuls."""
    from gguf_files import TINY_FORMATS, tiny_hf_config, write_gguf

    write_gguf(tmp_path / "tiny.gguf", tiny_hf_config(1024), smollm2_path, TINY_FORMATS, overrides)
    path = prepare_gguf_model(tmp_path / "tiny.gguf", tmp_path / "cache")
    config = AutoConfig.from_pretrained(path)
    model = get_model_class(config)(config, dtype=torch.bfloat16, device="cpu", native_cpu_kernels=True,
                                     quant_config=quantization_config(path, config))
    model.load_weights(path)
    assert model.use_native_norms(True) and model.use_native_matmuls(True)
    return model


# write_tiny_gguf(mixed=True)'s override, as llama.cpp's Q4_K_M files keep some layers' attn_v in Q6_K
LAYER0_V = {"blk.0.attn_v": G.Q6_K}
# the merged matmuls (index l * 4 + which: 0 q | k | v, 2 gate | up) the overrides split into shards of (format, rows)
SHARDS_LAYER0_V = {0: [(G.Q5_K, 256), (G.Q5_K, 128), (G.Q6_K, 128)]}  # 4 heads, 2 KV heads of 64
SHARDS_LAYER1_UP = {6: [(G.Q4_K, 512), (G.Q6_K, 512)]}  # intermediate_size 512


@NEEDS_KERNEL
@pytest.mark.parametrize(("overrides", "shards"), [
    ({}, {}),
    (LAYER0_V, SHARDS_LAYER0_V),
    (LAYER0_V | {"blk.1.ffn_up": G.Q6_K}, SHARDS_LAYER0_V | SHARDS_LAYER1_UP),
], ids=["one_format_per_layer", "layer0_v_in_q6_k", "and_layer1_up_in_q6_k"])
def test_k_quant_blocks_run_in_the_all_layers_c_call(tmp_path, smollm2_path, monkeypatch, overrides, shards,
                                                     interleaved_gguf):
    """A tiny Q4_K / Q5_K / Q6_K GGUF (``tests/gguf_files.py``, one format per merged layer, or
    layer 0's attn_v in Q6_K beside Q5_K attn_q / attn_k as llama.cpp's Q4_K_M files do, and
    layer 1's ffn_up in Q6_K beside a Q4_K ffn_gate: ``GGUFShardedLinearMethod``) in bf16: its
    weights held in the 16-row interleaved layout, its steps (the prefill of more than
    NATIVE_MAX_ROWS tokens included) run in the one C call (a mixed merged matmul as one GGUF
    GEMM per shard: ``nshard``) with the per-layer path's greedy tokens."""
    from gguf_files import TINY_FORMATS, TINY_LAYER0_V

    assert LAYER0_V == {"blk.0.attn_v": TINY_LAYER0_V}  # write_tiny_gguf(mixed=True)'s file
    monkeypatch.setattr(ops, "prefer_native_gemm", lambda: True)
    model = _tiny_k_quant_model(tmp_path, smollm2_path, overrides)
    num_layers = model.hf_config.num_hidden_layers
    matmuls = [m for layer in model.model.layers  # in wtype's order
               for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    for i, m in enumerate(matmuls):
        assert isinstance(m.quant_method, G.GGUFShardedLinearMethod if i in shards else G.GGUFLinearMethod)
    fused: list[int] = []
    real_run = NativeLayers.run
    monkeypatch.setattr(NativeLayers, "run", lambda self, h, *a: fused.append(h.shape[0]) or real_run(self, h, *a))
    # prompts whose greedy steps have no near-tie in this random model (the top two logits >= 0.5 apart; [900, 17, 31]
    # has one 0.03 apart, which the two paths' roundings of bf16 and int8 activations may order either way)
    prompts = [[1, 2, 3, 400, 500, 700], [900, 18, 31], [5, 60, 7, 80, 9, 100, 11, 120]]
    forward = ForwardPass(model)
    new_n, _ = paged_greedy(model, prompts, 5, forward=forward)
    assert sum(map(len, prompts)) > G.NATIVE_MAX_ROWS
    assert fused == [sum(map(len, prompts))] + [len(prompts)] * 4  # the 17-token prefill and the decodes
    native_layers = forward.native_layers
    assert native_layers.max_rows is None
    layer_types = [TINY_FORMATS[k].ggml_type | 0x100 for k in ("attn_q", "attn_output", "ffn_gate", "ffn_down")]
    assert native_layers._wtype.tolist() == [0 if i in shards else t
                                             for i, t in enumerate(layer_types * num_layers)]
    if shards:  # each mixed matmul's shards (3 slots per matmul, 0 past its shards), outputs side by side
        padded = [shards[i][j] if j < len(shards.get(i, [])) else None for i in range(4 * num_layers) for j in range(3)]
        assert native_layers._nshard.tolist() == [len(shards.get(i, [])) for i in range(4 * num_layers)]
        assert native_layers._shard_type.tolist() == [s[0].ggml_type | 0x100 if s else 0 for s in padded]
        assert native_layers._shard_rows.tolist() == [s[1] if s else 0 for s in padded]
    else:
        assert native_layers._nshard is None

    monkeypatch.setattr(NativeLayers, "applies", staticmethod(lambda layers, caches: False))
    fused.clear()
    new_l, _ = paged_greedy(model, prompts, 5)  # a new ForwardPass: asks applies again
    assert not fused
    assert new_n == new_l


@NEEDS_KERNEL
@pytest.mark.parametrize(("field", "index", "value"), [("_shard_rows", 2, 64), ("_shard_type", 1, 0), ("_nshard", 0, 4)],
                         ids=["rows_short_of_the_width", "bf16_shard", "over_max_shards"])
def test_the_c_call_refuses_shards_that_do_not_make_the_matmul(tmp_path, smollm2_path, monkeypatch, field, index,
                                                               value):
    """Layer 0's q | k | v shards (256, 128, 128 rows) must fill the matmul's 512 columns with
    GGUF blocks, at most ``max_shards`` of them: v's rows cut to 64, a shard of type 0 (bf16
    panels) or a fourth shard make the C call fail on that matmul (status 12), nothing written
    to the cache; the arrays put back, the same step runs."""
    monkeypatch.setattr(ops, "prefer_native_gemm", lambda: True)
    model = _tiny_k_quant_model(tmp_path, smollm2_path, LAYER0_V)
    caches = [(torch.zeros(kv_cache_shape(model.hf_config, 4, 16), dtype=torch.bfloat16),
               torch.zeros(kv_cache_shape(model.hf_config, 4, 16), dtype=torch.bfloat16))
              for _ in range(model.hf_config.num_hidden_layers)]
    meta = AttentionMetadata.build([3], [3], [[2]], 16)
    forward = ForwardPass(model)
    rows = forward.native_rows(caches, meta)
    layers = forward.native_layers
    assert rows is not None and layers._nshard is not None and ops.load().abi.max_shards == 3
    h = model.model.embed_tokens(torch.tensor([5, 6, 7]))
    cos, sin = model.model.rotary_emb(torch.arange(3))
    array = getattr(layers, field)  # the C call reads it in place
    kept, array[index] = array[index].item(), value
    with pytest.raises(ValueError, match="status 12"):
        layers.run(h.clone(), cos, sin, meta.slot_mapping, rows)
    assert all(not t.any() for kv in caches for t in kv)
    array[index] = kept
    out = layers.run(h.clone(), cos, sin, meta.slot_mapping, rows)
    assert out.isfinite().all() and caches[0][0][2, :3].any() and not caches[0][0][2, 3:].any()


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
        model = get_model_class(config)(config, dtype=dtype, device="cpu", native_cpu_kernels=native,
                                         quant_config=quantization_config(path, config))
        model.load_weights(path)
        assert (all_layers_stack(model) is not None) == native  # the kernels would take the C call ...
        assert model.model.layers[0].self_attn.qkv_proj.bias is not None
        runs[native] = paged_greedy(model, prompts, 5)
    assert not fused  # ... which refuses the biased q | k | v
    assert runs[True][0] == runs[False][0]
    for bf16, f32 in zip(runs[True][1], runs[False][1], strict=True):
        torch.testing.assert_close(bf16.float(), f32, atol=0.05 * f32.abs().max().item(), rtol=0)
