"""GPT-2, Falcon, Qwen2-MoE and Qwen3-MoE served from GGUF files (``tests/gguf_files.py`` writes
them as llama.cpp's converter does: GPT-2's ``Conv1D`` weights transposed, Falcon's fused
q | k | v de-interleaved, the MoE experts stacked ``[E, rows, K]``), every matrix kept in its
blocks but the MoE routers (F32 in llama.cpp's files), the experts too (``layers/quantization/gguf/moe.py``:
one GGUF matmul per expert); greedy tokens in float32 equal Hugging Face's ``generate`` on the
model transformers loads from the same file.

Where transformers' reading of a file leaves what it states to the config class's defaults
(``shared/gguf_config.py``: Falcon's new decoder architecture, Qwen-MoE expert sizes other than
Qwen1.5-MoE-A2.7B's and Qwen3-30B-A3B's), transformers cannot load the file's tensors into its
model; the reference is then Hugging Face's model of the original config holding the weights
the file holds (the writer's state dict).
"""

from __future__ import annotations

import pytest
import torch
from gguf_files import F16, MIXED, Q5_0, write_gguf
from greedy import hf_greedy, paged_greedy
from native_builds import NEEDS_KERNEL
from test_gguf_archs_e2e import PROMPTS, reference_greedy, served_greedy, served_model, transformers_reading
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    FalconConfig,
    GPT2Config,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from services.executor.layers.embedding import VocabParallelEmbedding
from services.executor.layers.linear import LinearBase, UnquantizedLinearMethod
from services.executor.layers.quantization import gguf as G
from services.executor.layers.quantization.gguf import GGUFMoEMethod
from services.executor.model_loader import quantization_config
from services.executor.models import get_model_class
from shared.model_source import prepare_gguf_model

NO_IDS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
#: 2 layers, hidden 256 (the K-quants' super-block), 4 heads; 4 experts, 2 per token
_MOE = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, num_experts=4, num_experts_per_tok=2, **NO_IDS)
CONFIGS = {
    # an output matrix of its own: llama.cpp's older GPT-2 conversions wrote the tied wte again
    "gpt2": lambda: GPT2Config(vocab_size=1024, n_embd=256, n_layer=2, n_head=4, n_positions=1024,
                               tie_word_embeddings=False, **NO_IDS),
    # Falcon-7B's form: multi-query, one norm, parallel attention (transformers reads every file so)
    "falcon": lambda: FalconConfig(vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   **NO_IDS),
    # the expert sizes transformers' reading leaves at Qwen2MoeConfig's defaults (Qwen1.5-MoE-A2.7B's):
    # 1408 (down experts in 32-element blocks), shared 5632
    "qwen2_moe": lambda: Qwen2MoeConfig(**_MOE),
    "qwen3_moe": lambda: Qwen3MoeConfig(**_MOE, norm_topk_prob=True),  # experts of 768 (the default)
}


def _check_kept(model, model_type: str) -> None:
    """Every matrix in its blocks but the routers; merged shards and experts in the file's formats."""
    routers = {m for layer in getattr(model, "model", model).modules() for name, m in layer.named_children()
               if name in ("gate", "shared_expert_gate") and model_type.endswith("moe")}
    layers = [m for m in model.modules() if isinstance(m, LinearBase | VocabParallelEmbedding) and m not in routers]
    assert all(m.quant_method.quantized for m in layers)  # nothing dequantized
    assert all(not r.quant_method.quantized for r in routers)  # F32 in the file
    if model_type == "gpt2":
        block = model.transformer.h[0]
        assert [block.attn.c_attn.quant_method.fmt, block.attn.c_proj.quant_method.fmt, block.mlp.c_fc.quant_method.fmt,
                model.lm_head.quant_method.fmt] == [G.Q8_0, G.Q4_0, G.Q4_K, G.Q6_K]
    elif model_type == "falcon":
        attn = model.transformer.h[0].self_attention
        assert [attn.query_key_value.quant_method.fmt, attn.dense.quant_method.fmt] == [G.Q8_0, G.Q4_0]
    else:
        for i, down in enumerate((G.Q8_0, G.Q4_0)):  # layer 1's down experts Q4_0
            experts = model.model.layers[i].mlp.experts
            assert isinstance(experts.quant_method, GGUFMoEMethod) and experts.w13.numel() == 0
            assert experts.quant_method.fmts == (G.Q4_K, G.Q8_0, down)
            assert expert_matmuls(experts, torch.float32) == ("blocks", "blocks")
            assert [p.fmt for p in experts.gguf_experts[0].gate_up.quant_method.parts] == [G.Q4_K, G.Q8_0]


def expert_matmuls(experts, dtype: torch.dtype) -> tuple[str, str]:
    """How a ``FusedMoE`` holds its experts' gate | up and down matmuls, every expert alike:
    ``"blocks"`` (a GGUF linear method), ``"dense"`` (``F.linear`` on values in ``dtype`` beside the
    other matmul's blocks), or ``FusedMoE``'s own ``"w13"`` / ``"w2"`` (``dtype``)."""
    if not experts.quant_method.quantized:  # the unquantized method's w13 / w2
        assert experts.w13.dtype == experts.w2.dtype == dtype and experts.w13.numel() > 0 and experts.w2.numel() > 0
        return "w13", "w2"
    held = []
    for name in ("gate_up", "down"):
        layers = [getattr(e, name) for e in experts.gguf_experts]
        if all(layer.quant_method.quantized for layer in layers):
            held.append("blocks")
        else:
            assert all(type(layer.quant_method) is UnquantizedLinearMethod and layer.weight.dtype == dtype
                       for layer in layers)
            held.append("dense")
    return held[0], held[1]


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_gguf_served_directly_gives_the_tokens_of_transformers_reading_of_the_file(model_type, tmp_path,
                                                                                  smollm2_path):
    path = tmp_path / f"tiny-{model_type}.gguf"
    state = write_gguf(path, CONFIGS[model_type](), smollm2_path)
    ours, served = served_greedy(path, tmp_path, 6)
    hf = transformers_reading(path, state)
    assert hf.config.model_type == model_type
    assert ours == reference_greedy(hf, 6)
    _check_kept(served_model(served), model_type)


#: files whose config transformers' reading gets wrong (``shared/gguf_config.py`` completes it)
COMPLETED = {
    # Falcon-40B's form: 2 KV groups of 2 query heads, ln_attn and ln_mlp, an untied LM head
    "falcon-new-architecture": lambda: FalconConfig(
        vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=True,
        num_kv_heads=2, tie_word_embeddings=False, layer_norm_epsilon=2**-10, **NO_IDS),  # exact in float32
    # Falcon 2's: the new architecture with one norm
    "falcon2-one-norm": lambda: FalconConfig(
        vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=True,
        num_kv_heads=2, num_ln_in_parallel_attn=1, **NO_IDS),
    # experts of 256 and a shared expert of 512: not Qwen2MoeConfig's defaults
    "qwen2-moe-expert-sizes": lambda: Qwen2MoeConfig(**_MOE, moe_intermediate_size=256,
                                                     shared_expert_intermediate_size=512),
}


@pytest.mark.parametrize("name", sorted(COMPLETED))
def test_the_served_config_takes_the_architecture_the_file_states(name, tmp_path, smollm2_path):
    """The served directory's config is the original model's where transformers' reading is not,
    so the served model gives the greedy tokens of Hugging Face's model of the original config on
    the weights the file holds."""
    original = COMPLETED[name]()
    path = tmp_path / f"{name}.gguf"
    state = write_gguf(path, original, smollm2_path)
    served = prepare_gguf_model(path, tmp_path / "cache")
    config = AutoConfig.from_pretrained(served)
    keys = (("new_decoder_architecture", "num_kv_heads", "num_ln_in_parallel_attn", "layer_norm_epsilon",
             "tie_word_embeddings") if name.startswith("falcon") else
            ("moe_intermediate_size", "shared_expert_intermediate_size"))
    assert [getattr(config, k) for k in keys] == pytest.approx([getattr(original, k) for k in keys], rel=1e-7)
    model = get_model_class(config)(config, torch.float32, torch.device("cpu"),
                                     quant_config=quantization_config(served, config))
    model.load_weights(served)
    hf = AutoModelForCausalLM.from_config(original, dtype=torch.float32)
    hf.load_state_dict(state)
    hf.eval()
    prompts = [[1, 2, 3, 400, 500, 700], list(range(300, 340))]
    assert paged_greedy(model, prompts, 6)[0] == [hf_greedy(hf, p, 6)[0] for p in prompts]


#: MoE files whose experts are kept matmul by matmul (``gguf/moe.py``'s ``kept_formats``): the model, the
#: experts' formats (by kind, then by tensor) and each layer's gate | up and down as held
EXPERTS = {
    # layer 0 as llama.cpp's Q4_K_M files of Qwen1.5-MoE: Q4_K gate and up kept, Q5_0 down dense;
    # layer 1: an F16 gate beside a Q4_K up (the pair dense), Q8_0 down kept
    "down-q5_0": ("qwen2_moe", {"ffn_gate_exps": G.Q4_K, "ffn_up_exps": G.Q4_K, "ffn_down_exps": Q5_0},
                  {"blk.1.ffn_gate_exps": F16, "blk.1.ffn_down_exps": G.Q8_0},
                  [(G.Q4_K, G.Q4_K, None), (None, None, G.Q8_0)], [("blocks", "dense"), ("dense", "blocks")]),
    # neither matmul kept in either layer: FusedMoE's dense w13 / w2 (the fused MoE kernels)
    "none-kept": ("qwen3_moe", {"ffn_gate_exps": Q5_0, "ffn_up_exps": F16, "ffn_down_exps": Q5_0}, {},
                  [None, None], [("w13", "w2")] * 2),
}


@pytest.mark.parametrize("name", sorted(EXPERTS))
def test_moe_experts_are_kept_matmul_by_matmul(name, tmp_path, smollm2_path):
    """Each expert matmul whose formats are kept holds its blocks, the other its values dequantized
    (exactly the file's); greedy tokens are those of transformers' reading of the file, and the
    prompt logits within float32 rounding of its."""
    assert Q5_0.ggml_type not in G.FORMATS and F16.ggml_type not in G.FORMATS
    model_type, formats, overrides, fmts, held = EXPERTS[name]
    path = tmp_path / f"{name}.gguf"
    state = write_gguf(path, CONFIGS[model_type](), smollm2_path, MIXED | formats, overrides)
    ours, served = served_greedy(path, tmp_path, 6)
    hf = transformers_reading(path, state)
    assert ours == reference_greedy(hf, 6)
    model = served_model(served)
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        assert expert_matmuls(experts, torch.float32) == held[i]
        method = experts.quant_method if experts.quant_method.quantized else None  # GGUFMoEMethod
        assert (method.fmts if method else None) == fmts[i]
        w13, w2 = method.weights(experts) if method else (experts.w13, experts.w2)  # [E, 2 I, hidden], [E, hidden, I]
        assert torch.equal(w13, state[f"model.layers.{i}.mlp.experts.gate_up_proj"])
        assert torch.equal(w2, state[f"model.layers.{i}.mlp.experts.down_proj"])
    _, logits = paged_greedy(model, PROMPTS, 1)
    for prompt, ours_logits in zip(PROMPTS, logits, strict=True):
        torch.testing.assert_close(ours_logits, hf_greedy(hf, prompt, 1)[1], rtol=1e-4, atol=1e-4)


def test_a_tied_gpt2_file_without_an_output_tensor_gives_the_tokens_of_transformers_reading(tmp_path, smollm2_path):
    """llama.cpp's converter today writes no ``output.weight`` for GPT-2 (its head is ``token_embd``):
    the served model ties its LM head to the embedding's blocks."""
    from gguf import GGUFReader

    path = tmp_path / "tiny-gpt2-tied.gguf"
    state = write_gguf(path, GPT2Config(vocab_size=1024, n_embd=256, n_layer=2, n_head=4, n_positions=1024,
                                        tie_word_embeddings=True, **NO_IDS), smollm2_path)
    names = {t.name for t in GGUFReader(path).tensors}
    assert "token_embd.weight" in names and "output.weight" not in names
    ours, served = served_greedy(path, tmp_path, 6)
    hf = transformers_reading(path, state)
    assert hf.config.tie_word_embeddings
    assert ours == reference_greedy(hf, 6)
    model = served_model(served)
    assert model.tie_word_embeddings and model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.quant_method.fmt == G.Q8_0  # the embedding's blocks


@NEEDS_KERNEL
def test_moe_experts_kept_matmul_by_matmul_in_bf16_follow_float32(tmp_path, smollm2_path):
    """The ``down-q5_0`` experts (blocks beside dense values, both ways) served in bf16 with the
    native kernels, as on CPU by default: the dense weights held in bf16, the first greedy tokens
    of float32's and the prompt logits within bf16's error of float32's.

    The tolerance, 5% of the largest float32 logit (that of ``test_gguf_native_layers``' bf16
    GGUF check): bf16 rounds every activation to 8 significant bits (2**-9 relative) and the
    native GGUF kernels quantize bf16 activations to int8 per 32 elements (up to max|x| / 254, as
    llama.cpp's Q8_0), about 0.5% per matmul, over two layers' matmuls and residual sums. Weights
    of std 0.05 (not 0.15) keep the router's top-2 far enough apart that bf16 picks float32's
    experts: errors up to 0.08 of logits up to 3.6, where the experts move the logits by over 1."""
    model_type, formats, overrides, _, held = EXPERTS["down-q5_0"]
    path = tmp_path / "down-q5_0.gguf"
    write_gguf(path, CONFIGS[model_type](), smollm2_path, MIXED | formats, overrides, std=0.05)
    served = prepare_gguf_model(path, tmp_path / "cache")
    config = AutoConfig.from_pretrained(served)
    prompts = [[1, 2, 3, 400, 500, 700], [900, 17, 31], [5, 60, 7, 80, 9, 100, 11, 120], list(range(300, 340))]
    runs = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = get_model_class(config)(config, dtype=dtype, device="cpu", native_cpu_kernels=True,
                                         quant_config=quantization_config(served, config))
        model.load_weights(served)
        assert [expert_matmuls(layer.mlp.experts, dtype) for layer in model.model.layers] == held
        runs[dtype] = paged_greedy(model, prompts, 1)
    # the short prompts' float32 first tokens lead the runner-up by 0.3 to 1.0: more than bf16 moves them
    # (the 40-token prompt's by 0.09: its logits only)
    assert runs[torch.bfloat16][0][:3] == runs[torch.float32][0][:3]
    for bf16, f32 in zip(runs[torch.bfloat16][1], runs[torch.float32][1], strict=True):
        torch.testing.assert_close(bf16.float(), f32, atol=0.05 * f32.abs().max().item(), rtol=0)
