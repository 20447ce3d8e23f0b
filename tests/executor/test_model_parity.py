"""Our Llama-family model on the paged KV cache equals Hugging Face greedy generation (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from greedy import hf_greedy, paged_greedy
from native_builds import NEEDS_KERNEL
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from services.executor.attention import AttentionMetadata
from services.executor.forward_pass import ForwardPass
from services.executor.layers.cpu.onednn import OneDNNLinearMethod, mkldnn_packing_supported
from services.executor.layers.embedding import refine_top_logits
from services.executor.layers.layernorm import ln_trick_weight, rms_norm
from services.executor.layers.rotary_embedding import get_rope
from services.executor.models import (
    LlamaForCausalLM,
    get_model_class,
    kv_cache_bytes_per_block,
    kv_cache_shape,
)
from services.executor.models.hf_config import head_dim_of, rope_parameters
from services.executor.sampler import greedy_argmax

PROMPTS = [[5, 17, 301, 44, 9, 120, 77], [400, 3, 3, 18, 250, 11, 90, 64, 31, 7, 199, 2, 65, 8, 301, 42, 17, 5], [88, 12]]
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    max_position_embeddings=256,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
CONFIGS = {
    # GQA 2, head_dim (32) != hidden / heads, Llama 3.1 RoPE scaling with all three bands in use
    "llama3": lambda: LlamaConfig(
        **TINY,
        num_hidden_layers=3,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        architectures=["LlamaForCausalLM"],
    ),
    # q/k/v biases, untied lm_head, MQA-like GQA 4
    "qwen2": lambda: Qwen2Config(
        **TINY, num_hidden_layers=2, num_key_value_heads=1, tie_word_embeddings=False,
        architectures=["Qwen2ForCausalLM"],
    ),
    # q/k/v/o and MLP biases (exercise biases in the fused / packed matmul paths)
    "llama_bias": lambda: LlamaConfig(
        **TINY, num_hidden_layers=2, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
    ),
    "mistral": lambda: MistralConfig(
        **TINY, num_hidden_layers=2, num_key_value_heads=2, sliding_window=None,
        architectures=["MistralForCausalLM"],
    ),
}


def rope_inv_freq(hf_config) -> torch.Tensor:  # [head_dim // 2] float32
    return get_rope(head_dim_of(hf_config), rope_parameters(hf_config), torch.float32, "cpu").inv_freq


def projections(model: LlamaForCausalLM) -> list:
    """Every linear layer of the decoder (q/k/v, o, gate/up and down of each layer)."""
    return [proj for layer in model.model.layers
            for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]


def _tiny_checkpoint(name: str, path: Path, **save_kwargs):
    torch.manual_seed(0)
    config = CONFIGS[name]()
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # HF initialises biases to 0 and norms to 1: randomise them
        for pname, param in hf_model.named_parameters():
            if pname.endswith("bias"):
                param.normal_(0.0, 0.5)
            elif "norm" in pname:
                param.normal_(1.0, 0.2)
    hf_model.save_pretrained(path, **save_kwargs)
    return config, hf_model


def _ours(config, path: Path, dtype=torch.float32) -> LlamaForCausalLM:
    model = get_model_class(config)(config, dtype, torch.device("cpu"))
    model.load_weights(path)
    return model


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.heavy
def test_tiny_model_matches_hf_greedy(name, tmp_path):
    shard = {"max_shard_size": "100KB"} if name == "qwen2" else {}  # qwen2: sharded checkpoint
    config, hf_model = _tiny_checkpoint(name, tmp_path, **shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    model = _ours(config, tmp_path)
    max_new = 10
    for block_size, chunk in ((16, None), (16, 5), (32, 4)):
        new, logits = paged_greedy(model, PROMPTS, max_new, block_size=block_size, chunk=chunk, seed=block_size)
        for prompt, ours_new, ours_logits in zip(PROMPTS, new, logits, strict=True):
            ref_new, ref_logits = hf_greedy(hf_model, prompt, max_new)
            torch.testing.assert_close(ours_logits, ref_logits, atol=1e-4, rtol=1e-4)
            assert ours_new == ref_new, (block_size, chunk, prompt)


@pytest.mark.heavy
def test_smollm2_matches_hf_greedy(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away, there lived"]
    prompts = [tok(t)["input_ids"] for t in texts]
    hf_model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    model = _ours(hf_model.config, smollm2_path)
    max_new = 8
    new, logits = paged_greedy(model, prompts, max_new, block_size=16)
    eos = hf_model.config.eos_token_id
    for prompt, ours_new, ours_logits in zip(prompts, new, logits, strict=True):
        ref_new, ref_logits = hf_greedy(hf_model, prompt, max_new)
        torch.testing.assert_close(ours_logits, ref_logits, atol=1e-4, rtol=1e-4)
        assert ours_new[: len(ref_new)] == ref_new
        assert len(ref_new) == max_new or ref_new[-1] == eos  # HF stops at EOS, we do not


@pytest.mark.heavy
def test_reference_backend_matches_hf(tmp_path):
    """The model on the reference attention (the oracle) gives the same tokens."""
    config, hf_model = _tiny_checkpoint("llama3", tmp_path)
    model = get_model_class(config)(config, torch.float32, "cpu", attn_backend="reference")
    model.load_weights(tmp_path)
    new, _ = paged_greedy(model, PROMPTS, 6, chunk=5)
    assert new == [hf_greedy(hf_model, p, 6)[0] for p in PROMPTS]


@pytest.mark.skipif(
    not mkldnn_packing_supported(torch.device("cpu"), torch.bfloat16), reason="oneDNN bf16 is not available on this CPU"
)
@pytest.mark.parametrize("name", ["qwen2", "llama_bias"])
@pytest.mark.heavy
def test_bf16_packed_weights_match_plain_linear(name, tmp_path):
    """bf16 oneDNN-prepacked matmuls (SiLU and gate * up as epilogues of the MLP's matmuls)
    give the logits of plain ``F.linear`` on the parameters: a prefill, a 3-token chunk with
    context (both packed) and single-token decodes (torch's GEMV on the parameters)."""
    config, _ = _tiny_checkpoint(name, tmp_path)
    model = _ours(config, tmp_path, torch.bfloat16)
    assert isinstance(model.kernels.linear_method, OneDNNLinearMethod)
    prompt = [(7 * i + 3) % 500 + 1 for i in range(41)]
    steps = [(0, 30), (30, 33), (33, 34), (34, 35)]  # token ranges computed per step
    logits, forward = [], ForwardPass(model)  # as the runner runs a step: one row on torch's GEMV
    for packed in (True, False):
        model.process_weights_after_loading() if packed else model.unpack_weights()
        assert (model.model.layers[0].self_attn.qkv_proj.packed is not None) == packed
        caches = [(torch.zeros(kv_cache_shape(config, 4, 16), dtype=torch.bfloat16),
                   torch.zeros(kv_cache_shape(config, 4, 16), dtype=torch.bfloat16))
                  for _ in range(config.num_hidden_layers)]
        out = []
        with torch.inference_mode():
            for start, end in steps:
                meta = AttentionMetadata.build([end - start], [end], [[2, 0, 3]], 16)
                hidden = forward(torch.tensor(prompt[start:end]), torch.arange(start, end), caches, meta)
                out.append(model.compute_logits(hidden))
        logits.append(torch.cat(out))
    assert logits[0].dtype == torch.float32
    assert torch._C._get_mkldnn_enabled()  # the single-row GEMV switch is process-global: restored
    torch.testing.assert_close(logits[0], logits[1], atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_layer_norm_form(dtype):
    """The LayerNorm-of-(x, -x) form equals ``F.rms_norm`` (up to rare 1-ulp differences)."""
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 7, 300):
        x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
        w = torch.randn(576, generator=gen).to(dtype)
        ref = torch.nn.functional.rms_norm(x, (576,), w, 1e-5)
        out = rms_norm(x, w, 1e-5, ln_trick_weight(w))
        assert out.shape == ref.shape and out.is_contiguous()
        torch.testing.assert_close(out, ref, atol=0, rtol=2 ** -7)  # at most 1 ulp
        assert (out != ref).float().mean() < 1e-3


@pytest.mark.parametrize("vocab", [49152, 3000])  # chunked search / plain topk
def test_refined_logits_are_float32_dot_products(vocab):
    """After refine_top_logits the two best logits of each row are the float32 dot products
    of the bf16 hidden state and weight rows, so greedy follows float32 even through ties."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(vocab, 64, generator=gen).to(torch.bfloat16)
    hidden = torch.randn(37, 64, generator=gen).to(torch.bfloat16)
    weight[5] = weight[7]  # an exact tie: the lower id wins, as argmax does
    hidden[0] = weight[5] * 2
    logits = torch.nn.functional.linear(hidden, weight).float()
    exact = hidden.float() @ weight.float().t()  # [N, V]
    refine_top_logits(logits, hidden, weight)
    top2 = exact.topk(2, dim=-1).indices
    torch.testing.assert_close(logits.gather(1, top2), exact.gather(1, top2), atol=1e-4, rtol=1e-5)
    assert torch.equal(greedy_argmax(logits), exact.argmax(dim=-1))


def test_greedy_argmax_matches_argmax():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(9, 4096, generator=gen)
    logits[1, 3000] = logits[1, 1000] = 50.0  # ties across slices: the first one wins
    logits[2, 10] = logits[2, 11] = 50.0  # ties inside a slice
    logits[3, 2000] = float("nan")  # NaN counts as the maximum, as in argmax
    for x in (logits, logits[:, :1000], logits.to(torch.bfloat16)):
        assert torch.equal(greedy_argmax(x), x.argmax(dim=-1))


@pytest.mark.heavy
def test_bfloat16_runs_close_to_float32(tmp_path):
    config, _ = _tiny_checkpoint("llama3", tmp_path)
    f32, bf16 = _ours(config, tmp_path), _ours(config, tmp_path, torch.bfloat16)
    _, logits32 = paged_greedy(f32, PROMPTS, 1)
    _, logits16 = paged_greedy(bf16, PROMPTS, 1)
    for a, b in zip(logits32, logits16, strict=True):
        assert b.dtype == torch.float32
        torch.testing.assert_close(b, a, atol=0.15, rtol=0.05)


def test_old_style_rope_config_matches_hf():
    """``rope_theta`` + ``rope_scaling`` (pre-transformers-5 config.json) give HF's frequencies."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    old = {"hidden_size": 64, "num_attention_heads": 2, "max_position_embeddings": 512,
           "rope_theta": 500000.0, "rope_scaling": scaling}
    hf_config = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=512,
                            rope_theta=500000.0, rope_scaling=dict(scaling))
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config)
    torch.testing.assert_close(rope_inv_freq(old), expected, atol=0, rtol=0)
    torch.testing.assert_close(rope_inv_freq(hf_config), expected, atol=0, rtol=0)


def test_refused_configs():
    """An unknown architecture is refused naming it and every supported one; a RoPE type this
    engine does not compute is refused when the model is built."""
    with pytest.raises(ValueError, match=r"unsupported model architecture \['BertForMaskedLM'\]; supported: "
                                         r".*LlamaForCausalLM, MistralForCausalLM"):
        get_model_class({"architectures": ["BertForMaskedLM"]})
    yarn = LlamaConfig(**TINY, num_hidden_layers=1, architectures=["LlamaForCausalLM"],
                       rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported"):
        get_model_class(yarn)(yarn, torch.float32, "cpu")
    assert get_model_class(MistralConfig(sliding_window=4096, architectures=["MistralForCausalLM"])) is LlamaForCausalLM


@pytest.mark.heavy
def test_configs_without_architectures_go_by_model_type(tmp_path):
    """A config.json with only ``model_type`` (HF's Auto classes accept it) gets the class of
    that model type, with its details (Qwen2's q/k/v biases); an unknown one is refused."""
    config, hf_model = _tiny_checkpoint("qwen2", tmp_path)
    config.architectures = None
    model = _ours(config, tmp_path)
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    new, logits = paged_greedy(model, PROMPTS[:2], 4)
    for prompt, ours_new, ours_logits in zip(PROMPTS[:2], new, logits, strict=True):
        ref_new, ref_logits = hf_greedy(hf_model, prompt, 4)
        torch.testing.assert_close(ours_logits, ref_logits, atol=1e-4, rtol=1e-4)
        assert ours_new == ref_new
    assert get_model_class({"model_type": "mistral", "sliding_window": 64}) is LlamaForCausalLM
    with pytest.raises(ValueError, match="no 'architectures' entry, and model_type='bert'"):
        get_model_class({"model_type": "bert"})


def test_kv_cache_sizing():
    config = CONFIGS["llama3"]()  # 3 layers, 2 KV heads of 32
    assert kv_cache_shape(config, 10, 16) == (10, 16, 2, 32)
    assert kv_cache_bytes_per_block(config, 16, torch.bfloat16) == 2 * 3 * 16 * 2 * 32 * 2


@pytest.mark.heavy
def test_missing_weights_are_reported(tmp_path):
    config, hf_model = _tiny_checkpoint("mistral", tmp_path)
    state = {k: v for k, v in hf_model.state_dict().items() if "layers.1.mlp.up_proj" not in k}
    from safetensors.torch import save_file

    (tmp_path / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="up_proj"):
        _ours(config, tmp_path)
    with pytest.raises(FileNotFoundError):
        _ours(config, tmp_path / "nothing-here")


@NEEDS_KERNEL
@pytest.mark.parametrize("name", ["llama3", "qwen2"])
@pytest.mark.heavy
def test_bf16_native_norms_match_torch_norms(name, tmp_path):
    """The C fused residual-add + RMSNorm gives the logits and greedy tokens of the torch norms
    (prefill, chunk and decodes), and is used only where it applies (bf16 on CPU)."""
    config, _ = _tiny_checkpoint(name, tmp_path)
    model = _ours(config, tmp_path, torch.bfloat16)
    assert not model.native_norms
    new_t, logits_t = paged_greedy(model, PROMPTS, 6, chunk=5)
    assert model.use_native_norms(True)
    assert all(layer.input_layernorm.native and layer.post_attention_layernorm.native
               for layer in model.model.layers) and model.model.norm.native
    new_n, logits_n = paged_greedy(model, PROMPTS, 6, chunk=5)
    assert new_n == new_t
    for a, b in zip(logits_n, logits_t, strict=True):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)
    assert not _ours(config, tmp_path).use_native_norms(True)  # float32 keeps F.rms_norm (HF parity)


@NEEDS_KERNEL
@pytest.mark.parametrize("name", ["llama3", "qwen2", "llama_bias"])
@pytest.mark.heavy
def test_bf16_native_matmuls_match_torch_matmuls(name, tmp_path, monkeypatch):
    """Where prefer_native_gemm (AVX2 CPUs, AVX512-BF16 without AMX) every matmul runs in the
    native bf16-weight GEMM (biases included, float32 logits), per layer or with all layers in
    one C call (NativeLayers, when the C attention kernel serves every row): the same greedy
    tokens and logits as torch's bf16 matmuls (prefill, chunk and decodes). Elsewhere, or in
    float32, it stays off."""
    from kernels.cpu import ops
    from services.executor.layers.cpu.native_layers import NativeLayers

    config, _ = _tiny_checkpoint(name, tmp_path)
    model = _ours(config, tmp_path, torch.bfloat16)
    model.unpack_weights()
    assert model.use_native_norms(True)  # as the runner sets it: NativeLayers runs the C norms
    new_t, logits_t = paged_greedy(model, PROMPTS, 6, chunk=5)
    monkeypatch.setattr(ops, "prefer_native_gemm", lambda: False)
    assert not model.use_native_matmuls(True)
    monkeypatch.setattr(ops, "prefer_native_gemm", lambda: True)
    assert not _ours(config, tmp_path).use_native_matmuls(True)  # float32: torch's float32 matmuls
    assert not model.use_native_matmuls(False)
    weights = {n: t.clone() for n, t in model.named_parameters()}
    assert model.use_native_matmuls(True)
    assert all(proj.panel is not None for proj in projections(model)) and model.lm_head.panel is not None
    # the panels hold the matmul weights alone: the parameters' storage is released ...
    assert all(layer.self_attn.qkv_proj.weight.numel() == 0 and layer.mlp.down_proj.weight.numel() == 0
               for layer in model.model.layers)
    assert not model.use_native_matmuls(False)  # ... and rebuilt, bit for bit, when switched off
    assert all(torch.equal(t, weights[n]) for n, t in model.named_parameters())
    assert model.use_native_matmuls(True)
    model.load_weights(tmp_path)  # a reload refills the parameters, then packs and releases them again
    assert model.native_matmuls and model.model.layers[0].mlp.gate_up_proj.weight.numel() == 0
    calls, fused = [], []
    real_gemm, real_run = ops.gemm_bf16w, NativeLayers.run
    monkeypatch.setattr(ops, "gemm_bf16w", lambda *a, **kw: calls.append(a[2]) or real_gemm(*a, **kw))
    monkeypatch.setattr(NativeLayers, "run", lambda self, h, *a: fused.append(h.shape[0]) or real_run(self, h, *a))
    monkeypatch.setattr(NativeLayers, "applies", staticmethod(lambda model, caches: False))  # layer by layer
    new_l, logits_l = paged_greedy(model, PROMPTS, 6, chunk=5)
    layer = model.model.layers[0].self_attn.qkv_proj
    qkv_out = layer.q_size + 2 * layer.kv_size
    assert set(calls) == {qkv_out, config.hidden_size, 2 * config.intermediate_size, config.vocab_size}
    assert calls.count(qkv_out) == calls.count(2 * config.intermediate_size)  # every layer of every step
    assert not fused
    monkeypatch.undo()  # the C attention kernel serves every row: all layers in one C call (NativeLayers)
    monkeypatch.setattr(ops, "prefer_native_gemm", lambda: True)
    monkeypatch.setattr(ops, "gemm_bf16w", lambda *a, **kw: calls.append(a[2]) or real_gemm(*a, **kw))
    monkeypatch.setattr(NativeLayers, "run", lambda self, h, *a: fused.append(h.shape[0]) or real_run(self, h, *a))
    calls.clear()
    new_n, logits_n = paged_greedy(model, PROMPTS, 6, chunk=5)
    assert fused and set(calls) == {config.vocab_size}  # only the logits outside the C layers
    assert new_l == new_t and new_n == new_t
    for a, b, c in zip(logits_n, logits_l, logits_t, strict=True):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(b, c, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)  # same kernels but for SiLU's exp
    # steps whose prompt chunks go to torch's SDPA (here: chunks over 3 tokens) run layer by
    # layer; the decode-only steps still run in NativeLayers
    from kernels.cpu import attention_plan

    monkeypatch.setattr(attention_plan, "NATIVE_MAX_QUERY_LEN", 3)
    steps = len(fused)  # every step of the run above
    fused.clear()
    new_m, logits_m = paged_greedy(model, PROMPTS, 6, chunk=5)
    assert 0 < len(fused) < steps and len(PROMPTS) in fused  # the decode steps, not the 5-token chunks
    assert new_m == new_t
    for a, b in zip(logits_m, logits_t, strict=True):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)


@NEEDS_KERNEL
@pytest.mark.heavy
def test_native_layers_refuse_bad_slots_and_lengths(tmp_path, monkeypatch):
    """NativeLayers checks what the C code would otherwise read unchecked: a slot outside the
    cache and slot / row arrays that do not have T rows raise ValueError, the cache intact."""
    from kernels.cpu import ops
    from services.executor.layers.cpu.native_layers import NativeLayers

    monkeypatch.setattr(ops, "prefer_native_gemm", lambda: True)
    config, _ = _tiny_checkpoint("llama3", tmp_path)
    model = _ours(config, tmp_path, torch.bfloat16)
    assert model.use_native_norms(True) and model.use_native_matmuls(True)
    caches = [(torch.zeros(kv_cache_shape(config, 4, 16), dtype=torch.bfloat16),
               torch.zeros(kv_cache_shape(config, 4, 16), dtype=torch.bfloat16))
              for _ in range(config.num_hidden_layers)]
    meta = AttentionMetadata.build([3], [3], [[2]], 16)
    forward = ForwardPass(model)
    rows = forward.native_rows(caches, meta)
    assert rows is not None and isinstance(forward.native_layers, NativeLayers)
    h = model.model.embed_tokens(torch.tensor([5, 6, 7]))
    cos, sin = model.model.rotary_emb(torch.arange(3))
    with pytest.raises(ValueError, match="outside the cache"):
        forward.native_layers.run(h.clone(), cos, sin, torch.tensor([32, 33, 4 * 16]), rows)
    with pytest.raises(ValueError, match="3 rows"):
        forward.native_layers.run(h.clone(), cos, sin, torch.tensor([32, 33]), rows)
    assert all(not t.any() for kv in caches for t in kv)  # nothing was written
    out = forward.native_layers.run(h.clone(), cos, sin, meta.slot_mapping, rows)
    assert out.isfinite().all() and caches[0][0][2, :3].any() and not caches[0][0][2, 3:].any()
