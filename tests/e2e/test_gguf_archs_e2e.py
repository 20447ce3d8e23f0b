"""Every architecture served from GGUF (``shared/model_source.py``'s ``GGUF_ARCHITECTURES``; GPT-2,
Falcon and the Qwen MoEs in ``test_gguf_archs_moe_gpt2_falcon_e2e.py``):
a tiny random-weight file written as llama.cpp writes it (``tests/gguf_files.py``: its names,
the llama q/k permutation, Gemma's ``1 + w`` norms, Qwen2's biases, Phi-3's fused q|k|v and
gate|up; Q4_0, Q8_0, Q4_K and Q6_K matrices, some merged layers' shards in two formats) is
served by ``LLM(model="...gguf")`` with every matrix kept in its blocks, and its greedy tokens
in float32 equal Hugging Face's ``generate`` on the model transformers loads from the same file
(``from_pretrained(dir, gguf_file=...)``).

Mistral: transformers reads a ``llama`` file named "mistral" as a Mistral config but cannot load
its tensors (gguf-py has no ``mistral`` architecture to name them by), so its reference is
``MistralForCausalLM`` of that config holding the weights the file holds (the writer's state
dict: for every other architecture it equals transformers' reading, checked here too).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf_files import llama3_rope_freqs, write_gguf
from greedy import hf_greedy
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from pagedllm import LLM, SamplingParams
from services.executor.layers.embedding import VocabParallelEmbedding
from services.executor.layers.linear import LinearBase
from services.executor.layers.quantization import gguf as G
from services.executor.model_loader import quantization_config
from services.executor.models import get_model_class
from shared.config import kernel_cache_dir
from shared.model_source import GGUF_ARCHITECTURES, ModelNotFoundError, prepare_gguf_model

#: every matrix's input a multiple of 256 (the K-quants' super-block)
TINY = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)
CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY),  # an output matrix of its own (Q6_K)
    "mistral": lambda: MistralConfig(**TINY),
    "qwen2": lambda: Qwen2Config(**TINY, tie_word_embeddings=True),  # q, k, v biases
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=128),  # q/k norms; head_dim != hidden / heads
    "phi3": lambda: Phi3Config(**TINY),  # fused q|k|v (Q8_0), gate|up (Q4_K; layer 1 Q8_0)
    # layer 0 windowed (16 tokens: the 40-token prompt reaches past it), layer 1 full; soft caps
    # head_dim 256, as Gemma 2 2B / 9B and Gemma 3 up to 12B: query_pre_attn_scalar, which no key states, is
    # head_dim as transformers reads it (its default, 256)
    "gemma2": lambda: Gemma2Config(**TINY, head_dim=256, sliding_window=16),
    "gemma3_text": lambda: Gemma3TextConfig(**TINY, head_dim=256, sliding_window=16),  # both layers windowed
}
PROMPTS = [[1, 2, 3, 400, 500, 700], [900, 17, 31], list(range(300, 340))]


def _cache(tmp_path):
    """A cache directory for the served GGUF directories whose kernels are the ones built."""
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").symlink_to(kernel_cache_dir(), target_is_directory=True)
    return tmp_path / "cache"


def served_greedy(path, tmp_path, max_tokens: int) -> tuple[list[list[int]], str]:
    """``LLM(model=path)``'s greedy tokens of :data:`PROMPTS` in float32 (EOS ignored), and the served directory."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(model=str(path), dtype="float32", kv_cache_memory_bytes=8 << 20, cache_dir=str(_cache(tmp_path))) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs], llm.model_info.path


def transformers_reading(path, state: dict[str, torch.Tensor]):
    """The float32 model transformers loads from the GGUF file ``path``, checked to hold the writer's ``state``."""
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    loaded = hf.state_dict()
    assert sorted(loaded) == sorted(state) and all(torch.equal(loaded[k], v) for k, v in state.items())
    return hf


def reference_greedy(hf, max_tokens: int) -> list[list[int]]:
    """Hugging Face ``generate``'s greedy tokens of :data:`PROMPTS` (EOS ignored, as ours), not all alike."""
    hf.eval().generation_config.eos_token_id = None
    ref = [hf_greedy(hf, p, max_tokens)[0] for p in PROMPTS]
    assert len({tuple(t) for t in ref}) > 1
    return ref


def served_model(served):
    """The served directory's model, as the executor reads its config and weights (float32, CPU)."""
    config = AutoConfig.from_pretrained(served)
    model = get_model_class(config)(config, torch.float32, torch.device("cpu"),
                                     quant_config=quantization_config(served, config))
    model.load_weights(served)
    return model


def test_every_served_architecture_is_tested():
    from test_gguf_archs_moe_gpt2_falcon_e2e import CONFIGS as MORE  # GPT-2, Falcon, Qwen2-MoE, Qwen3-MoE

    assert set(CONFIGS) | set(MORE) == set(GGUF_ARCHITECTURES)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_gguf_served_directly_gives_the_tokens_of_transformers_reading_of_the_file(model_type, tmp_path,
                                                                                  smollm2_path):
    path = tmp_path / f"tiny-{model_type}.gguf"
    state = write_gguf(path, CONFIGS[model_type](), smollm2_path)
    ours, served = served_greedy(path, tmp_path, 8)
    config = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    assert config.model_type == model_type
    if model_type == "mistral":
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        hf.load_state_dict(state)
    else:
        hf = transformers_reading(path, state)
    assert ours == reference_greedy(hf, 8)

    model = served_model(served)
    layers = [m for m in model.modules() if isinstance(m, LinearBase | VocabParallelEmbedding)]
    assert all(m.quant_method.quantized for m in layers)  # nothing dequantized
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[1].mlp
    assert attn.o_proj.quant_method.fmt == G.Q4_0 and model.model.embed_tokens.quant_method.fmt == G.Q8_0
    if model_type == "phi3":  # the fused tensors, whole
        assert attn.qkv_proj.quant_method.fmt == G.Q8_0 and mlp.gate_up_proj.quant_method.fmt == G.Q8_0
    else:  # q, k Q4_K beside v Q6_K; gate Q4_K beside up Q8_0: each shard's blocks
        assert [p.fmt for p in attn.qkv_proj.quant_method.parts] == [G.Q4_K, G.Q4_K, G.Q6_K]
        assert [p.fmt for p in mlp.gate_up_proj.quant_method.parts] == [G.Q4_K, G.Q8_0]


def test_an_architecture_not_served_from_gguf_is_refused_naming_those_that_are(tmp_path):
    """GPT-NeoX and Gemma 1 files (architectures transformers' GGUF support does not read) and a
    BLOOM file (one it reads, which this engine does not implement) are refused with the list of
    served architectures."""
    from gguf import GGUFWriter

    for arch in ("gptneox", "gemma", "bloom"):
        path = tmp_path / f"{arch}.gguf"
        writer = GGUFWriter(path, arch)
        writer.add_block_count(1)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(ModelNotFoundError, match=rf"GGUF architecture '{arch}' is not served from GGUF "
                                                     r"\(supported: falcon, gemma2, gemma3_text, gpt2, "
                                                     r"llama, mistral, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe\)"):
            prepare_gguf_model(path, tmp_path / "cache")


#: files stating what transformers' GGUF reader leaves to the config class's defaults
COMPLETED = {
    # Qwen3Config's default head_dim is 128: the file's attention.key_length says 64
    "qwen3-head-dim-64": lambda: Qwen3Config(**TINY, head_dim=64),
    # Gemma 3 4B and larger: linear RoPE scaling on the full-attention layers (gemma3.rope.scaling.*)
    # (6 layers: Gemma 3's pattern makes the last one full attention)
    "gemma3-linear-rope": lambda: Gemma3TextConfig(
        **{**TINY, "num_hidden_layers": 6}, head_dim=64, sliding_window=16, query_pre_attn_scalar=64,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}),
    # Llama 3.1's scaling, stored as rope_freqs.weight (one divisor per rotated pair); with a context of 256
    # the 32 pairs of a 64-dimension head fall in all three bands: kept, smoothed, divided by 8
    "llama3-rope-freqs": lambda: LlamaConfig(**TINY, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256, "rope_theta": 10000.0}),
    # Phi-3 128k's LongRoPE, stored as rope_factors_long / _short tensors and phi3.rope.scaling.* keys: the 6-token
    # prompt rotates by the short factors, the 40-token one (over the original 32) by the long ones
    "phi3-longrope": lambda: Phi3Config(**TINY, original_max_position_embeddings=32, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1 + i / 64 for i in range(32)],
        "long_factor": [1 + i / 6 for i in range(32)]}),
}


@pytest.mark.parametrize("name", sorted(COMPLETED))
def test_the_served_config_takes_what_the_file_states_beyond_transformers_reading(name, tmp_path, smollm2_path):
    """The served directory's config has the file's head_dim and Gemma 3 RoPE scaling, which
    transformers' reading of the file leaves at the config class's defaults, so the served
    model gives the greedy tokens of the original model (Hugging Face's, on the weights the file
    holds)."""
    from greedy import paged_greedy

    original = COMPLETED[name]()
    path = tmp_path / f"{name}.gguf"
    state = write_gguf(path, original, smollm2_path)
    read = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name).to_dict()
    served = prepare_gguf_model(path, tmp_path / "cache")
    config = AutoConfig.from_pretrained(served)
    if name.startswith("qwen3"):
        assert (read["head_dim"], config.head_dim) == (128, 64)
    elif name.startswith("llama3"):  # served as LongRoPE: 1 / (divisor_i theta^(2i / d)), one list at every length
        freqs = llama3_rope_freqs(original).tolist()
        assert read["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
        assert sorted(set(freqs))[0] == 1.0 and max(freqs) == 8.0 and len(set(freqs)) > 3
        assert config.rope_parameters == {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": freqs,
                                          "long_factor": freqs, "factor": 1.0, "attention_factor": 1.0,
                                          "original_max_position_embeddings": 512}  # transformers adds it
    elif name.startswith("phi3"):
        assert read["rope_parameters"]["rope_type"] == "default"
        rope, want = config.rope_parameters, original.rope_parameters
        for key in ("short_factor", "long_factor"):
            assert rope[key] == torch.tensor(want[key], dtype=torch.float32).tolist()
        assert (rope["original_max_position_embeddings"], config.original_max_position_embeddings) == (32, 32)
        assert rope["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(512 / 32) / math.log(32)), rel=1e-6)
    else:
        assert read["rope_parameters"]["full_attention"] == {"rope_type": "default", "rope_theta": 1000000.0}
        assert config.rope_parameters["full_attention"] == original.rope_parameters["full_attention"]
        assert config.layer_types == original.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
        assert (read["query_pre_attn_scalar"], config.query_pre_attn_scalar) == (256, 64)  # head_dim
    model = get_model_class(config)(config, torch.float32, torch.device("cpu"),
                                     quant_config=quantization_config(served, config))
    model.load_weights(served)
    hf = AutoModelForCausalLM.from_config(original, dtype=torch.float32)
    hf.load_state_dict(state)
    hf.eval()
    prompts = [[1, 2, 3, 400, 500, 700], list(range(300, 340))]
    ours, logits = paged_greedy(model, prompts, 6)
    refs = [hf_greedy(hf, p, 6) for p in prompts]
    assert ours == [tokens for tokens, _ in refs]
    if name[:6] in ("llama3", "phi3-l"):  # the scaling matters here: without it (transformers' reading) other logits
        torch.testing.assert_close(logits[1], refs[1][1], rtol=1e-4, atol=1e-4)
        unscaled = AutoModelForCausalLM.from_config(type(original)(**TINY), dtype=torch.float32)
        unscaled.load_state_dict(state)
        assert (hf_greedy(unscaled.eval(), prompts[1], 1)[1] - refs[1][1]).abs().max() > 0.05


def test_rope_factors_that_do_not_fit_are_refused(tmp_path, smollm2_path):
    """LongRoPE factors are served from phi3 files only, one positive factor per rotated pair."""
    head = TINY["hidden_size"] // TINY["num_attention_heads"]
    cases = [(LlamaConfig(**TINY), {"rope_factors_long.weight": np.ones(head // 2), "rope_factors_short.weight":
                                    np.ones(head // 2)}, "served from phi3 GGUF files only, not llama"),
             (COMPLETED["phi3-longrope"](), {"rope_factors_long.weight": np.ones(head)},
              f"rope_factors_long.weight holds {head} values .* needs {head // 2}"),
             (LlamaConfig(**TINY), {"rope_freqs.weight": np.zeros(head // 2)}, "smallest 0")]
    for i, (config, extra, message) in enumerate(cases):
        path = tmp_path / f"bad-{i}.gguf"
        write_gguf(path, config, smollm2_path, extra=extra)
        with pytest.raises(ModelNotFoundError, match=message):
            prepare_gguf_model(path, tmp_path / "cache")
